"""RLlib: ``register_rllib_env`` makes RLlib's env runners build their
vector envs as ``shmvec.ShmVecEnv``, sized from the CPUs Ray grants them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from shmvec.ray.actor import shmvec_env_for_grant

__all__ = ["register_rllib_env"]


def _rllib_env(env: str | Callable[[dict], gym.Env], config: dict) -> gym.Env:
    return gym.make(env, **config) if isinstance(env, str) else env(config)


def _rllib_creator(env: str | Callable[[dict], gym.Env], shmvec_kwargs: dict[str, Any], env_context: dict):
    """RLlib's env creator: one env, or a ShmVecEnv when RLlib asks for a vector env."""
    if "num_envs" not in env_context:
        # One env: the creator gets RLlib's EnvContext as it is (worker_index
        # and the rest), as with RLlib's own register_env.
        return _rllib_env(env, env_context)
    # RLlib's vector entry point passes a plain dict: the user's env_config and num_envs.
    config = dict(env_context)
    num_envs = config.pop("num_envs")
    return shmvec_env_for_grant([functools.partial(_rllib_env, env, config)] * num_envs, None, shmvec_kwargs)


def register_rllib_env(name: str, env: str | Callable[[dict], gym.Env], **shmvec_kwargs: Any) -> None:
    """Registers `name` with Ray Tune's registry so that RLlib's env runners
    (new API stack) step their envs in a ``shmvec.ShmVecEnv``.

    `env` is a Gymnasium env id or a callable that makes one env from RLlib's
    ``env_config`` (RLlib's ``EnvContext`` when RLlib asks for one env; under
    the vector entry point RLlib passes a plain dict, and each env gets it);
    `shmvec_kwargs` go to each ``ShmVecEnv`` (``num_workers`` defaults to the
    env runner's CPUs, ``num_cpus_per_env_runner``, less one).

    Example (``examples/rllib_ppo.py`` trains PPO this way)::

        from ray.rllib.algorithms.ppo import PPOConfig
        from shmvec.ray import register_rllib_env

        register_rllib_env("shmvec-cartpole", "CartPole-v1")
        config = (PPOConfig().environment("shmvec-cartpole")
                  .env_runners(num_envs_per_env_runner=8, num_cpus_per_env_runner=2,
                               gym_env_vectorize_mode="vector_entry_point"))
    """
    from ray.tune.registry import register_env

    register_env(name, functools.partial(_rllib_creator, env, dict(shmvec_kwargs)))
