"""The Gymnasium vector env contract's pieces shared by every front end
that has them: checks of its arguments (messages as in SyncVectorEnv, or as
ShmVecEnv words them where SyncVectorEnv has no such check) and the
attribute methods written on ``call()``."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np

from shmvec import _core

__all__ = [
    "seeds_for", "checked_reset_mask", "check_async_reset_options", "per_env_values", "check_sync", "check_wait",
    "check_async", "checked_env_ids",
    "env_ids_array", "raise_env_ids_problem",
    "AttributesByCall",
]


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


def check_async_reset_options(options: Any) -> None:
    """``async_reset()``'s options: a dict or None, without a reset mask
    (async_reset() resets every env; a mask would reach the envs' reset())."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options must be a dict or None, got {type(options).__name__}")
    if options and "reset_mask" in options:
        raise ValueError("async_reset() resets every env: options['reset_mask'] is for reset() in lock-step "
                         "(batch_size=num_envs)")


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


# -- sync and async mode --------------------------------------------------------


def check_sync(envs: Any, name: str, instead: str) -> None:
    """Refuses `name` (reset/step) of a front end in async mode (batch_size < num_envs)."""
    if envs.batch_size < envs.num_envs:
        raise RuntimeError(
            f"{name}() is for synchronous stepping; this env has batch_size={envs.batch_size} "
            f"< num_envs={envs.num_envs}: use {instead}()"
        )


def check_wait(envs: Any, phase: Any, instead: str) -> None:
    """Raises for a ``*_wait()`` of `envs` (a front end with a command cycle,
    ``_cycle``) with no call of `phase` waiting: the closed or broken error,
    what to call `instead` in async mode, else NoAsyncCallError."""
    envs._cycle.check_usable()
    check_sync(envs, f"{phase.value}_wait", instead)
    envs._cycle.check_waiting(phase)


def check_async(envs: Any, name: str) -> None:
    """Refuses `name` (async_reset/send/recv) of a front end in synchronous mode."""
    if envs.batch_size == envs.num_envs:
        raise RuntimeError(f"{name}() is for async mode: create the {type(envs).__name__} with batch_size < num_envs")


def checked_env_ids(env_ids: Any, num_envs: int, in_flight: np.ndarray, reset_pending: Collection[int],
                    kept: tuple | None) -> np.ndarray:
    """``send()``'s `env_ids` as an array: 1-D ints in range, no repeats, none
    in flight (`in_flight`: a mask), none whose ``async_reset()`` results
    are not yet received (`reset_pending`: their ids) and none in the batch
    `kept` (see ``env_ids_array``)."""
    ids = env_ids_array(env_ids, reset_pending, kept)
    # send()'s path: one native pass, not numpy reductions (a microsecond each).
    raise_env_ids_problem(_core.env_ids_problem(ids, in_flight), ids, num_envs, in_flight)
    return ids


def env_ids_array(env_ids: Any, reset_pending: Collection[int], kept: tuple | None) -> np.ndarray:
    """``send()``'s `env_ids` as a 1-D array of ints, none of them waiting
    for its ``async_reset()`` results to be received (`reset_pending`), nor
    in `kept`: the batch a Ctrl-C kept from recv()'s caller, which the next
    recv() returns (None, as a rule)."""
    ids = np.asarray(env_ids)
    if ids.size == 0:
        raise ValueError("send() got no env ids: pass those of the envs to step (recv()'s infos['env_id'])")
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TypeError(f"env_ids must be a 1-D array of ints, got {ids.dtype} of shape {ids.shape}")
    waiting = set(reset_pending).intersection(ids.tolist()) if reset_pending else None
    if waiting:
        raise ValueError(f"envs {sorted(waiting)} have reset results not yet received: recv() them first")
    if kept is not None:
        unreceived = np.intersect1d(ids, kept[4]["env_id"])
        if unreceived.size:
            raise ValueError(f"envs {unreceived.tolist()} are in the batch that an interrupted recv() did not "
                             "hand out: recv() them first")
    return ids


def raise_env_ids_problem(problem: int, ids: np.ndarray, num_envs: int, in_flight: np.ndarray) -> None:
    """Raises the error for ``_core.env_ids_problem``'s `problem` (0: none)."""
    if problem == 1:
        raise ValueError(f"env_ids must be in [0, {num_envs}), got {ids.tolist()}")
    if problem == 2:
        raise ValueError(f"env_ids has repeated envs: {ids.tolist()}")
    if problem == 3:
        raise ValueError(f"envs {ids[in_flight[ids]].tolist()} are already in flight: recv() them before sending again")


# -- attributes -----------------------------------------------------------------


class AttributesByCall:
    """``render``, ``get_attr``, ``set_attr``, ``np_random_seed`` and
    ``np_random`` of a front end, written on its ``call()``, its
    ``_check_open()`` and its ``_set_attr(name, values)`` (one value per env,
    already checked)."""

    def render(self) -> tuple[Any, ...]:
        """The rendered frames of every env."""
        return self.call("render")

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute `name` of every env."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Sets `name` on every env: one value each if `values` is a list or
        tuple, else the same value for all."""
        self._check_open()
        self._set_attr(name, per_env_values(values, self.num_envs))

    @property
    def np_random_seed(self) -> tuple[int, ...]:
        return self.get_attr("np_random_seed")

    @property
    def np_random(self) -> tuple[np.random.Generator, ...]:
        return self.get_attr("np_random")
