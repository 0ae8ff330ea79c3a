"""How often a worker sleeps instead of spinning: lock-step runs of cheap envs,
each in a fresh process, with the worker's sleeps per second beside the
steps/s.

A worker whose spin thinks it lost its core sleeps through its waits for a
back-off window (csrc/signal.hpp): every step then pays a futex wake-up. A
run stuck in that mode shows tens of thousands of sleeps a second and half
the steps/s or less (README, "Spinning backs off on a busy machine").
Sleeps are the worker's voluntary context switches; involuntary ones (its
core taken) are printed after the slash.

With --from-start there is no warm-up: the run is cut in slices of 0.1 s
from the end of reset(), each printed as steps/s / worker sleeps per second,
which shows how a fresh worker's first moments go (a worker that shares its
CPU with threads of its own as it starts backs off: README, "A worker's
first 0.1 s").

    python bench/worker_sleeps.py [--runs R] [--envs N] [--seconds S] [--no-pin] [--from-start]
"""

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from shmvec.bench.measure import proc_field


def _switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of process `pid`."""
    status = f"/proc/{pid}/status"
    return proc_field(status, "voluntary_ctxt_switches"), proc_field(status, "nonvoluntary_ctxt_switches")


SLICE_S = 0.1  # of a --from-start run


def _timed(envs, actions, worker: int, seconds: float) -> tuple[float, float, float]:
    """Steps/s, worker sleeps/s and cores lost/s of lock-step stepping for `seconds`."""
    before, steps, start = _switches(worker), 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(50):
            envs.step(actions)
        steps += 50 * len(actions)
    elapsed = time.perf_counter() - start
    after = _switches(worker)
    return steps / elapsed, (after[0] - before[0]) / elapsed, (after[1] - before[1]) / elapsed


def one_run(num_envs: int, seconds: float, pin: bool, from_reset: bool) -> str:
    import shmvec
    from shmvec.testing import NoopEnv

    envs = shmvec.ShmVecEnv([NoopEnv] * num_envs, num_workers=1, pin_workers="auto" if pin else False)
    try:
        envs.reset(seed=0)
        actions = np.zeros(num_envs, dtype=np.int64)
        worker = envs._engine.pool.processes[0].pid
        if from_reset:
            slices = [_timed(envs, actions, worker, SLICE_S) for _ in range(max(1, round(seconds / SLICE_S)))]
            return " ".join(f"{rate / 1000:,.0f}k/{sleeps / 1000:,.1f}k" for rate, sleeps, _ in slices)
        for _ in range(2000):  # warm-up
            envs.step(actions)
        rate, sleeps, lost = _timed(envs, actions, worker, seconds)
    finally:
        envs.close()
    return f"{rate / 1000:,.0f}k steps/s, worker sleeps {sleeps:,.0f}/s / cores lost {lost:,.0f}/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--envs", type=int, default=8, help="NoopEnvs, half of them the worker's (default 8)")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="pin_workers=False (default \"auto\")")
    parser.add_argument("--from-start", dest="from_reset", action="store_true",
                        help=f"no warm-up: each {SLICE_S} s from reset() as steps/s / sleeps/s")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a run, in its fresh process
    args = parser.parse_args()
    if args.one:
        print(one_run(args.envs, args.seconds, args.pin, args.from_reset), flush=True)
        return
    for run in range(args.runs):
        command = [sys.executable, os.path.abspath(__file__), "--one", "--envs", str(args.envs),
                   "--seconds", str(args.seconds)]
        command += ([] if args.pin else ["--no-pin"]) + (["--from-start"] if args.from_reset else [])
        line = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
        print(f"run {run + 1}: {line}", flush=True)


if __name__ == "__main__":
    main()
