"""What the SB3 front end (``shmvec.sb3``) runs next to each env, in the
process that steps it. Free of SB3 imports, so that workers do not pay for
importing SB3 and torch just to step envs.

SB3's ``VecEnv`` calls need code run on the env object itself (``setattr`` on
the outermost wrapper, ``is_wrapped``, attribute reads that must not call
what they read). The factory gives every env a hook for that:
``engine.call(HOOK, (fn, *args))`` runs ``fn(env, *args)`` where the env is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium

__all__ = ["HOOK", "EnvFactory", "call_method", "get_attr", "has_attr", "is_wrapped"]

HOOK = "_shmvec_sb3_hook"
OWNER = "_shmvec_sb3_owner"  # on env.unwrapped: which vector env holds it


class Hook:
    """Runs functions on one env; stored on the env as attribute ``HOOK``."""

    def __init__(self, env: gymnasium.Env, owner: str):
        self.env = env
        self.owner = owner  # which vector env built this env

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.env, *args)


class EnvFactory:
    """Makes one env as ``DummyVecEnv`` does (old gym envs patched through
    shimmy, one instance per env) and attaches the hook."""

    def __init__(self, env_fn: Callable[[], Any], owner: str):
        self.env_fn = env_fn
        self.owner = owner

    def __call__(self) -> gymnasium.Env:
        env = self.env_fn()
        if not isinstance(env, gymnasium.Env):
            from stable_baselines3.common.vec_env.patch_gym import _patch_env

            env = _patch_env(env)
        # The env itself, not its outermost wrapper: make_vec_env(lambda: env)
        # puts a new Monitor around one env at each call, as DummyVecEnv's
        # check (of env.unwrapped) knows. Envs of one process would share it.
        if getattr(env.unwrapped, OWNER, None) == self.owner:
            raise ValueError(
                "the env factories returned the same env instance twice; each call must create "
                "a new env (e.g. `lambda: gym.make(env_id)`, not `lambda: env`), as DummyVecEnv requires"
            )
        try:
            setattr(env.unwrapped, OWNER, self.owner)
        except (AttributeError, TypeError):  # an env that takes no attributes (__slots__): left unchecked
            pass
        setattr(env, HOOK, Hook(env, self.owner))
        return env


# -- functions run on an env through the hook ----------------------------------

def get_attr(env: gymnasium.Env, name: str) -> Any:
    return env.get_wrapper_attr(name)


def has_attr(env: gymnasium.Env, name: str) -> bool:
    try:
        env.get_wrapper_attr(name)
    except AttributeError:
        return False
    return True


def call_method(env: gymnasium.Env, name: str, args: tuple, kwargs: dict) -> Any:
    return env.get_wrapper_attr(name)(*args, **kwargs)


def is_wrapped(env: gymnasium.Env, wrapper_class: type) -> bool:
    """``stable_baselines3.common.env_util.is_wrapped``, without importing SB3."""
    while isinstance(env, gymnasium.Wrapper):
        if isinstance(env, wrapper_class):
            return True
        env = env.env
    return False
