"""``shmvec.make``: the counterpart of ``gymnasium.make_vec``."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
from gymnasium.envs import registration

from shmvec.vector_env import ShmVecEnv

__all__ = ["make"]

# make_vec's modes that make the envs one by one: shmvec steps them either way.
_ONE_BY_ONE = ("async", "sync")


def _make_env(spec: gym.envs.registration.EnvSpec, env_kwargs: dict[str, Any],
              wrappers: Sequence[Callable] | None) -> gym.Env:
    env = gym.make(spec, **env_kwargs)
    for wrapper in wrappers or ():
        env = wrapper(env)
    return env


def _mode(vectorization_mode: Any) -> str:
    """The mode as make_vec records it in the vector spec."""
    value = getattr(vectorization_mode, "value", vectorization_mode)  # Gymnasium 1.x's VectorizeMode
    if value is None:
        return "async"  # shmvec stands in for AsyncVectorEnv
    if value in _ONE_BY_ONE:
        return value
    if value in ("vector_entry_point", "custom"):
        raise ValueError(f"vectorization_mode={value!r} makes the env's own vector env, which shmvec does not "
                         "step: use gymnasium.make_vec for it, or 'async' or 'sync' to step each env in shmvec")
    raise ValueError(f"Invalid vectorization mode: {vectorization_mode!r}, valid modes: {list(_ONE_BY_ONE)}")


def make(
    id: str | gym.envs.registration.EnvSpec,  # make_vec's name: keyword calls work alike
    num_envs: int = 1,
    vectorization_mode: Any = None,
    vector_kwargs: dict[str, Any] | None = None,
    wrappers: Sequence[Callable[[gym.Env], gym.Wrapper]] | None = None,
    **env_kwargs: Any,
) -> ShmVecEnv:
    """Makes `num_envs` copies of a registered env in a ``ShmVecEnv``, with
    ``gymnasium.make_vec``'s arguments: an id (``"module:Env-v0"`` and an id
    without its version too) or an ``EnvSpec``, the vector spec of an env
    this made included.

    `vectorization_mode` may be "async", "sync" or None (shmvec steps the
    envs either way; the vector spec records the mode given, "async" for
    None); make_vec's "vector_entry_point" is refused: it makes the env's
    own vector env. Keyword arguments go to each env (as with
    ``gymnasium.make``); shmvec's own options (``num_workers``,
    ``autoreset_mode``, ...) go in `vector_kwargs`; `wrappers` are applied
    to each env in order. As in make_vec, ``num_envs``,
    ``vectorization_mode``, ``vector_kwargs`` and ``wrappers`` in the
    spec's kwargs come before the arguments.

    Example:
        >>> import shmvec
        >>> envs = shmvec.make("CartPole-v1", num_envs=2, vector_kwargs={"num_workers": 1})
        >>> envs.spec.id, envs.num_envs
        ('CartPole-v1', 2)
        >>> envs.close()
    """
    if isinstance(id, registration.EnvSpec):
        spec = id
    elif isinstance(id, str):
        spec = registration._find_spec(id)  # make_vec's lookup: imports "module:", warns of old versions
    else:
        raise gym.error.Error(f"Invalid id type: {type(id)}. Expected `str` or `EnvSpec`")
    # As make_vec: the spec's kwargs go to gym.make as keyword arguments, so
    # that make-level ones (max_episode_steps, ...) reach make, not the env.
    spec = copy.deepcopy(spec)
    env_kwargs = {**spec.kwargs, **env_kwargs}
    spec.kwargs = {}
    num_envs = env_kwargs.pop("num_envs", num_envs)
    mode = _mode(env_kwargs.pop("vectorization_mode", vectorization_mode))
    vector_kwargs = dict(env_kwargs.pop("vector_kwargs", vector_kwargs) or {})
    wrappers = list(env_kwargs.pop("wrappers", wrappers) or ())
    if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
        raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
    if spec.entry_point is None:
        raise gym.error.Error(f"Cannot create vectorized environment for {spec.id} because it doesn't have an "
                              "entry point defined.")
    # The spec, not the id: workers that import the program afresh (spawn,
    # forkserver) then need not find the id registered, as in make_vec.
    factory = functools.partial(_make_env, spec, env_kwargs, wrappers)
    envs = ShmVecEnv([factory] * num_envs, **vector_kwargs)
    vec_spec = copy.deepcopy(spec)
    vec_spec.kwargs = dict(env_kwargs)
    if num_envs != 1:
        vec_spec.kwargs["num_envs"] = num_envs
    vec_spec.kwargs["vectorization_mode"] = mode
    if vector_kwargs:
        vec_spec.kwargs["vector_kwargs"] = vector_kwargs
    if wrappers:
        vec_spec.kwargs["wrappers"] = wrappers
    envs.spec = vec_spec
    return envs
