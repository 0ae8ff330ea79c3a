"""Checks of the arguments of the Gymnasium vector env contract, shared by
every front end that takes them (messages as in SyncVectorEnv)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["seeds_for", "checked_reset_mask", "per_env_values"]


def seeds_for(seed: Any, num_envs: int) -> list[int | None]:
    """One seed per env: None, ``seed + i`` for an int, or the list as given."""
    if seed is None:
        return [None] * num_envs
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return [int(seed) + i for i in range(num_envs)]
    if not isinstance(seed, (list, tuple, np.ndarray)):
        raise TypeError(f"seed must be None, an int or a list of ints, got {type(seed).__name__}")
    if len(seed) != num_envs:
        raise ValueError(
            f"If seeds are passed as a list the length must match num_envs={num_envs} "
            f"but got length={len(seed)}."
        )
    out = []
    for s in seed:
        if s is not None and (not isinstance(s, (int, np.integer)) or isinstance(s, bool)):
            raise TypeError(f"each seed must be an int or None, got {s!r}")
        out.append(None if s is None else int(s))
    return out


def checked_reset_mask(reset_mask: Any, num_envs: int) -> np.ndarray:
    """A copy of ``options["reset_mask"]``, checked in SyncVectorEnv's order."""
    if not isinstance(reset_mask, np.ndarray):
        raise TypeError(f"`options['reset_mask']` must be a numpy array, got {type(reset_mask)}")
    if reset_mask.shape != (num_envs,):
        raise ValueError(f"`options['reset_mask']` must have shape `({num_envs},)`, got {reset_mask.shape}")
    if reset_mask.dtype != np.bool_:
        raise TypeError(f"`options['reset_mask']` must have `dtype=np.bool_`, got {reset_mask.dtype}")
    if not np.any(reset_mask):
        raise ValueError(
            "`options['reset_mask']` must contain a boolean array with at least one True value, "
            f"got reset_mask={reset_mask}"
        )
    return reset_mask.copy()


def per_env_values(values: Any, num_envs: int) -> list:
    """``set_attr``'s values: one per env if a list or tuple, else the same for all."""
    if not isinstance(values, (list, tuple)):
        return [values] * num_envs
    if len(values) != num_envs:
        raise ValueError(
            "Values must be a list or tuple with length equal to the number of environments. "
            f"Got `{len(values)}` values for {num_envs} environments."
        )
    return list(values)
