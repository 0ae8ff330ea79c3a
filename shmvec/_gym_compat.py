"""Everything that differs between Gymnasium 0.29.1, 1.0 and 1.1+, in one place.

The engine, the workers and the shared-memory path are the same on every
line: a worker asked for same-step autoreset resets an env in the step that
ends its episode and hands back the terminal observation and info. What
differs is the front end's contract, and only this module knows it:

- 1.1+: ``VectorEnv()`` takes no arguments; three autoreset modes
  (``autoreset_mode``, ``NEXT_STEP`` by default) in ``metadata``; an ended
  episode adds ``final_obs``/``final_info``, then the reset info;
  ``options["reset_mask"]``, ``observation_mode``, ``Env.set_wrapper_attr``.
- 1.0: as 1.1, but one autoreset mode, next-step, and no ``AutoresetMode``,
  ``metadata["autoreset_mode"]`` nor ``options["reset_mask"]``.
- 0.29: ``VectorEnv(num_envs, observation_space, action_space)`` and
  ``is_vector_env``; batches and actions of ``Dict`` spaces are
  ``OrderedDict``; always same-step autoreset, where the reset info gets
  ``final_observation`` and ``final_info`` added (``_add_info`` does not nest:
  ``final_info`` holds one dict per env, ``None`` elsewhere); ``set_attr`` is
  ``setattr`` on the outermost wrapper; ``SyncVectorEnv`` and
  ``AsyncVectorEnv`` take ``observation_space`` and ``action_space`` (each
  env's must equal them); an env's ``reset()`` gets ``seed`` and ``options``
  each only when it is not None (1.x passes both always: ``RESET_CALL``).
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium
import gymnasium.vector

__all__ = [
    "GYMNASIUM_VERSION", "GYMNASIUM_1", "AUTORESET_MODES", "AutoresetMode", "VectorEnv", "require_gymnasium",
    "autoreset_mode", "vector_metadata", "RESET_CALL", "check_space_keywords", "check_given_spaces",
    "episode_end_infos", "set_wrapper_attr", "dict_builder",
]

GYMNASIUM_VERSION: str = gymnasium.__version__
GYMNASIUM_1: bool = int(GYMNASIUM_VERSION.split(".")[0]) >= 1
# AutoresetMode (and with it options["reset_mask"]) came in 1.1.
AUTORESET_MODES: bool = hasattr(gymnasium.vector, "AutoresetMode")


def require_gymnasium(feature: str, since: str, error: type[Exception] = ValueError) -> None:
    """Refuses a feature that the installed Gymnasium lacks: `since` is
    "1.0" (what 0.29 lacks) or "1.1" (what 0.29 and 1.0 lack)."""
    if GYMNASIUM_1 and (since == "1.0" or AUTORESET_MODES):
        return
    how = ("the step after the one that ends its episode" if GYMNASIUM_1 else
           'the step that ends its episode, with infos["final_observation"] and infos["final_info"]')
    raise error(
        f"{feature} needs gymnasium>={since}; the installed gymnasium {GYMNASIUM_VERSION} has no such "
        f"feature (its vector envs always reset an env in {how})"
    )


if AUTORESET_MODES:
    from gymnasium.vector import AutoresetMode
else:
    class AutoresetMode(enum.Enum):  # type: ignore[no-redef]
        """1.1's modes, for shmvec's own use: 0.29 has only SAME_STEP, 1.0
        only NEXT_STEP."""

        NEXT_STEP = "NextStep"
        SAME_STEP = "SameStep"
        DISABLED = "Disabled"


def autoreset_mode(mode: Any) -> AutoresetMode:
    """An AutoresetMode from the caller's value (None: the installed
    Gymnasium's default, NEXT_STEP from 1.0 on), its value or its member name."""
    if not AUTORESET_MODES:
        if mode is not None:
            require_gymnasium(f"autoreset_mode={mode!r}", "1.1")
        return AutoresetMode.NEXT_STEP if GYMNASIUM_1 else AutoresetMode.SAME_STEP
    if mode is None:
        return AutoresetMode.NEXT_STEP
    if isinstance(mode, AutoresetMode):
        return mode
    try:
        return AutoresetMode(mode)
    except ValueError:
        pass
    if isinstance(mode, str):  # also accept the member names: "NEXT_STEP", "same_step"
        try:
            return AutoresetMode[mode.upper()]
        except KeyError:
            pass
    raise ValueError(
        f"autoreset_mode must be an AutoresetMode or one of "
        f"{[m.value for m in AutoresetMode]}, got {mode!r}"
    )


# How the vector envs call an env's reset() (shmvec._engine.env_slice.RESET_CALLS):
# 1.x passes seed and options always, 0.29 each only when it is not None.
RESET_CALL = "seed-and-options" if GYMNASIUM_1 else "given"


def check_space_keywords(observation_space: Any, action_space: Any) -> None:
    """0.29's SyncVectorEnv and AsyncVectorEnv take the single env's spaces
    as keywords; 1.x's take neither, and refuse them as any unknown keyword."""
    if not GYMNASIUM_1:
        return
    for name, value in (("observation_space", observation_space), ("action_space", action_space)):
        if value is not None:
            raise TypeError(
                f"ShmVecEnv got an unexpected keyword argument {name!r}: Gymnasium {GYMNASIUM_VERSION}'s vector "
                "envs take the spaces from the envs (observation_mode=(batched space, single space) sets the "
                "observation spaces); only 0.29's took them as keywords"
            )


def check_given_spaces(observation_space: Any, action_space: Any, env_observation_space: Any,
                       env_action_space: Any) -> None:
    """0.29: spaces given as keywords must equal every env's (the engine has
    checked that the envs' equal env 0's), with 0.29's errors."""
    if observation_space is not None and not (env_observation_space == observation_space):
        raise RuntimeError(
            f"Some environments have an observation space different from `{observation_space}`. In order to "
            "batch observations, the observation spaces from all environments must be equal."
        )
    if action_space is not None and not (env_action_space == action_space):
        raise RuntimeError(
            f"Some environments have an action space different from `{action_space}`. In order to batch "
            "actions, the action spaces from all environments must be equal."
        )


def vector_metadata(env_metadata: dict, mode: AutoresetMode) -> dict:
    if AUTORESET_MODES:
        return {**env_metadata, "autoreset_mode": mode}
    return dict(env_metadata)


if GYMNASIUM_1:
    from gymnasium.vector import VectorEnv

    def dict_builder(parts: list[tuple[Any, Callable[[Iterator], Any]]]) -> Callable[[Iterator], dict]:
        """Builds the value of a Dict space (a batch, or one env's action)
        from its parts: (key, a function that takes the key's value)."""
        return lambda it: {key: part(it) for key, part in parts}

    def episode_end_infos(info: dict | None, final_obs: Any, final_info: dict) -> tuple[dict, ...]:
        """What SyncVectorEnv's SAME_STEP adds to the infos, in order, for an
        env whose episode ended: the final step's, then the reset's info."""
        return ({"final_obs": final_obs, "final_info": final_info}, info or {})

    def set_wrapper_attr(env: gymnasium.Env, name: str, value: Any) -> None:
        env.set_wrapper_attr(name, value)

else:
    def dict_builder(parts: list[tuple[Any, Callable[[Iterator], Any]]]) -> Callable[[Iterator], dict]:
        return lambda it: collections.OrderedDict([(key, part(it)) for key, part in parts])  # as 0.29 builds

    class VectorEnv(gymnasium.vector.VectorEnv):  # type: ignore[no-redef]
        """0.29's VectorEnv with 1.x's argument-less ``__init__``: subclasses
        set ``num_envs`` and the spaces once their envs are described."""

        def __init__(self) -> None:
            self.is_vector_env = True
            self.viewer = None  # VectorEnv.close() reads it

    def episode_end_infos(info: dict | None, final_obs: Any, final_info: dict) -> tuple[dict, ...]:
        """What 0.29's SyncVectorEnv adds to the infos for an env whose
        episode ended: the reset info with the final step's added."""
        info = dict(info or {})
        info["final_observation"] = final_obs
        info["final_info"] = final_info
        return (info,)

    def set_wrapper_attr(env: gymnasium.Env, name: str, value: Any) -> None:
        setattr(env, name, value)  # as 0.29's vector envs: on the outermost wrapper
