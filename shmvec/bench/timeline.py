"""Where a lock-step batch's time goes, window by window:

    python -m shmvec.bench.timeline HalfCheetah-v5 --num-envs 16

Steps a ``ShmVecEnv`` (its defaults, or ``--workers N``; ``--atari`` as in
``shmvec bench``) with seeded random actions and splits each ``step()``
into the caller's own slice of envs, the wait for the workers after it, and
the rest (the front end: actions in, results out, the loop). It prints
microseconds per batch averaged over windows of ``--window`` batches, so
that a stretch where one CPU runs slower than another shows: the caller's
slice grows when its CPU slows down, the wait when a worker's does. A
diagnostic that wraps two of shmvec's internals (``EnvSlice.step`` and
``WorkerPool.wait``), not a benchmark: ``shmvec bench --backends
shmvec,uncoupled`` measures what lock-step costs.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager

import numpy as np

from shmvec._engine.env_slice import EnvSlice
from shmvec._engine.pool import WorkerPool
from shmvec.bench.command import _count, _workers
from shmvec.bench.measure import action_batches, single_env_rate
from shmvec.bench.passes import _layout
from shmvec.bench.peers import build

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
             warmup: int = 200) -> tuple[np.ndarray, str, int]:
    """(batches, 3) microseconds of each batch (total, caller slice, wait),
    what the vector env was made of, and the most envs any process steps."""
    envs = build("shmvec", spec, num_envs, atari=atari, num_workers=num_workers)
    last = dict.fromkeys(PARTS, 0)
    times = np.zeros((warmup + batches, 3))
    try:
        engine = envs._engine
        caller = len(engine._caller.rows) if engine._caller is not None else 0
        shares = ", ".join(str(len(rows)) for rows in engine.worker_rows)
        pinned = "pinned" if _layout(envs)["pinned"] else "unpinned"
        workers = (f"{envs.num_workers} {pinned} worker{'s' * (envs.num_workers > 1)} {shares}"
                   if envs.num_workers else "no workers")
        largest = max(len(rows) for rows in engine._slice_rows())
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
    return times[warmup:] / 1000, layout, largest


def report(times: np.ndarray, window: int, plain_us: float | None = None, largest: int = 0) -> str:
    """The table; with `plain_us` (a plain single-env loop's step), what a
    batch would take at that pace, `largest` envs per process."""
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
    args = parser.parse_args(argv)
    plain_us = 1e6 / single_env_rate(args.env, args.plain_seconds, args.atari) if args.plain_seconds > 0 else None
    times, layout, largest = timeline(args.env, args.num_envs, args.batches, args.workers, args.atari)
    print(f"{args.env} x{args.num_envs}: {layout}; microseconds per batch, windows of {args.window} batches")
    print(report(times, args.window, plain_us, largest))


if __name__ == "__main__":
    main()
