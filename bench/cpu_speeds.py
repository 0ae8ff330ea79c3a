"""What each CPU gives while all are busy: one plain single-env loop pinned
to each usable CPU, all at once (the bench's limit, pinned), in rounds.

On a VM whose vCPUs share host cores with other guests, their speeds differ
and change from round to round; a lock-step vector env runs each batch at
the pace of its slowest process (docs/performance.md, "Sixteen vCPUs").

    python bench/cpu_speeds.py [ENV_ID] [--rounds R] [--seconds S]
"""

import argparse

from shmvec.bench.measure import concurrent_limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env", nargs="?", default="CartPole-v1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    for done in range(args.rounds):
        limit = concurrent_limit(args.env, args.seconds, pin=True)
        loops = limit["loops"]
        mean = sum(loops) / len(loops)
        print(f"round {done + 1}: sum {limit['steps_per_s'] / 1000:,.0f}k steps/s, slowest/mean {min(loops) / mean:.2f};",
              " ".join(f"{cpu}:{rate / 1000:.0f}k" for cpu, rate in zip(limit["cpus"], loops)), flush=True)


if __name__ == "__main__":
    main()
