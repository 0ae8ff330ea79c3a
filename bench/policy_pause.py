"""Where a lock-step batch's time goes when a policy runs between batches:
the policy's time and ``step()``'s time, each batch, in one process.

    python bench/policy_pause.py VARIANT [--num-envs N] [--seconds S]

VARIANT is one of:
- ``none``: no policy (fixed actions), the steady pace of ``step()``;
- ``mlp``: the bench's torch MLP (``--policy mlp``) on ``--device``;
- ``spin-US`` / ``sleep-US``: instead of a policy the caller busy-waits,
  or sleeps, US microseconds (a pause without torch's threads or a GPU);
- ``sync-mlp``: ``SyncVectorEnv`` with the MLP, for comparison.

``--workers`` and ``--no-pin-workers`` set the ``ShmVecEnv``. Between two
batches shmvec's workers wait for the next command, spinning, then asleep
(see csrc/signal.hpp): the step after a pause can cost more than the steady
one. Run each variant in a fresh process, alternating (docs/performance.md,
"Sixteen vCPUs": the policy on a GPU).
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np


def pause_policy(variant: str, num_envs: int):
    """A stand-in policy that returns fixed actions after a busy-wait or a
    sleep of the variant's microseconds (or at once, for ``none``)."""
    actions = np.zeros(num_envs, dtype=np.int64)
    if variant == "none":
        return lambda obs: actions
    kind, _, micros = variant.partition("-")
    if kind not in ("spin", "sleep") or not micros.isdigit():
        raise SystemExit(f"unknown variant {variant!r}: none, mlp, sync-mlp, spin-US or sleep-US")
    pause_ns = int(micros) * 1000

    def spin(obs):
        until = time.perf_counter_ns() + pause_ns
        while time.perf_counter_ns() < until:
            pass
        return actions

    def sleep(obs):
        time.sleep(pause_ns / 1e9)
        return actions

    return spin if kind == "spin" else sleep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variant")
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--num-envs", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--device", default="cpu", help="the torch device of the mlp variants (default cpu)")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--no-pin-workers", dest="pin_workers", action="store_false")
    args = parser.parse_args()

    import shmvec
    from shmvec.bench.measure import mlp_policy

    fns = [lambda: gym.make(args.env)] * args.num_envs
    if args.variant == "sync-mlp":
        envs = gym.vector.SyncVectorEnv(fns)
    else:
        envs = shmvec.ShmVecEnv(fns, num_workers=args.workers, pin_workers="auto" if args.pin_workers else False)
    try:
        obs, _ = envs.reset(seed=0)
        if args.variant in ("mlp", "sync-mlp"):
            pick = mlp_policy(envs.single_observation_space, envs.single_action_space, device=args.device)
        else:
            pick = pause_policy(args.variant, args.num_envs)
        policy_ns, step_ns = [], []
        warm_until = time.perf_counter() + 1.0  # a second of warm-up, not counted
        end = warm_until + args.seconds
        while (now := time.perf_counter()) < end:
            t0 = time.perf_counter_ns()
            actions = pick(obs)
            t1 = time.perf_counter_ns()
            obs, *_ = envs.step(actions)
            t2 = time.perf_counter_ns()
            if now >= warm_until:
                policy_ns.append(t1 - t0)
                step_ns.append(t2 - t1)
        workers = getattr(envs, "num_workers", "-")
    finally:
        envs.close()
    policy_us, step_us = np.array(policy_ns) / 1e3, np.array(step_ns) / 1e3
    rate = len(step_us) * args.num_envs / ((policy_us.sum() + step_us.sum()) / 1e6)
    print(f"{args.variant:<12} x{args.num_envs} workers={workers}: {rate / 1e3:7.1f}k steps/s; "
          f"policy us median {np.median(policy_us):5.0f} p90 {np.percentile(policy_us, 90):5.0f}; "
          f"step us median {np.median(step_us):5.0f} p90 {np.percentile(step_us, 90):5.0f} "
          f"p99 {np.percentile(step_us, 99):5.0f}", flush=True)


if __name__ == "__main__":
    main()
