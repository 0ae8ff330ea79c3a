"""How the benchmarks measure: stepping loops timed with actions made
beforehand, the rate of one env in a plain loop (which sets the machine's
limit), fresh processes that keep one measurement from disturbing the next,
and the memory of a process tree (read from /proc, so Linux only)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from gymnasium.vector.utils import batch_space

from shmvec.peers import env_factory, single_action_space

__all__ = ["action_batches", "step_for", "warmup_seconds", "vector_rate", "plain_step", "single_env_rate",
           "tree_memory", "FreshProcess", "isolated"]

ACTION_BATCHES = 64  # cycled through, so that making actions costs nothing in the timed loop


def action_batches(space, num_envs: int | None, count: int = ACTION_BATCHES, seed: int = 0) -> list:
    """`count` seeded samples of `space` batched `num_envs` times (single
    actions when `num_envs` is None)."""
    space = space if num_envs is None else batch_space(space, num_envs)
    space.seed(seed)
    return [space.sample() for _ in range(count)]


def step_for(step: Callable[[Any], Any], actions: list, seconds: float) -> tuple[int, float]:
    """Calls `step` with each of `actions` in turn for `seconds`; returns the
    number of calls and the time they took."""
    calls = 0
    start = now = time.perf_counter()
    end = start + seconds
    while now < end:
        step(actions[calls % len(actions)])
        calls += 1
        now = time.perf_counter()
    return calls, now - start


def warmup_seconds(seconds: float) -> float:
    """Stepping before the clock starts: caches, spin budgets, lazy imports."""
    return min(1.0, seconds / 4)


def vector_rate(envs, num_envs: int, seconds: float) -> float:
    """Env steps per second of a vector env over `seconds`, after a warm-up."""
    envs.reset()
    actions = action_batches(single_action_space(envs), num_envs)
    step_for(envs.step, actions, warmup_seconds(seconds))
    calls, elapsed = step_for(envs.step, actions, seconds)
    return calls * num_envs / elapsed


def plain_step(env) -> Callable[[Any], None]:
    """Steps one env with an action, resetting it when an episode ends: the
    body of a plain loop, no vector env."""

    def step(action) -> None:
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset()

    return step


def single_env_rate(spec: str, seconds: float) -> float:
    """Steps per second of one env of `spec` in a plain loop: the machine's
    limit is usable CPUs times this."""
    env = env_factory(spec)()
    try:
        env.reset(seed=0)
        step = plain_step(env)
        actions = action_batches(env.action_space, None)
        step_for(step, actions, warmup_seconds(seconds))
        calls, elapsed = step_for(step, actions, seconds)
    finally:
        env.close()
    return calls / elapsed


def _descendants(pid: int) -> list[int]:
    children = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # it ended meanwhile
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])  # the name before ")" may hold spaces
            children[ppid].append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children[todo.pop()]
        found += kids
        todo += kids
    return found


def _kib(path: str, field: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:  # it ended meanwhile
        pass
    return 0


def tree_memory(pid: int | None = None) -> dict[str, float]:
    """Memory of a process and all its descendants (workers, fork servers),
    in MiB: `peak_rss_mib` sums each one's peak resident set (pages shared
    between them count in each); `pss_mib` sums their proportional set size
    now (a shared page counts once, split between its sharers)."""
    pids = [pid or os.getpid()]
    pids += _descendants(pids[0])
    return {
        "peak_rss_mib": sum(_kib(f"/proc/{p}/status", "VmHWM") for p in pids) / 1024,
        "pss_mib": sum(_kib(f"/proc/{p}/smaps_rollup", "Pss") for p in pids) / 1024,
        "processes": len(pids),
    }


def _serve(conn) -> None:
    try:
        while True:
            try:
                fn, args = conn.recv()
            except EOFError:  # the caller is done, or gone
                return
            try:
                reply = (True, fn(*args))
            except Exception:
                reply = (False, traceback.format_exc())
            conn.send(reply)
    except KeyboardInterrupt:  # Ctrl-C reaches us too; the caller reports it
        return


class FreshProcess:
    """A new interpreter (spawn) that runs the calls sent to it: what it
    measures is not disturbed by earlier measurements (threads, fork servers,
    memory high-water marks). `fn` must be importable by name."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Not a daemon: the vector envs it measures start processes of their own.
        self._process = ctx.Process(target=_serve, args=(child,), name="shmvec-bench")
        self._process.start()
        child.close()

    def call(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` in the process; its exception comes back as a
        RuntimeError whose message is the remote traceback."""
        self._conn.send((fn, args))
        try:
            ok, value = self._conn.recv()
        except EOFError:
            self._process.join(1.0)
            raise RuntimeError(f"the benchmark process died (exit code {self._process.exitcode})") from None
        if not ok:
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        self._conn.close()  # it sees end-of-file and returns
        self._process.join()

    def __enter__(self) -> FreshProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def isolated(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` in a fresh process of its own."""
    with FreshProcess() as process:
        return process.call(fn, *args)
