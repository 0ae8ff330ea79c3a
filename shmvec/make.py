"""``shmvec.make``: the counterpart of ``gymnasium.make_vec``."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym

from shmvec.vector_env import ShmVecEnv

__all__ = ["make"]


def _make_env(spec: gym.envs.registration.EnvSpec, env_kwargs: dict[str, Any],
              wrappers: Sequence[Callable] | None) -> gym.Env:
    env = gym.make(spec, **env_kwargs)
    for wrapper in wrappers or ():
        env = wrapper(env)
    return env


def make(
    env_id: str | gym.envs.registration.EnvSpec,
    num_envs: int = 1,
    *,
    vector_kwargs: dict[str, Any] | None = None,
    wrappers: Sequence[Callable[[gym.Env], gym.Wrapper]] | None = None,
    **env_kwargs: Any,
) -> ShmVecEnv:
    """Makes `num_envs` copies of a registered env (its id or its
    ``EnvSpec``, as ``gymnasium.make_vec`` takes) in a ``ShmVecEnv``.

    Keyword arguments go to each env (as with ``gymnasium.make``); shmvec's
    own options (``num_workers``, ``autoreset_mode``, ...) go in
    `vector_kwargs`; `wrappers` are applied to each env in order.

    Example:
        >>> import shmvec
        >>> envs = shmvec.make("CartPole-v1", num_envs=2, vector_kwargs={"num_workers": 1})
        >>> envs.spec.id, envs.num_envs
        ('CartPole-v1', 2)
        >>> envs.close()
    """
    if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
        raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
    if isinstance(env_id, gym.envs.registration.EnvSpec):
        spec = env_id
    else:
        spec = gym.spec(env_id)  # fails early, with gymnasium's message, for unknown ids
    # The spec, not the id: workers that import the program afresh (spawn,
    # forkserver) then need not find the id registered, as in make_vec.
    factory = functools.partial(_make_env, spec, dict(env_kwargs), list(wrappers or ()))
    envs = ShmVecEnv([factory] * num_envs, **(vector_kwargs or {}))
    vec_spec = copy.deepcopy(spec)
    vec_spec.kwargs = {**spec.kwargs, **env_kwargs}
    envs.spec = vec_spec
    return envs
