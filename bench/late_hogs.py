"""CPU hogs that start while a vector env steps, and stop before it ends:
steps/s in windows of 0.25 s, and where shmvec's workers ran.

Each run is a fresh process: CartPole envs step on a quiet machine for
--quiet seconds, then --hogs processes spin on the CPU (in this session, as
a learner's own other work) for --busy seconds, then the envs step on for
--after seconds with the hogs gone. Each window prints its steps/s, whether
the hogs ran, and for shmvec whether its workers ran on the caller's CPU
(README, "A busy machine": shmvec moves lock-step workers there while no CPU
is idle). The last lines give each backend's mean steps/s while the hogs
ran and after they stopped: median (min-max) over the runs, which alternate
between the backends.

    python bench/late_hogs.py [--backends shmvec,sync] [--num-envs 64] [--hogs 2] [--runs 5]

To compare two builds, run it with each on PYTHONPATH in turn (pip install
--target DIR).

With --migrations (Linux, `perf`, and the right to trace the scheduler:
root, or kernel.perf_event_paranoid at -1), each shmvec run is recorded
with `perf record -e sched:sched_migrate_task`, and a line under it says
when its workers first moved to the caller's CPU, how often the kernel
moved the caller to the other CPU before it moved a hog, and when it moved
a hog (README, "A busy machine": the kernel's settling).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

WINDOW_S = 0.25


def run_once(backend: str, num_envs: int, hogs: int, quiet: float, busy: float, after: float) -> dict:
    """One run in this process: steps/s of each window."""
    import gymnasium as gym
    import numpy as np

    from shmvec import ShmVecEnv
    from shmvec.bench.measure import Hogs

    fns = [lambda: gym.make("CartPole-v1") for _ in range(num_envs)]
    envs = ShmVecEnv(fns) if backend == "shmvec" else gym.vector.SyncVectorEnv(fns)
    placement = getattr(getattr(envs, "_engine", None), "_placement", None)  # (none in builds before 2026-11-28)
    actions = np.random.default_rng(0).integers(0, 2, size=(1024, num_envs))
    windows, k = [], 0
    spinning = Hogs(hogs)
    pids = {"caller": os.getpid(), "workers": [p.pid for p in envs._engine.pool.processes] if placement else []}
    try:
        envs.reset(seed=0)
        start = time.monotonic()
        while (now := time.monotonic() - start) < quiet + busy + after:
            if quiet <= now < quiet + busy and not spinning.processes:
                pids["hogs_at_ns"] = time.monotonic_ns()
                spinning.__enter__()
                pids["hogs"] = [p.pid for p in spinning.processes]
            elif now >= quiet + busy and spinning.processes:
                spinning.stop()
            began, steps = time.monotonic(), 0
            while time.monotonic() - began < WINDOW_S:
                for _ in range(8):
                    envs.step(actions[k % len(actions)])
                    k += 1
                steps += 8 * num_envs
            windows.append({"at": round(began - start, 2), "steps_per_s": steps / (time.monotonic() - began),
                            "hogs": bool(spinning.processes),
                            "on_callers_cpu": bool(placement and placement.following)})
    finally:
        spinning.stop()
        envs.close()
    return {"backend": backend, "windows": windows, "pids": pids}


MIGRATION = re.compile(r" (\d+\.\d+): sched:sched_migrate_task: .*? pid=(\d+) .*?orig_cpu=(\d+) dest_cpu=(\d+)")


def migrations(perf_script: str, pids: dict) -> str:
    """What `perf record` saw of one run's migrations (`perf script`'s
    text), from when the hogs started: when shmvec first moved its workers
    (to the caller's CPU), how many times the kernel then moved the caller
    before it moved a hog off the workers' CPU, and when."""
    start = pids["hogs_at_ns"] / 1e9
    followed = hog_left = workers_cpu = None
    caller_moves = hog_moves = 0
    for line in perf_script.splitlines():
        found = MIGRATION.search(line)
        if not found or float(found[1]) < start:
            continue
        at, pid, source, target = float(found[1]) - start, int(found[2]), int(found[3]), int(found[4])
        if pid in pids["workers"]:
            followed = at if followed is None else followed
            workers_cpu = target
        elif followed is None:
            continue
        elif pid == pids["caller"] and hog_left is None:
            caller_moves += 1
        elif pid in pids["hogs"]:
            hog_moves += 1
            if source == workers_cpu and hog_left is None:
                hog_left = at
    if followed is None:
        return "  shmvec did not move its workers"
    left = f"moved a hog off the workers' CPU at {hog_left:.2f} s" if hog_left is not None else "moved no hog off it"
    return (f"  workers moved to the caller's CPU at {followed:.2f} s; the kernel then moved the caller "
            f"{caller_moves}x and {left} (times from the hogs' start; hogs moved {hog_moves}x in all "
            f"from then on)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="shmvec,sync", help="shmvec (its defaults) and/or sync")
    parser.add_argument("--num-envs", type=int, default=64, help="CartPole envs (default: 64)")
    parser.add_argument("--hogs", type=int, default=2, help="processes spinning on the CPU (default: 2)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each backend, alternating (default: 5)")
    parser.add_argument("--quiet", type=float, default=2.0, help="seconds before the hogs start (default: 2)")
    parser.add_argument("--busy", type=float, default=4.0, help="seconds the hogs run (default: 4)")
    parser.add_argument("--after", type=float, default=2.0, help="seconds after they stop (default: 2)")
    parser.add_argument("--migrations", action="store_true",
                        help="record each shmvec run's migrations with perf (see above)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a backend: one run, in this process
    args = parser.parse_args()
    if args.migrations and shutil.which("perf") is None:
        parser.error("--migrations needs perf (Debian: apt install linux-perf)")
    if args.one:
        print(json.dumps(run_once(args.one, args.num_envs, args.hogs, args.quiet, args.busy, args.after)))
        return
    backends = args.backends.split(",")
    if not backends or set(backends) - {"shmvec", "sync"}:
        parser.error(f"--backends takes shmvec and/or sync, got {args.backends!r}")
    means: dict[str, dict[str, list[float]]] = {b: {"busy": [], "after": []} for b in backends}
    for run in range(args.runs):
        for backend in backends:
            command = [sys.executable, __file__, "--one", backend, *sys.argv[1:]]
            with tempfile.TemporaryDirectory() as tmp:
                perf_data = os.path.join(tmp, "perf.data")
                if args.migrations and backend == "shmvec":  # CLOCK_MONOTONIC: the run's clock
                    command = ["perf", "record", "-q", "-k", "mono", "-e", "sched:sched_migrate_task", "-a",
                               "-o", perf_data, "--", *command]
                ran = subprocess.run(command, capture_output=True, text=True)
                if ran.returncode:
                    sys.exit(f"late_hogs.py: {' '.join(command[:2])} ... failed:\n{ran.stderr.strip()}")
                result = json.loads(ran.stdout)
                windows = result["windows"]
                print(f"run {run + 1} {backend}: " + " ".join(
                    f"{w['steps_per_s'] / 1e3:.0f}k{'*' if w['hogs'] else ''}{'c' if w['on_callers_cpu'] else ''}"
                    for w in windows), flush=True)
                if os.path.exists(perf_data) and "hogs" in result["pids"]:
                    recorded = subprocess.run(["perf", "script", "-i", perf_data], check=True, capture_output=True,
                                              text=True).stdout
                    print(migrations(recorded, result["pids"]), flush=True)
            busy = [w["steps_per_s"] for w in windows if w["hogs"]]
            settled = [w["steps_per_s"] for w in windows if w["at"] >= args.quiet + args.busy + 0.5]
            means[backend]["busy"].append(statistics.mean(busy))
            if settled:
                means[backend]["after"].append(statistics.mean(settled))
    print("(* the hogs ran; c: the workers ran on the caller's CPU)")
    for backend, phases in means.items():
        line = [f"{backend}:"]
        for phase, label in (("busy", "while the hogs ran"), ("after", "after they stopped (from 0.5 s on)")):
            values = phases[phase]
            if values:
                line.append(f"{label} {statistics.median(values) / 1e3:.1f}k "
                            f"({min(values) / 1e3:.1f}k-{max(values) / 1e3:.1f}k)")
        print(" ".join(line[:1]) + " " + "; ".join(line[1:]) + f"; {len(phases['busy'])} runs")


if __name__ == "__main__":
    main()
