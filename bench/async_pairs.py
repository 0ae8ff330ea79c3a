"""Where async mode's time goes, pair by pair: each ``recv()`` split into
the wait for envs to finish (the native call that pops them from the
workers' rings) and the rest of the front end, and each ``send()``.

    python bench/async_pairs.py [ENV_ID] [--num-envs N] [--batch-size B] [--seconds S] [--workers W]

If the caller spends most of a pair waiting, the workers (or the rings)
set the pace; if it spends most of it in the front end, the caller does.
A diagnostic that wraps one of shmvec's internals (``AsyncSteps.recv``;
without workers ``CallerSteps.recv``, which steps the envs in the caller),
not a benchmark: ``shmvec bench --async-batch B`` measures async mode.
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np

from shmvec.bench.measure import action_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env", nargs="?", default="CartPole-v1")
    parser.add_argument("--num-envs", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=None, help="num_workers (default: shmvec's choice)")
    args = parser.parse_args()

    import shmvec

    envs = shmvec.ShmVecEnv([lambda: gym.make(args.env)] * args.num_envs, batch_size=args.batch_size,
                            num_workers=args.workers)
    try:
        # Timed on the instance: AsyncSteps.recv waits for the workers' envs;
        # without workers, CallerSteps.recv steps them in the caller.
        steps = envs._engine.async_steps
        original, waited = steps.recv, [0]

        def timed_recv(*a, **kw):
            start = time.perf_counter_ns()
            try:
                return original(*a, **kw)
            finally:
                waited[0] += time.perf_counter_ns() - start

        steps.recv = timed_recv
        envs.async_reset(seed=0)
        batches = action_batches(envs.single_action_space, args.batch_size)
        recv_ns, wait_ns, send_ns = [], [], []
        warm_until = time.perf_counter() + 1.0
        end = warm_until + args.seconds
        i = 0
        while (now := time.perf_counter()) < end:
            waited[0] = 0
            t0 = time.perf_counter_ns()
            *_, infos = envs.recv()
            t1 = time.perf_counter_ns()
            envs.send(batches[i % len(batches)], infos["env_id"])
            t2 = time.perf_counter_ns()
            i += 1
            if now >= warm_until:
                recv_ns.append(t1 - t0)
                wait_ns.append(waited[0])
                send_ns.append(t2 - t1)
        workers = envs.num_workers
    finally:
        envs.close()
    recv_us, wait_us, send_us = (np.array(x) / 1e3 for x in (recv_ns, wait_ns, send_ns))
    pair_us = recv_us + send_us
    waiting = "waiting in AsyncSteps.recv" if workers else "stepping the envs in CallerSteps.recv"
    print(f"{args.env} x{args.num_envs}, batch_size {args.batch_size}, {workers} workers: "
          f"{args.batch_size / pair_us.mean():.3f}M steps/s; a pair {pair_us.mean():.1f} us on average: "
          f"recv {recv_us.mean():.1f} ({waiting} {wait_us.mean():.1f}, the rest "
          f"{(recv_us - wait_us).mean():.1f}), send {send_us.mean():.1f}"
          + (f"; pairs that waited over 5 us: {np.mean(wait_us > 5):.2f}" if workers else ""), flush=True)


if __name__ == "__main__":
    main()
