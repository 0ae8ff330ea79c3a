"""Batches of a space's values as they travel between the caller and the
actors: leaf by leaf (arrays for leaves of fixed shape, tuples for the
others), split into the actors' rows and joined back, always owned by the
caller."""

from __future__ import annotations

import itertools
from typing import Any

import gymnasium as gym
import numpy as np

from shmvec._engine.batch_io import action_leaves, checked_leaf_batch, checked_object_batch, list_items_flag
from shmvec._engine.layout import flattener, is_single_fixed_leaf, leaves_of, unflattener

__all__ = ["LeafBatches", "owned"]


def owned(value: Any) -> Any:
    """Ray hands numpy arrays back read-only: the caller gets writable ones."""
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    if isinstance(value, dict):
        return {k: owned(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(owned(v) for v in value)
    return value


class LeafBatches:
    """Batched values of one space, leaf by leaf: checking actions, taking
    rows, joining."""

    def __init__(self, space: gym.Space):
        self.leaves = leaves_of(space)
        self.flatten, self.unflatten = flattener(space), unflattener(space)
        # How ShmVecEnv's errors name each leaf (see shmvec._engine.batch_io).
        single = is_single_fixed_leaf(space)
        self._names = ["actions"] if single else [f"action leaf {k}" for k in range(len(self.leaves))]

    def checked_actions(self, actions: Any, count: int) -> list:
        """The leaves of a batch of `count` actions, checked as ShmVecEnv
        checks them, with the same errors."""
        out = []
        for leaf, name, value in zip(self.leaves, self._names, action_leaves(self.flatten, actions)):
            if leaf.fixed:
                checked = checked_leaf_batch(value, (count, *leaf.shape), leaf.dtype, name, leaf.any_number)
                # A list of Python scalars (or of lists of them), or of items
                # no array gives back, travels as one, so that the actor's envs
                # get them too (see ACTION_AS_PYTHON and ACTION_AS_GIVEN).
                out.append(list(value) if list_items_flag(value, checked.ndim) else checked)
            else:
                out.append(tuple(checked_object_batch(value, count, name)))
        return out

    def take(self, leaves: list, rows: slice | np.ndarray) -> Any:
        """Rows `rows` of a batch given as its leaves."""
        return self.unflatten([
            leaf[rows] if isinstance(rows, slice) or isinstance(leaf, np.ndarray) else tuple(leaf[i] for i in rows)
            for leaf in leaves
        ])

    def join(self, batches: list) -> Any:
        """One batch of the rows of `batches`, in order, owned by the caller."""
        joined = []
        for parts in zip(*map(self.flatten, batches)):
            if isinstance(parts[0], np.ndarray):
                joined.append(np.concatenate(parts))  # a copy: writable
            else:
                joined.append(tuple(owned(v) for v in itertools.chain.from_iterable(parts)))
        return self.unflatten(joined)
