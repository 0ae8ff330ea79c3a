"""Fixtures of the suites and, at the end of the session, every figure and
each goal of the issues as a ratio measured in this run (reported, never
asserted: a loaded machine must not fail a build). Where figures are medians
of interleaved passes (test_real.py), a goal is judged on the medians'
ratio, and the summary also says in how many passes it held."""

from __future__ import annotations

import pytest
from benchlib import CPUS, PASSES, RESULTS, SKIPPED

from shmvec.bench.printed import take_printed
from shmvec.bench.peers import PEERS, build
from shmvec.bench.report import about_the_run

# (case, numerator, denominator, goal): numerator / denominator should reach
# the goal. Steps/s are better higher; PSS and start-up seconds lower, so
# their ratios put the peer on top. "limit" is one plain single-env loop per
# usable CPU, all running at once, their steps/s summed (measured, in this run).
GOALS = [
    # issue 11: fast in the user's loop (bench/test_real.py)
    ("pong-16", "shmvec", "limit", 0.9),
    ("halfcheetah-16", "shmvec", "limit", 0.9),
    ("halfcheetah-16", "shmvec", "envpool", 1.0),
    # async mode with infos every step (on 2 CPUs one worker, and the caller's own slice stepped in recv())
    ("halfcheetah-16", "shmvec-async", "sync", 1.0),
    ("policy-64", "shmvec", "sync", 1.3),
    ("policy-64", "shmvec-async", "sync", 1.3),
    # beside two CPU hogs: every configuration
    *[(case, who, "sync", 1.0) for case in ("busy-64", "busy-256")
      for who in ("shmvec", "shmvec-async", "shmvec-unpinned", "shmvec-1worker", "shmvec-2workers")],
    # ... and hogs that start while the envs step
    *[(case, who, "sync", 1.0) for case in ("busy-late-64", "busy-late-256") for who in ("shmvec", "shmvec-async")],
    ("cartpole-64", "shmvec", "limit", 0.85),
    ("cartpole-64", "shmvec", "sync", 1.7),
    ("cartpole-64", "shmvec", "async", 15),
    ("noop-64", "shmvec", "sync", 2),
    ("noop-2", "shmvec", "sync", 0.5),
    ("image-16", "shmvec", "sync", 1),
    ("image-16", "shmvec", "async", 5),
    ("memory-64-fork", "async", "shmvec", 5),
    ("memory-64-forkserver", "async", "shmvec", 5),
    ("startup-64-fork", "async", "shmvec", 5),
    ("startup-64-forkserver", "async", "shmvec", 5),
    ("straggler-32", "shmvec-async", "shmvec-lockstep", 2.5),
    # issue 11: async mode never below lock-step on stragglers, with shmvec's own choice of workers
    ("straggler-32-default-workers", "shmvec-async", "shmvec-lockstep", 1.0),
    # async mode's bookkeeping per batch, where nothing overlaps (no workers)
    ("cartpole-async-256-no-workers", "shmvec-async", "shmvec-lockstep", 0.95),
    # async mode with an update after each rollout that needs torch's threads
    ("async-ppo-mujoco-8", "shmvec-async", "sync", 1.0),
    ("async-ppo-mujoco-8", "shmvec-async", "shmvec-async-held", 1.0),
    # the same with the update between a rollout's last recv() and its send()
    ("async-ppo-mujoco-8", "shmvec-async-recv-update", "sync", 1.0),
    # a CNN policy at torch's own threads: never slower than DummyVecEnv
    ("sb3-ppo-atari-8", "shmvec", "dummy", 1),
    # a quick policy with an update that needs torch's threads: the same
    ("sb3-ppo-mujoco-8", "shmvec", "dummy", 1),
    # a gradient step after every step, the envs 2% of the loop: the same
    ("sb3-sac-mujoco-4", "shmvec", "dummy", 1),
    ("sb3-step-64", "shmvec", "dummy", 1),
    ("sb3-step-64", "shmvec", "subproc", 1),
    ("sb3-step-8", "shmvec", "subproc", 1),
]

FORMATS = {"steps_per_s": "{:,.0f} steps/s", "seconds": "{:.3f} s", "pss_mib": "{:,.0f} MiB PSS"}


def pytest_addoption(parser):
    parser.addoption("--bench-passes", type=int, default=3,
                     help="interleaved passes over each case's configurations in test_real.py (default 3); "
                          "its figures are their medians")


@pytest.fixture
def vector_env():
    """Builds vector envs (skipping peers that cannot run here) and closes
    them after the test."""
    built = []

    def make(peer: str, spec: str, num_envs: int, **kwargs):
        reason = PEERS[peer].unavailable(spec)
        if reason:
            pytest.skip(reason)
        cap = PEERS[peer].max_envs
        if cap and num_envs > cap:
            pytest.skip(f"{peer} starts a process per env: capped at {cap} envs")
        built.append(build(peer, spec, num_envs, **kwargs))
        return built[-1]

    yield make
    for envs in built:
        envs.close()


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    write = terminalreporter.write_line
    printed = take_printed()
    if printed:  # each distinct line the measuring processes printed, once
        terminalreporter.section("printed by the measuring processes")
        for line in printed:
            write(line)
    terminalreporter.section("shmvec figures")
    write(f"on {about_the_run(CPUS)['machine']}")  # figures from two CPU models do not compare
    for case in sorted({case for case, _ in RESULTS}):
        write(f"{case}:")
        for (c, who), (value, unit) in RESULTS.items():
            if c == case:
                rates = PASSES.get((c, who), [])
                between = f"   min-max {min(rates):,.0f}-{max(rates):,.0f}" if len(rates) > 1 else ""
                write(f"    {who:<28} {FORMATS[unit].format(value):>20}{between}")
        for (c, who), reason in SKIPPED.items():
            if c == case:
                write(f"    {who:<28} not measured: {reason}")
    sampling = {who: value for (case, who), (value, _) in RESULTS.items() if case.startswith("sampling")}
    if sampling:
        write(f"fastest split of the CPUs with a policy in the loop: {max(sampling, key=sampling.get)}")
    terminalreporter.section("shmvec goals (ratios in this run)")
    missing = []
    for case, top, bottom, goal in GOALS:
        if (case, top) not in RESULTS or (case, bottom) not in RESULTS:
            missing.append(case)
            continue
        ratio = RESULTS[case, top][0] / RESULTS[case, bottom][0]
        verdict = "met" if ratio >= goal else "MISSED"
        # Pass by pass (each pass measured both, one after the other): how often the goal held.
        paired = list(zip(PASSES.get((case, top), []), PASSES.get((case, bottom), [])))
        held = f"   passes {sum(t / b >= goal for t, b in paired)}/{len(paired)}" if paired else ""
        write(f"{case:<22} {f'{top} / {bottom}':<32} {ratio:8.2f}   goal >= {goal:<5} {verdict}{held}")
    if missing:
        write(f"not measured in this run: {', '.join(dict.fromkeys(missing))}")
