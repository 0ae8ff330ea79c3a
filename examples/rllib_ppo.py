"""PPO on CartPole with RLlib (new API stack), its env runners stepping their
envs in a shmvec.ShmVecEnv. Two lines make it so: ``register_rllib_env``
registers the env, and ``gym_env_vectorize_mode="vector_entry_point"`` makes
each env runner build its vector env through shmvec (one worker process per
CPU the runner gets, less one: the runner steps a slice itself).

    pip install "torch==2.13.0" ".[ray]" "ray[rllib]"
    python examples/rllib_ppo.py --iterations 30 --target 450

It prints each iteration's mean episode return and, at the end, one line
``RESULT {...}`` (JSON) with the last mean return and the vector env class
the env runners used.
"""

from __future__ import annotations

import argparse
import json

import ray
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

from shmvec.ray import register_rllib_env


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--iterations", type=int, default=30, help="at most this many training iterations")
    p.add_argument("--target", type=float, default=450.0, help="stop once the mean episode return reaches it")
    p.add_argument("--env-runners", type=int, default=1)
    p.add_argument("--envs-per-runner", type=int, default=8)
    p.add_argument("--cpus-per-runner", type=int, default=2, help="the runner's ShmVecEnv gets one worker less")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: all)")
    p.add_argument("--address", default=None, help="join a running Ray cluster instead (e.g. 'auto')")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    ray.init(address=args.address, num_cpus=args.num_cpus, include_dashboard=False)
    register_rllib_env("shmvec-cartpole", args.env_id)
    config = (
        PPOConfig()
        .environment("shmvec-cartpole")
        .env_runners(
            num_env_runners=args.env_runners,
            num_envs_per_env_runner=args.envs_per_runner,
            num_cpus_per_env_runner=args.cpus_per_runner,
            gym_env_vectorize_mode="vector_entry_point",  # the env's vector entry point: a ShmVecEnv
        )
        # RLlib's tuned CartPole settings.
        .training(lr=3e-4, num_epochs=6, vf_loss_coeff=0.01)
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[32], fcnet_activation="linear",
                                                   vf_share_layers=True))
        .debugging(seed=args.seed)
    )
    algo = config.build_algo()
    vector_envs = algo.env_runner_group.foreach_env_runner(
        lambda runner: type(runner.env.unwrapped).__name__, local_env_runner=False)
    mean_return, iteration = float("nan"), 0
    for iteration in range(1, args.iterations + 1):
        results = algo.train()["env_runners"]
        mean_return = float(results["episode_return_mean"])
        print(f"iteration {iteration}: mean return {mean_return:.1f} "
              f"({results['num_env_steps_sampled_lifetime']} env steps)", flush=True)
        if mean_return >= args.target:
            break
    algo.stop()
    ray.shutdown()
    print("RESULT " + json.dumps({"iterations": iteration, "mean_return": mean_return,
                                  "vector_envs": sorted(set(vector_envs))}))


if __name__ == "__main__":
    main()
