"""From Gymnasium spaces to arena fields.

A space is split into leaves. A leaf of fixed shape and dtype (Box, Discrete,
MultiDiscrete, MultiBinary) gets a ``(num_envs, *shape)`` array in the arena.
A leaf without one (Text, Sequence, Graph, OneOf, custom spaces) travels by
pickle next to the infos: slower, but any space works. Dict and Tuple spaces
are containers of leaves, nested to any depth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces

from shmvec._gym_compat import dict_builder

__all__ = ["Leaf", "leaves_of", "flattener", "unflattener", "DataLayout", "write_leaf_fallback"]

INFO_COLUMNS = 32  # at most this many keys in an info that travels as columns
INFO_SCHEMA_BYTES = 4096  # per slice: its info columns' schema, pickled (see Stepper.attach_info_columns)
FIXED_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)
ALIGN = 128

# The dtypes a batch of actions can be stored in as the caller passed it, so
# that each env gets an element of the caller's batch as SyncVectorEnv hands
# it over (np.float64 for a float64 batch, even for a float32 Box). A leaf's
# code in the arena's ``action_dtypes`` is an index into this table (or, for a
# space dtype outside it, ACTION_DTYPES_EXTRA: the space's own dtype).
ACTION_DTYPES = tuple(np.dtype(d) for d in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64,
))
ACTION_DTYPE_CODES = {d: code for code, d in enumerate(ACTION_DTYPES)}
ACTION_DTYPES_EXTRA = len(ACTION_DTYPES)
ACTION_ITEMSIZE = max(d.itemsize for d in ACTION_DTYPES)
# Set on a code when the caller passed a list (or tuple) of Python ints,
# floats or bools of one type, or of lists of them: SyncVectorEnv iterates
# over the batch, so each env gets a Python scalar or list, which the stepper
# makes with its row's tolist().
ACTION_AS_PYTHON = 0x80
# Set on a code when the caller passed a list (or tuple) whose items an array
# would not hand back as they are (tuples, Python numbers of mixed types):
# each env's item then travels beside the arena, as the values of leaves
# without a fixed shape do, and the env gets it as SyncVectorEnv hands it on.
ACTION_AS_GIVEN = 0x40


def action_dtype_code(dtype: np.dtype) -> int | None:
    """The code of a dtype an action batch can be stored in as is, or None."""
    code = ACTION_DTYPE_CODES.get(dtype)
    # np.dtype equality ignores the scalar type (np.longlong == np.int64 on
    # Linux): only a dtype whose elements are of the table's type qualifies.
    return code if code is not None and dtype.type is ACTION_DTYPES[code].type else None


@dataclass(frozen=True)
class Leaf:
    path: tuple[Any, ...]  # keys (Dict) and indices (Tuple) from the root
    shape: tuple[int, ...] | None  # None: no fixed shape, travels by pickle
    dtype: np.dtype | None
    zero_dim_array: bool = False  # a Box of shape (): its values are 0-d arrays, not scalars
    space: spaces.Space | None = None  # of a leaf without a fixed shape: batched as Gymnasium batches it
    # A Box's or a MultiBinary's: as actions, a batch of any number dtype is
    # taken (policies sample them as floats: see checked_leaf_batch).
    any_number: bool = False

    @property
    def fixed(self) -> bool:
        return self.shape is not None

    def name(self) -> str:
        return "".join(f"[{p!r}]" for p in self.path) or "<root>"


def leaves_of(space: spaces.Space, path: tuple[Any, ...] = ()) -> list[Leaf]:
    """The leaves of a space, depth first, in the space's own key order."""
    if isinstance(space, spaces.Dict):
        return [leaf for key, sub in space.spaces.items() for leaf in leaves_of(sub, path + (key,))]
    if isinstance(space, spaces.Tuple):
        return [leaf for i, sub in enumerate(space.spaces) for leaf in leaves_of(sub, path + (i,))]
    if isinstance(space, FIXED_SPACES):
        zero_dim = isinstance(space, spaces.Box) and space.shape == ()
        return [Leaf(path, tuple(space.shape), np.dtype(space.dtype), zero_dim,
                     any_number=isinstance(space, (spaces.Box, spaces.MultiBinary)))]
    return [Leaf(path, None, None, space=space)]


def is_single_fixed_leaf(space: spaces.Space) -> bool:
    return isinstance(space, FIXED_SPACES)


def flattener(space: spaces.Space) -> Callable[[Any], list[Any]]:
    """A function from a value of `space` to the list of its leaf values."""

    def build(sub: spaces.Space) -> Callable[[Any, list[Any]], None]:
        if isinstance(sub, spaces.Dict):
            parts = [(key, build(s)) for key, s in sub.spaces.items()]

            def flat_dict(value, out):
                for key, part in parts:
                    part(value[key], out)

            return flat_dict
        if isinstance(sub, spaces.Tuple):
            parts_t = [build(s) for s in sub.spaces]

            def flat_tuple(value, out):
                if len(value) != len(parts_t):
                    raise ValueError(f"expected a tuple of {len(parts_t)} items, got {len(value)}")
                for item, part in zip(value, parts_t):
                    part(item, out)

            return flat_tuple
        return lambda value, out: out.append(value)

    fill = build(space)

    def flatten(value: Any) -> list[Any]:
        out: list[Any] = []
        fill(value, out)
        return out

    return flatten


def unflattener(space: spaces.Space) -> Callable[[list[Any]], Any]:
    """The inverse of `flattener`: builds a dict/tuple structure from leaf
    values. Works for single values and for batched ones alike."""

    def build(sub: spaces.Space) -> Callable[[Any], Any]:
        if isinstance(sub, spaces.Dict):
            parts = [(key, build(s)) for key, s in sub.spaces.items()]
            return dict_builder(parts)
        if isinstance(sub, spaces.Tuple):
            parts_t = [build(s) for s in sub.spaces]
            return lambda it: tuple(part(it) for part in parts_t)
        return lambda it: next(it)

    make = build(space)
    return lambda values: make(iter(values))


def write_leaf_fallback(target: np.ndarray, row: int, value: Any) -> None:
    """Writes a leaf value the native fast paths did not take. Casts exactly
    where SyncVectorEnv's ``np.stack(..., out=...)`` casts (``same_kind``)
    and otherwise raises an error naming the env, instead of corrupting."""
    array = np.asarray(value)
    expected = target.shape[1:]
    if array.shape != expected:
        raise ValueError(
            f"env {row} returned an observation of shape {array.shape}, "
            f"but its space has shape {expected}"
        )
    if not np.can_cast(array.dtype, target.dtype, casting="same_kind"):
        raise TypeError(
            f"env {row} returned an observation of dtype {array.dtype}, "
            f"which does not cast safely to the space's dtype {target.dtype}"
        )
    target[row] = array


@dataclass(frozen=True)
class Field:
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


class DataLayout:
    """Where each array of the data region lives in the arena. Built once by
    the front end and shipped to workers, so both sides agree by construction."""

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Space,
                 num_envs: int, base_offset: int, async_region_size: int = 0,
                 record_capacity: int = 0, async_rings: int = 0, slice_starts: tuple[int, ...] = (0,)):
        self.num_envs = num_envs
        self.slice_starts = tuple(slice_starts)  # each slice's first row: the caller's, then each worker's
        self.observation_leaves = leaves_of(observation_space)
        self.action_leaves = leaves_of(action_space)
        self.base_offset = base_offset
        self._end = base_offset
        n = num_envs
        # Action leaves: room for a batch in any dtype of ACTION_DTYPES (or the
        # space's own); `action_dtypes` says which one the current batch is in.
        self.actions = [self._action_field(n, leaf) for leaf in self.action_leaves]
        self.action_dtypes = self._add((len(self.action_leaves),), np.dtype(np.uint8))
        self.action_space_codes = [self.action_code(leaf.dtype) if leaf.fixed else 0
                                   for leaf in self.action_leaves]
        self.observations = [self._field(n, leaf) for leaf in self.observation_leaves]
        self.rewards = self._add((n,), np.dtype(np.float64))
        self.terminations = self._add((n,), np.dtype(np.bool_))
        self.truncations = self._add((n,), np.dtype(np.bool_))
        # Step infos that fit a slice's schema, as columns of 8-byte cells
        # (see shmvec._engine.info_columns), and per env whether its info is there.
        self.info_values = self._add((n, INFO_COLUMNS), np.dtype(np.int64))
        self.info_flags = self._add((n,), np.dtype(np.uint8))
        # Each slice's schema of those columns, where the front end reads it
        # even after the slice's process has died.
        self.info_schemas = self._add((len(self.slice_starts), INFO_SCHEMA_BYTES), np.dtype(np.uint8))
        # Async mode's rings (a pair per worker, and one for the caller's own
        # slice if it has one) and per-env record slots (laid out by the core).
        self.record_capacity = record_capacity
        self.async_rings = async_rings
        self.async_offset = None
        if async_region_size:
            self.async_offset = self._add((async_region_size,), np.dtype(np.uint8)).offset
        self.size = -(-(self._end - base_offset) // 4096) * 4096

    def _add(self, shape: tuple[int, ...], dtype: np.dtype) -> Field:
        offset = -(-self._end // ALIGN) * ALIGN
        self._end = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return Field(offset, shape, dtype)

    def _field(self, n: int, leaf: Leaf) -> Field | None:
        return self._add((n, *leaf.shape), leaf.dtype) if leaf.fixed else None

    def _action_field(self, n: int, leaf: Leaf) -> Field | None:
        """An action leaf's field (typed as the space's dtype) with room for
        the batch in any dtype of ACTION_DTYPES: every dtype's view of it
        starts at the same offset and is contiguous."""
        if not leaf.fixed:
            return None
        field = self._add((n, *leaf.shape), leaf.dtype)
        count = int(np.prod(field.shape, dtype=np.int64))
        self._end = field.offset + count * max(ACTION_ITEMSIZE, leaf.dtype.itemsize)
        return field

    @staticmethod
    def action_code(dtype: np.dtype) -> int:
        """The code of an action leaf stored in `dtype`, the space's dtype."""
        code = action_dtype_code(dtype)
        return ACTION_DTYPES_EXTRA if code is None else code

    @staticmethod
    def action_dtypes_of(leaf: Leaf) -> list[np.dtype]:
        """The dtypes an action leaf can be stored in, indexed by code."""
        return [*ACTION_DTYPES, leaf.dtype]

    @staticmethod
    def view(buffer: Any, field: Field | None) -> np.ndarray | None:
        """A numpy view of one field onto the mapped arena."""
        if field is None:
            return None
        count = int(np.prod(field.shape, dtype=np.int64))
        return np.frombuffer(buffer, dtype=field.dtype, count=count, offset=field.offset).reshape(field.shape)

    def views(self, buffer: Any) -> dict[str, Any]:
        return {
            "actions": [self.view(buffer, f) for f in self.actions],
            # Per action leaf: its views in every dtype, indexed by code.
            "action_views": [
                None if f is None
                else [self.view(buffer, Field(f.offset, f.shape, d)) for d in self.action_dtypes_of(leaf)]
                for f, leaf in zip(self.actions, self.action_leaves)
            ],
            "action_dtypes": self.view(buffer, self.action_dtypes),
            "observations": [self.view(buffer, f) for f in self.observations],
            "rewards": self.view(buffer, self.rewards),
            "terminations": self.view(buffer, self.terminations),
            "truncations": self.view(buffer, self.truncations),
            "info_values": self.view(buffer, self.info_values),
            "info_flags": self.view(buffer, self.info_flags),
            "info_schemas": self.view(buffer, self.info_schemas),
        }
