"""Where a lock-step batch's time goes, window by window:

    python -m shmvec.bench.timeline HalfCheetah-v5 --num-envs 16

Steps a ``ShmVecEnv`` (its defaults, or ``--workers N``; ``--atari`` as in
``shmvec bench``) with seeded random actions and splits each ``step()``
into the caller's own slice of envs, the wait for the workers after it, and
the rest (the front end: actions in, results out, the loop). It prints
microseconds per batch averaged over windows of ``--window`` batches, so
that a stretch where one CPU runs slower than another shows: the caller's
slice grows when its CPU slows down, the wait when a worker's does.

Before that it times a plain single-env loop (the pace a batch could keep
on every CPU); after it, the vector env's shares of envs (one per process)
stepped one after another in plain loops in this process. How much longer
the slowest share of a batch takes than the mean share, on one CPU, is what
lock-step over fixed shares costs from the envs' own step times alone. With
``--by-env``, it then times each of the caller's own envs step by step,
in the vector env and in a plain loop over the same envs: whatever runs
between two of the caller's slices (the wait, the front end, the user's
code) leaves the envs' code and data less warm in the CPU's caches, and
the first env stepped after it pays the most. A
diagnostic that wraps two of shmvec's internals (``EnvSlice.step`` and
``WorkerPool.wait``), not a benchmark: ``shmvec bench --backends
shmvec,uncoupled`` measures what lock-step costs.
"""

from __future__ import annotations

import argparse
import functools
import time
from contextlib import contextmanager

import gymnasium as gym
import numpy as np

from shmvec._engine.env_slice import EnvSlice
from shmvec._engine.pool import WorkerPool
from shmvec.bench.command import _count, _workers
from shmvec.bench.measure import action_batches, plain_envs, plain_step, single_env_rate
from shmvec.bench.passes import _layout
from shmvec.bench.peers import build, env_factory

PARTS = ("slice", "wait")


@contextmanager
def timed_parts(last: dict[str, int]):
    """While open, `last[part]` holds the nanoseconds of the latest caller
    slice and wait for the workers."""
    originals = {"slice": EnvSlice.step, "wait": WorkerPool.wait}

    def timing(part):
        original = originals[part]

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                last[part] = time.perf_counter_ns() - start
        return timed

    EnvSlice.step, WorkerPool.wait = timing("slice"), timing("wait")
    try:
        yield
    finally:
        EnvSlice.step, WorkerPool.wait = originals["slice"], originals["wait"]


def timeline(spec: str, num_envs: int, batches: int, num_workers: int | None = None, atari: bool = False,
             warmup: int = 200) -> tuple[np.ndarray, str, list[int]]:
    """(batches, 3) microseconds of each batch (total, caller slice, wait),
    what the vector env was made of, and how many envs each process steps
    (the caller's share first)."""
    envs = build("shmvec", spec, num_envs, atari=atari, num_workers=num_workers)
    last = dict.fromkeys(PARTS, 0)
    times = np.zeros((warmup + batches, 3))
    try:
        engine = envs._engine
        caller = len(engine._caller.rows) if engine._caller is not None else 0
        worker_shares = ", ".join(str(len(rows)) for rows in engine.worker_rows)
        pinned = "pinned" if _layout(envs)["pinned"] else "unpinned"
        workers = (f"{envs.num_workers} {pinned} worker{'s' * (envs.num_workers > 1)} {worker_shares}"
                   if envs.num_workers else "no workers")
        shares = [len(rows) for rows in engine._slice_rows()]
        layout = f"the caller steps {caller} env{'s' * (caller != 1)}, {workers}"
        envs.reset(seed=0)
        actions = action_batches(envs.single_action_space, num_envs)
        with timed_parts(last):
            for i in range(len(times)):
                last.update(dict.fromkeys(PARTS, 0))
                start = time.perf_counter_ns()
                envs.step(actions[i % len(actions)])
                times[i] = time.perf_counter_ns() - start, last["slice"], last["wait"]
    finally:
        envs.close()
    return times[warmup:] / 1000, layout, shares


def share_spread(spec: str, shares: list[int], batches: int, atari: bool = False, warmup: int = 50) -> float:
    """Steps `shares` (envs per process) one after another in plain loops in
    this process, `batches` times; returns the slowest share's time over
    the mean share's, each averaged over the batches. On one CPU, at one
    moment, this is the lock-step cost of the envs' step times alone."""
    envs, steps = plain_envs(spec, atari, sum(shares))
    try:
        actions = action_batches(envs[0].action_space, len(envs))
        bounds = np.cumsum([0] + shares)
        times = np.zeros((warmup + batches, len(shares)))
        for b, batch in enumerate(times):
            action = actions[b % len(actions)]
            for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
                start = time.perf_counter_ns()
                for row in range(lo, hi):
                    steps[row](action[row])
                batch[k] = time.perf_counter_ns() - start
    finally:
        for env in envs:
            env.close()
    times = times[warmup:]
    return float(times.max(axis=1).mean() / times.mean())


class StepClock(gym.Wrapper):
    """Keeps the nanoseconds of each step() of the env it wraps in `times`."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.times: list[int] = []

    def step(self, action):
        start = time.perf_counter_ns()
        result = self.env.step(action)
        self.times.append(time.perf_counter_ns() - start)
        return result


def _clocked(factory) -> StepClock:
    return StepClock(factory())


def steps_by_env(spec: str, num_envs: int, batches: int, num_workers: int | None = None, atari: bool = False,
                 warmup: int = 200) -> tuple[np.ndarray, np.ndarray] | None:
    """Median microseconds of each step of the caller's own envs, in the
    order the caller steps them: in a ``ShmVecEnv`` (as `timeline` makes
    it), then in a plain loop over as many envs with the same seeds, one
    after another with nothing in between. None if the caller steps no env."""
    from shmvec import ShmVecEnv

    clocked = functools.partial(_clocked, env_factory(spec, atari))
    envs = ShmVecEnv([clocked] * num_envs, num_workers=num_workers)
    try:
        caller = envs._engine._caller
        if caller is None:
            return None
        envs.reset(seed=0)
        actions = action_batches(envs.single_action_space, num_envs)
        for i in range(warmup + batches):
            envs.step(actions[i % len(actions)])
        in_vector = np.array([np.median(env.times[warmup:]) for env in caller.envs]) / 1000
    finally:
        envs.close()
    plain = [StepClock(env) for env in plain_envs(spec, atari, len(in_vector))[0]]
    try:
        steps = [plain_step(env) for env in plain]
        actions = action_batches(plain[0].action_space, len(plain))
        for i in range(warmup + batches):
            for step, action in zip(steps, actions[i % len(actions)]):
                step(action)
        in_loop = np.array([np.median(env.times[warmup:]) for env in plain]) / 1000
    finally:
        for env in plain:
            env.close()
    return in_vector, in_loop


def report_by_env(in_vector: np.ndarray, in_loop: np.ndarray) -> str:
    """The table of steps_by_env, one column per env, and what the first
    env and the rest cost over the plain loop."""
    lines = ["The caller's envs one by one (--by-env), median us a step, in the order it steps them:",
             f"{'in the vector env':<20}" + "".join(f"{t:>7.1f}" for t in in_vector),
             f"{'in a plain loop':<20}" + "".join(f"{t:>7.1f}" for t in in_loop)]
    extra = in_vector - in_loop
    rest = f", each of the others {extra[1:].mean():+.1f} us on average" if len(extra) > 1 else ""
    lines.append(f"Over the plain loop: the first env {extra[0]:+.1f} us{rest}; "
                 f"the slice {extra.sum():+.1f} us, {in_vector.sum() / in_loop.sum():.3f} times as long.")
    return "\n".join(lines)


def report(times: np.ndarray, window: int, plain_us: float | None = None, largest: int = 0,
           spread: float | None = None) -> str:
    """The table; with `plain_us` (a plain single-env loop's step), what a
    batch would take at that pace, `largest` envs per process; with `spread`
    (see share_spread), what lock-step over the shares costs by itself."""
    lines = [f"{'batches':>13}{'total us':>10}{'slice':>8}{'wait':>8}{'rest':>8}"]
    for start in range(0, len(times), window):
        total, caller, wait = times[start:start + window].mean(axis=0)
        end = min(start + window, len(times)) - 1
        lines.append(f"{start:>6}-{end:<6}{total:>10.0f}{caller:>8.0f}{wait:>8.0f}"
                     f"{total - caller - wait:>8.0f}")
    total, caller, wait = times.mean(axis=0)
    lines.append(f"{'all':<13}{total:>10.0f}{caller:>8.0f}{wait:>8.0f}{total - caller - wait:>8.0f}")
    lines.append("slice: the caller's own envs; wait: for the workers after it; rest: the front end.")
    if plain_us is not None:
        pace = largest * plain_us
        lines.append(f"A plain single-env loop here steps in {plain_us:.1f} us: a batch at that pace on every CPU "
                     f"({largest} envs per process) takes {pace:.0f} us, {pace / total:.2f} of this run's.")
    if spread is not None:
        lines.append(f"The same shares stepped one after another in plain loops in one process: the slowest share "
                     f"of a batch took {spread:.3f} times the mean share (the envs' own step times vary), so "
                     f"lock-step at the plain pace would reach {1 / spread:.2f} of it.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shmvec.bench.timeline",
                                     description=__doc__.split("\n\n")[0].rstrip(":") + ".")
    parser.add_argument("env", nargs="?", default="CartPole-v1", help="a Gymnasium env id (default CartPole-v1)")
    parser.add_argument("--num-envs", type=_count, default=16, help="default 16")
    parser.add_argument("--atari", action="store_true", help="each env in Gymnasium's Atari pipeline, as in "
                        "shmvec bench")
    parser.add_argument("--workers", type=_workers, default=None, help="num_workers (default: shmvec's choice)")
    parser.add_argument("--batches", type=_count, default=6000, help="batches timed, after 200 of warm-up "
                        "(default 6000)")
    parser.add_argument("--window", type=_count, default=500, help="batches per line (default 500)")
    parser.add_argument("--plain-seconds", type=float, default=2.0,
                        help="time a plain single-env loop for this long first, for the pace of a batch without "
                             "a vector env (default 2; 0: not)")
    parser.add_argument("--spread-batches", type=_workers, default=1000,
                        help="then step the processes' shares one after another in plain loops in this process "
                             "this many times, to see how unevenly long they take (default 1000; 0: not)")
    parser.add_argument("--by-env", action="store_true",
                        help="then time the caller's own envs step by step (each wrapped in a timer), in the "
                             "vector env and in a plain loop, --batches times each")
    args = parser.parse_args(argv)
    try:
        env_factory(args.env, args.atari)  # a clear error for an id it cannot make, not a traceback
    except ValueError as exc:
        parser.error(str(exc))
    plain_us = 1e6 / single_env_rate(args.env, args.plain_seconds, args.atari) if args.plain_seconds > 0 else None
    times, layout, shares = timeline(args.env, args.num_envs, args.batches, args.workers, args.atari)
    spread = (share_spread(args.env, shares, args.spread_batches, args.atari)
              if args.spread_batches > 0 and len(shares) > 1 else None)
    print(f"{args.env} x{args.num_envs}: {layout}; microseconds per batch, windows of {args.window} batches")
    print(report(times, args.window, plain_us, max(shares), spread))
    if args.by_env:
        by_env = steps_by_env(args.env, args.num_envs, args.batches, args.workers, args.atari)
        print(report_by_env(*by_env) if by_env else "--by-env: the caller steps no envs here.")


if __name__ == "__main__":
    main()
