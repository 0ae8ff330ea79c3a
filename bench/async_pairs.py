"""Where async mode's time goes, pair by pair: the wait for a batch of envs
to finish, then ``recv()`` split into the engine's part (taking them from
the rings, after stepping the caller's own envs if it has a slice) and the
rest of the front end, then the policy (with ``--policy mlp``), then ``send()``.

    python bench/async_pairs.py [ENV_ID] [--num-envs N] [--batch-size B] [--seconds S] [--workers W]
                                [--caller-steps auto|yes|no] [--policy mlp]

If the caller spends most of a pair waiting, the workers set the pace; if
it hardly waits, the caller does. A diagnostic that calls and wraps some of
shmvec's internals (``AsyncSteps.wait_finished`` before each ``recv()``,
which does not wait for what the caller's own slice will step, and
``AsyncSteps.recv`` and ``take_batch``, which step the caller's own envs
first), not a benchmark: ``shmvec bench
--async-batch B`` measures async mode. Run it as a script (it starts
workers): ``python bench/async_pairs.py``.
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np

from shmvec.bench.measure import action_batches, mlp_policy

CALLER_STEPS = {"auto": None, "yes": True, "no": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env", nargs="?", default="CartPole-v1")
    parser.add_argument("--num-envs", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=None, help="num_workers (default: shmvec's choice)")
    parser.add_argument("--caller-steps", choices=CALLER_STEPS, default="auto",
                        help="caller_steps: auto (shmvec's choice), yes or no")
    parser.add_argument("--policy", choices=["mlp"], default=None,
                        help="the bench's torch MLP picks the actions, on the CPU at torch's default threads")
    args = parser.parse_args()
    if not 0 < args.batch_size < args.num_envs:
        parser.error(f"--batch-size must be under --num-envs ({args.num_envs}) for async mode, got {args.batch_size}")

    import shmvec

    envs = shmvec.ShmVecEnv([lambda: gym.make(args.env)] * args.num_envs, batch_size=args.batch_size,
                            num_workers=args.workers, caller_steps=CALLER_STEPS[args.caller_steps])
    try:
        steps, workers = envs._engine.async_steps, envs.num_workers
        own = envs._engine._caller is not None
        taking = [0]

        def timed(original):  # set on the instance
            def call(*a, **kw):
                start = time.perf_counter_ns()
                try:
                    return original(*a, **kw)
                finally:
                    taking[0] += time.perf_counter_ns() - start
            return call

        steps.recv, steps.take_batch = timed(steps.recv), timed(steps.take_batch)
        policy = (mlp_policy(envs.single_observation_space, envs.single_action_space)
                  if args.policy else None)
        envs.async_reset(seed=0)
        batches = action_batches(envs.single_action_space, args.batch_size)
        parts = []  # (wait, recv, the engine's part, policy, send) per pair, ns
        warm_until = time.perf_counter() + 1.0
        end = warm_until + args.seconds
        i = 0
        while (now := time.perf_counter()) < end:
            taking[0] = 0
            t0 = time.perf_counter_ns()
            # What recv() will take from the rings: reset results and envs an
            # earlier recv() popped are at hand.
            at_hand = min(len(envs._reset_ready), args.batch_size) + len(envs._finished)
            if at_hand < args.batch_size:
                steps.wait_finished(args.batch_size - at_hand, 10.0)
            t1 = time.perf_counter_ns()
            obs, *_, infos = envs.recv()
            t2 = time.perf_counter_ns()
            actions = batches[i % len(batches)] if policy is None else policy(obs)
            t3 = time.perf_counter_ns()
            envs.send(actions, infos["env_id"])
            t4 = time.perf_counter_ns()
            i += 1
            if now >= warm_until:
                parts.append((t1 - t0, t2 - t1, taking[0], t3 - t2, t4 - t3))
    finally:
        envs.close()
    wait, recv, take, think, send = (np.array(parts) / 1e3).mean(axis=0)
    pair = wait + recv + think + send
    taken = ("stepping the caller's own envs and taking them all from the rings" if own
             else "taking them from the rings")
    print(f"{args.env} x{args.num_envs}, batch_size {args.batch_size}, {workers} workers"
          f"{', the caller a slice' if own else ''}: {args.batch_size / pair:.3f}M steps/s; "
          f"a pair {pair:.1f} us on average: waiting {wait:.1f}, recv {recv:.1f} ({taken} {take:.1f}, "
          f"the rest {recv - take:.1f}), policy {think:.1f}, send {send:.1f}", flush=True)


if __name__ == "__main__":
    main()
