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
"""

import argparse
import json
import statistics
import subprocess
import sys
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
    try:
        envs.reset(seed=0)
        start = time.monotonic()
        while (now := time.monotonic() - start) < quiet + busy + after:
            if quiet <= now < quiet + busy and not spinning.processes:
                spinning.__enter__()
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
    return {"backend": backend, "windows": windows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="shmvec,sync", help="shmvec (its defaults) and/or sync")
    parser.add_argument("--num-envs", type=int, default=64, help="CartPole envs (default: 64)")
    parser.add_argument("--hogs", type=int, default=2, help="processes spinning on the CPU (default: 2)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each backend, alternating (default: 5)")
    parser.add_argument("--quiet", type=float, default=2.0, help="seconds before the hogs start (default: 2)")
    parser.add_argument("--busy", type=float, default=4.0, help="seconds the hogs run (default: 4)")
    parser.add_argument("--after", type=float, default=2.0, help="seconds after they stop (default: 2)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a backend: one run, in this process
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_once(args.one, args.num_envs, args.hogs, args.quiet, args.busy, args.after)))
        return
    backends = args.backends.split(",")
    means: dict[str, dict[str, list[float]]] = {b: {"busy": [], "after": []} for b in backends}
    for run in range(args.runs):
        for backend in backends:
            out = subprocess.run([sys.executable, __file__, "--one", backend, *sys.argv[1:]], check=True,
                                 capture_output=True, text=True).stdout
            windows = json.loads(out)["windows"]
            print(f"run {run + 1} {backend}: " + " ".join(
                f"{w['steps_per_s'] / 1e3:.0f}k{'*' if w['hogs'] else ''}{'c' if w['on_callers_cpu'] else ''}"
                for w in windows), flush=True)
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
