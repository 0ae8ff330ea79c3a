"""Moving batches between the caller's objects and the arena: validated
actions in, observations (copied or viewed) out. Shared by every front end."""

from __future__ import annotations

from collections.abc import Callable
from copy import deepcopy
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from shmvec._engine.layout import (
    ACTION_AS_GIVEN, ACTION_AS_PYTHON, action_dtype_code, flattener, is_single_fixed_leaf, unflattener,
)

if TYPE_CHECKING:
    from shmvec._engine.engine import Engine

__all__ = ["BatchIO", "action_leaves", "checked_leaf_batch", "checked_object_batch", "list_items_flag"]


# -- actions ------------------------------------------------------------------
# A batch of actions is checked leaf by leaf (see shmvec._engine.layout); the Ray front end
# checks its actions with these too: `what` names
# the leaf in errors, "actions" for a space of one fixed-shape leaf, else
# "action leaf <k>".


def action_leaves(flatten: Callable[[Any], list], actions: Any) -> list:
    """The leaf batches of a batch of actions (`flatten`: the action space's
    flattener), or ValueError if it does not have the space's structure."""
    try:
        return flatten(actions)
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise ValueError(f"actions do not have the structure of the action space: {exc!r}") from None


def checked_leaf_batch(value: Any, shape: tuple[int, ...], dtype: np.dtype, what: str,
                       any_number: bool = False) -> np.ndarray:
    """A fixed-shape leaf's batch as an array of `shape`, in a dtype that
    casts to the space's `dtype` within its kind, or, for a Box or
    MultiBinary leaf (`any_number`), in any number dtype: policies sample
    their actions as floats (SB3's PPO, A2C and SAC, an integer Box's and a
    MultiBinary's too, whose contains() takes 0s and 1s of any dtype), and
    SyncVectorEnv hands each env its row as it is. A Discrete's or
    MultiDiscrete's floats are refused: their contains() refuses them."""
    try:
        array = value if type(value) is np.ndarray else np.asarray(value)
    except ValueError:  # ragged, as per-env items given for one leaf of a Tuple or Dict batch
        raise ValueError(f"{what} must be a batch of shape {shape} ({shape[0]} envs), got a ragged sequence "
                         f"that is no array; a Tuple or Dict space's batch holds one batch per item "
                         f"(as gymnasium's create_empty_array), not one item per env") from None
    if array.ndim == 0:  # as SyncVectorEnv, which cannot iterate over it
        raise TypeError(f"{what} must be a batch of shape {shape} ({shape[0]} envs), got the scalar {value!r}")
    if array.shape != shape:
        raise ValueError(f"{what} must have shape {shape} ({shape[0]} envs), got {array.shape}")
    if array.dtype != dtype and not np.can_cast(array.dtype, dtype, "same_kind") \
            and not (any_number and action_dtype_code(array.dtype) is not None):
        allowed = "numbers of up to 8 bytes" if any_number else "only casts within the same kind"
        raise TypeError(f"{what} of dtype {array.dtype} cannot be used for an action space of dtype "
                        f"{dtype} ({allowed} are allowed)")
    return array


def cast_leaf_batch(array: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """A checked leaf batch in the space's `dtype`, as async mode stores it.
    For a space of integers or bools it must cast exactly (a MultiBinary's
    0.0s and 1.0s, an integer Box's whole floats, ints in range): async mode
    hands the envs the space's dtype, so 0.5 would silently become 0, and
    2**20 as int16 0. (Floats round to a float space's precision.)"""
    cast = array.astype(dtype, copy=False)
    if dtype.kind != "f" and cast is not array and not np.array_equal(cast, array):
        raise ValueError(f"{what} of dtype {array.dtype} hold values that {dtype} cannot store exactly: "
                         "async mode hands the envs actions in the action space's dtype")
    return cast


def list_items_flag(value: Any, ndim: int) -> int:
    """How the envs of a batch of `ndim` dimensions get their items when it
    is a list or tuple, as SyncVectorEnv hands them on by iterating over it:
    ACTION_AS_PYTHON for Python ints, floats or bools of one type (`ndim` 1),
    or lists of them nested `ndim` - 1 deep (np.asarray stores them as int64,
    float64 or bool, so each row's ``tolist()`` is the env's item);
    ACTION_AS_GIVEN for items no array gives back (tuples, Python numbers of
    mixed types, 0-d arrays, numpy items of several dtypes), which then
    travel as they are; 0 for anything else (numpy items of one dtype and of
    a row's shape are the array's own)."""
    if type(value) not in (list, tuple) or not value:
        return 0
    if _python_values(value, ndim):
        return ACTION_AS_PYTHON
    if ndim == 1:
        numpy_rows = all(isinstance(v, np.generic) for v in value)
    else:
        numpy_rows = all(type(v) is np.ndarray and v.ndim == ndim - 1 for v in value)
    if numpy_rows and len({v.dtype for v in value}) == 1:
        return 0
    return ACTION_AS_GIVEN


def _python_values(items: list | tuple, ndim: int) -> bool:
    """Whether a non-empty list or tuple holds Python numbers of one type
    (or lists of them, nested `ndim` - 1 deep): see list_items_flag."""
    for _ in range(ndim - 1):
        if not all(type(v) is list for v in items):
            return False  # (tuples, arrays: tolist() would not give them back)
        items = list(chain.from_iterable(items))
    if not items:
        return True
    kind = type(items[0])
    return kind in (int, float, bool) and all(type(v) is kind for v in items)


def checked_object_batch(value: Any, count: int, what: str) -> list:
    """The `count` values of a leaf without a fixed shape, as a list."""
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{what} has {len(values)} values for {count} envs")
    return values


def _batched(space: Any, out: Any, objects: list, copy: bool) -> Any:
    """The batch of a leaf without a fixed shape, made as SyncVectorEnv makes
    it: gymnasium's ``concatenate`` (a tuple of the values, or what a custom
    space registered), deep-copied with `copy`, so that an env's own objects
    never reach the caller."""
    batch = concatenate(space, objects, out)
    return deepcopy(batch) if copy else batch


class BatchIO:
    def __init__(self, engine: Engine, copy: bool = True):
        self.num_envs = engine.num_envs
        self.copy = copy
        observation_space = engine.description["observation_space"]
        action_space = engine.description["action_space"]
        views = engine.views
        self.action_views = views["actions"]
        # Per action leaf, its views in every storable dtype (by code), the
        # codes of the dtypes the current batch is stored in, and the code of
        # the space's dtype.
        self._action_dtype_views = views["action_views"]
        self._action_codes = views["action_dtypes"]
        self._action_space_codes = engine.layout.action_space_codes
        self._any_number_actions = [leaf.any_number for leaf in engine.layout.action_leaves]
        # Per leaf, the dtype object of the last batch and its code: a batch
        # of the same dtype object (the usual case) needs no lookup.
        self._last_dtype: list = [None] * len(self.action_views)
        self._last_code: list = [None] * len(self.action_views)
        self.obs_views = views["observations"]
        self.rewards = views["rewards"]
        self.terminations = views["terminations"]
        self.truncations = views["truncations"]
        self._single_action = is_single_fixed_leaf(action_space)
        self._single_obs = is_single_fixed_leaf(observation_space)
        # What async recv() copies in one native call (AsyncSteps.take_batch),
        # for observations of one fixed-shape leaf.
        self.batch_sources = [self.obs_views[0], self.rewards, self.terminations, self.truncations] \
            if self._single_obs else None
        self._flatten_actions = flattener(action_space)
        self._flatten_obs, self._unflatten_obs = flattener(observation_space), unflattener(observation_space)
        self._zero_dim = [leaf.zero_dim_array for leaf in engine.layout.observation_leaves]
        # Values of observation leaves without a fixed shape, per leaf and env;
        # and per such leaf, its space and the batch that SyncVectorEnv would
        # fill (gymnasium's create_empty_array), refilled every step.
        self._object_obs = [None if v is not None else [None] * self.num_envs for v in self.obs_views]
        self._object_batches = [None if leaf.fixed else (leaf.space, create_empty_array(leaf.space, self.num_envs))
                                for leaf in engine.layout.observation_leaves]
        # With restarts: the observations the caller was last handed (a snapshot).
        self.last_seen: list | None = None

    # -- actions in ---------------------------------------------------------

    def write_actions(self, actions: Any) -> list | None:
        """Validates a batch of actions for every env and writes it into the
        arena; returns, per env, the values of its action leaves that travel
        beside the arena (leaves without a fixed shape, and items kept as the
        caller gave them), if any, in leaf order."""
        if self._single_action:
            given = self._write_leaf(0, actions, "actions")
            return None if given is None else [[item] for item in given]
        leaves = action_leaves(self._flatten_actions, actions)
        object_actions = None
        for k, (view, value) in enumerate(zip(self.action_views, leaves)):
            if view is None:
                values = checked_object_batch(value, self.num_envs, f"action leaf {k}")
            else:
                values = self._write_leaf(k, value, f"action leaf {k}")
                if values is None:
                    continue
            if object_actions is None:
                object_actions = [[] for _ in range(self.num_envs)]
            for i in range(self.num_envs):
                object_actions[i].append(values[i])
        return object_actions

    def action_rows(self, actions: Any, count: int) -> list[np.ndarray]:
        """Validates async mode's batch of `count` actions (for the envs
        send() is given): per action leaf, its rows as a C-contiguous array in
        the space's dtype, for ``_core.write_rows``. The workers read every
        row in the space's dtype, since other envs may be reading theirs (a
        lock-step batch keeps its own: see _write_leaf); the action dtype
        codes stay the space's, as the engine set them, since async mode
        never steps in lock-step."""
        if self._single_action:
            leaves = [actions]
        else:
            if any(v is None for v in self.action_views):
                raise NotImplementedError("async mode needs action spaces whose leaves have fixed shapes")
            leaves = action_leaves(self._flatten_actions, actions)
        rows = []
        for k, (view, value) in enumerate(zip(self.action_views, leaves)):
            shape = (count, *view.shape[1:])
            array = value
            if type(array) is not np.ndarray or array.shape != shape or array.dtype != view.dtype:
                what = "actions" if self._single_action else f"action leaf {k}"
                array = cast_leaf_batch(checked_leaf_batch(value, shape, view.dtype, what, self._any_number_actions[k]),
                                        view.dtype, what)
            rows.append(np.ascontiguousarray(array))
        return rows

    def _write_leaf(self, k: int, value: Any, what: str) -> list | None:
        """Validates action leaf `k`'s batch and writes it, in its own dtype
        where it can be, so that each env gets an element of the caller's
        batch, as under SyncVectorEnv (np.float64 for a float64 batch, even for
        a float32 Box). Returns the caller's items if the envs get them as
        given (see list_items_flag), else None."""
        view = self.action_views[k]
        array = value
        # An array of the leaf's shape and dtype needs no check: the usual
        # batch costs no call here (this is every step's path).
        if type(array) is not np.ndarray or array.shape != view.shape or array.dtype != view.dtype:
            array = checked_leaf_batch(value, view.shape, view.dtype, what, self._any_number_actions[k])
        codes = self._action_codes
        dtype = array.dtype
        if dtype is self._last_dtype[k]:
            code = self._last_code[k]
        else:
            code = action_dtype_code(dtype)
            if code is None:  # stored in the space's dtype, cast (checked above)
                code = self._action_space_codes[k]
            self._last_dtype[k], self._last_code[k] = dtype, code
        self._action_dtype_views[k][code][...] = array  # the same dtype, or a cast checked above
        flag = list_items_flag(value, array.ndim) if array is not value else 0  # (not for an array)
        codes[k] = code | flag
        return list(value) if flag == ACTION_AS_GIVEN else None

    # -- observations out -----------------------------------------------------

    def update_objects(self, row: int, objects: list | None) -> None:
        """Stores an env's observation leaves that have no fixed shape."""
        if objects is None:
            return
        values = iter(objects)
        for per_env in self._object_obs:
            if per_env is not None:
                per_env[row] = next(values)

    def observations(self, copy: bool | None = None) -> Any:
        """The batched observations: copies, or views into the arena."""
        copy = self.copy if copy is None else copy
        if self._single_obs:
            view = self.obs_views[0]
            return view.copy() if copy else view
        values = []
        for view, objects, batch in zip(self.obs_views, self._object_obs, self._object_batches):
            if view is None:
                values.append(_batched(*batch, objects, copy))
            else:
                values.append(view.copy() if copy else view)
        return self._unflatten_obs(values)

    def observations_at(self, rows: np.ndarray) -> Any:
        """The observations of some envs (a batch of async results), copied
        (take() copies as fancy indexing does, in a quarter of the time)."""
        if self._single_obs:
            return self.obs_views[0].take(rows, axis=0)
        values = []
        for view, objects, batch in zip(self.obs_views, self._object_obs, self._object_batches):
            if view is None:
                space = batch[0]
                values.append(_batched(space, create_empty_array(space, len(rows)), [objects[r] for r in rows],
                                       self.copy))
            else:
                values.append(view.take(rows, axis=0))
        return self._unflatten_obs(values)

    def snapshot(self) -> list:
        """A copy of every observation leaf (arrays, and lists for leaves
        without a fixed shape), for `observation(row, snapshot=...)`."""
        return [view.copy() if view is not None else list(objects)
                for view, objects in zip(self.obs_views, self._object_obs)]

    # -- restarts: what the caller last saw ---------------------------------
    # A restarted env's report carries the last observation the caller was
    # handed; its dead worker may have overwritten its rows since.

    def remember(self, rows: np.ndarray | None = None) -> None:
        """Keeps the observations just handed out (of every env, or `rows`)."""
        if self.last_seen is None:  # once; then copies into the same buffers, no allocation per step
            self.last_seen = self.snapshot()
            return
        for last, view, objects in zip(self.last_seen, self.obs_views, self._object_obs):
            if view is None:
                if rows is None:
                    last[:] = objects
                else:
                    for r in rows.tolist():
                        last[r] = objects[r]
            elif rows is None:
                np.copyto(last, view)
            else:
                last[rows] = view[rows]

    def restore(self, rows: list[int]) -> None:
        """Writes the remembered observations of `rows` back into the arena."""
        if self.last_seen is None or not len(rows):
            return
        for last, view, objects in zip(self.last_seen, self.obs_views, self._object_obs):
            if view is None:
                for r in rows:
                    objects[r] = last[r]
            else:
                view[rows] = last[rows]

    def write_observations(self, batch: Any) -> None:
        """Writes a batch of observations (of every env) into the arena."""
        for view, objects, value in zip(self.obs_views, self._object_obs, self._flatten_obs(batch)):
            if view is None:
                objects[:] = list(value)
            else:
                view[...] = value

    def observation(self, row: int, snapshot: list | None = None) -> Any:
        """One env's observation, as a copy: its current one, or the one in a
        `snapshot`."""
        views = snapshot if snapshot is not None else self.obs_views
        values = []
        for k, view in enumerate(views):
            if isinstance(view, list):  # a snapshot of a leaf without a fixed shape
                values.append(view[row])
            elif view is None:
                values.append(self._object_obs[k][row])
            elif view.ndim > 1 or self._zero_dim[k]:
                values.append(view[row, ...].copy())  # an array, 0-d for a Box of shape ()
            else:
                values.append(view[row])
        return self._unflatten_obs(values)

    def final_obs(self, row: int, final_obs: Any) -> Any:
        """A record's final_obs; None in a SAME_STEP restart report, whose
        worker died with it: then the last observation the caller saw."""
        return self.observation(row, snapshot=self.last_seen) if final_obs is None else final_obs
