"""Everything that differs between Gymnasium 0.29.1 and 1.x, in one place.

The engine, the workers and the shared-memory path are the same on both
lines: a worker asked for same-step autoreset resets an env in the step that
ends its episode and hands back the terminal observation and info. What
differs is the front end's contract, and only this module knows it:

- 1.x: ``VectorEnv()`` takes no arguments; three autoreset modes
  (``autoreset_mode``, ``NEXT_STEP`` by default) in ``metadata``; an ended
  episode adds ``final_obs``/``final_info``, then the reset info;
  ``options["reset_mask"]``, ``observation_mode``, ``Env.set_wrapper_attr``.
- 0.29: ``VectorEnv(num_envs, observation_space, action_space)`` and
  ``is_vector_env``; batches and actions of ``Dict`` spaces are
  ``OrderedDict``; always same-step autoreset, where the reset info gets
  ``final_observation`` and ``final_info`` added (``_add_info`` does not nest:
  ``final_info`` holds one dict per env, ``None`` elsewhere); ``set_attr`` is
  ``setattr`` on the outermost wrapper.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium
import gymnasium.vector

__all__ = [
    "GYMNASIUM_VERSION", "GYMNASIUM_1", "AutoresetMode", "VectorEnv", "require_gymnasium_1",
    "autoreset_mode", "vector_metadata", "episode_end_infos", "set_wrapper_attr", "dict_builder",
]

GYMNASIUM_VERSION: str = gymnasium.__version__
GYMNASIUM_1: bool = int(GYMNASIUM_VERSION.split(".")[0]) >= 1


def require_gymnasium_1(feature: str, error: type[Exception] = ValueError) -> None:
    """Refuses a feature that only Gymnasium 1.x has, naming the version."""
    if not GYMNASIUM_1:
        raise error(
            f"{feature} needs gymnasium>=1.1; the installed gymnasium {GYMNASIUM_VERSION} has no such "
            "feature (its vector envs always reset an env in the step that ends its episode, with "
            'infos["final_observation"] and infos["final_info"])'
        )


if GYMNASIUM_1:
    from gymnasium.vector import AutoresetMode, VectorEnv

    def dict_builder(parts: list[tuple[Any, Callable[[Iterator], Any]]]) -> Callable[[Iterator], dict]:
        """Builds the value of a Dict space (a batch, or one env's action)
        from its parts: (key, a function that takes the key's value)."""
        return lambda it: {key: part(it) for key, part in parts}

    def autoreset_mode(mode: Any) -> AutoresetMode:
        """An AutoresetMode from the caller's value (None: NEXT_STEP), its
        value or its member name."""
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

    def vector_metadata(env_metadata: dict, mode: AutoresetMode) -> dict:
        return {**env_metadata, "autoreset_mode": mode}

    def episode_end_infos(info: dict | None, final_obs: Any, final_info: dict) -> tuple[dict, ...]:
        """What SyncVectorEnv's SAME_STEP adds to the infos, in order, for an
        env whose episode ended: the final step's, then the reset's info."""
        return ({"final_obs": final_obs, "final_info": final_info}, info or {})

    def set_wrapper_attr(env: gymnasium.Env, name: str, value: Any) -> None:
        env.set_wrapper_attr(name, value)

else:
    def dict_builder(parts: list[tuple[Any, Callable[[Iterator], Any]]]) -> Callable[[Iterator], dict]:
        return lambda it: collections.OrderedDict([(key, part(it)) for key, part in parts])  # as 0.29 builds

    class AutoresetMode(enum.Enum):  # type: ignore[no-redef]
        """1.x's modes, for shmvec's own use: 0.29 has only SAME_STEP."""

        NEXT_STEP = "NextStep"
        SAME_STEP = "SameStep"
        DISABLED = "Disabled"

    class VectorEnv(gymnasium.vector.VectorEnv):  # type: ignore[no-redef]
        """0.29's VectorEnv with 1.x's argument-less ``__init__``: subclasses
        set ``num_envs`` and the spaces once their envs are described."""

        def __init__(self) -> None:
            self.is_vector_env = True
            self.viewer = None  # VectorEnv.close() reads it

    def autoreset_mode(mode: Any) -> AutoresetMode:
        if mode is not None:
            require_gymnasium_1(f"autoreset_mode={mode!r}")
        return AutoresetMode.SAME_STEP

    def vector_metadata(env_metadata: dict, mode: AutoresetMode) -> dict:
        return dict(env_metadata)

    def episode_end_infos(info: dict | None, final_obs: Any, final_info: dict) -> tuple[dict, ...]:
        """What 0.29's SyncVectorEnv adds to the infos for an env whose
        episode ended: the reset info with the final step's added."""
        info = dict(info or {})
        info["final_observation"] = final_obs
        info["final_info"] = final_info
        return (info,)

    def set_wrapper_attr(env: gymnasium.Env, name: str, value: Any) -> None:
        setattr(env, name, value)  # as 0.29's vector envs: on the outermost wrapper
