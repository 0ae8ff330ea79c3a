"""Helpers shared by the suites: time a vector env's steps,
time or measure it in a fresh process, and keep each figure for the summary
that conftest.py prints (ratios against the goals of the issues).

Functions that run in a fresh process live here, so that it can import them
(pytest puts bench/ on sys.path, and spawned processes inherit it).
"""

from __future__ import annotations

import itertools
import statistics

from shmvec._engine.system import usable_cpus
from shmvec.bench.measure import FreshProcess, action_batches, step_for, tree_memory, warmup_seconds
from shmvec.bench.peers import build, single_action_space

CPUS = usable_cpus()
WARMUP_S = warmup_seconds(1.0)

# (case, who) -> (value, unit), for the summary at the end of the session;
# where a figure is the median of passes, PASSES has each pass's figure, in
# order; SKIPPED: why a configuration was not measured.
RESULTS: dict[tuple[str, str], tuple[float, str]] = {}
PASSES: dict[tuple[str, str], list[float]] = {}
SKIPPED: dict[tuple[str, str], str] = {}


def record(benchmark, case: str, who: str, value: float, unit: str) -> None:
    """Keeps a figure for the summary and in the saved benchmark JSON."""
    benchmark.extra_info[unit] = value
    RESULTS[(case, who)] = (value, unit)


def record_passes(benchmark, case: str, who: str, measured: list[dict]) -> None:
    """Keeps the median steps/s of `who`'s passes (each a measurement's
    dict) for the summary, with their min-max; every pass goes in the saved
    benchmark JSON, under `who`."""
    rates = [m["steps_per_s"] for m in measured]
    median = statistics.median(rates)
    benchmark.extra_info[who] = {"steps_per_s": median, "passes": measured}
    RESULTS[(case, who)] = (median, "steps_per_s")
    PASSES[(case, who)] = rates


def skipped(case: str, who: str, reason: str) -> None:
    """Notes a configuration that cannot run here, for the summary."""
    SKIPPED[(case, who)] = reason


def time_calls(benchmark, step, actions: list, num_envs: int, case: str, who: str) -> None:
    """Times `step` with each of `actions` in turn (made beforehand), after a
    warm-up; records env steps per second (one call steps `num_envs` envs)."""
    benchmark.group = case
    step_for(step, actions, WARMUP_S)
    cycle = itertools.cycle(actions)
    benchmark(lambda: step(next(cycle)))
    if not benchmark.disabled:  # else nothing was timed
        # The mean, not the median: slow steps (stragglers) are part of throughput.
        record(benchmark, case, who, num_envs / benchmark.stats.stats.mean, "steps_per_s")


def time_steps(benchmark, envs, num_envs: int, case: str, who: str) -> None:
    """Times a vector env's steps."""
    envs.reset()  # no seed: SB3's reset takes none
    actions = action_batches(single_action_space(envs), num_envs)
    time_calls(benchmark, envs.step, actions, num_envs, case, who)


# -- run in a fresh process ---------------------------------------------------

_held: list = []


def ready() -> None:
    """Nothing: returns once the process has imported this module (and so
    shmvec, numpy and gymnasium), before any clock starts."""


def start(peer: str, spec: str, num_envs: int, start_method: str | None) -> None:
    """Builds a vector env and resets it: start-up to the first observation."""
    envs = build(peer, spec, num_envs, start_method=start_method)
    _held.append(envs)
    envs.reset(seed=0)


def memory(peer: str, spec: str, num_envs: int, start_method: str | None, steps: int = 100) -> float:
    """PSS in MiB of this process and all it started, with a vector env that
    has stepped a while."""
    start(peer, spec, num_envs, start_method)
    envs = _held[-1]
    for actions in action_batches(single_action_space(envs), num_envs, count=steps):
        envs.step(actions)
    return tree_memory()["pss_mib"]


def release() -> None:
    while _held:
        _held.pop().close()


def in_fresh_process(benchmark, fn, *args, rounds: int):
    """Times `fn(*args)` in a new process each round (started, its imports
    done, before the clock starts); returns the last round's result."""
    processes: list[FreshProcess] = []

    def close_last() -> None:
        process = processes.pop()
        process.call(release)
        process.close()

    def setup():
        if processes:
            close_last()
        process = FreshProcess()
        process.call(ready)
        processes.append(process)
        return (process,), {}

    try:
        return benchmark.pedantic(lambda process: process.call(fn, *args), setup=setup, rounds=rounds)
    finally:
        if processes:
            close_last()
