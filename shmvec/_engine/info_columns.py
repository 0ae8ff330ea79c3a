"""Step infos as columns in shared memory, vectorized without per-env Python.

Most envs return the same small dict of numbers at every step (MuJoCo's
``x_position``..., Atari's ``lives``...). Vectorizing it the way
``VectorEnv._add_info`` does, env by env and key by key in the caller, costs
more than the step of a cheap env. Instead each slice's native stepper adopts
the first such info as its *schema* (keys in order, one value type per key)
and writes every matching info into its row's 8-byte cells, setting the row's
flag; anything else (nested dicts, arrays, strings, other keys) still travels
by pickle in a record. When every info of a step is in columns of one schema,
one native call reads the batch's infos (``_core.info_batch``), exactly what
``_add_info`` builds:
same keys in the same order, one ``_key`` mask per key, the dtype of the
value's type, zeros where an env had no info.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from shmvec import _core

__all__ = ["INFO_STORAGE", "InfoColumns"]

# Value types an info column takes, and how its cells store them: 0 as a
# double (exact for these floats), 1 as an int64. np.bool_ is missing on
# purpose: _add_info puts it in an object array.
INFO_STORAGE = {
    float: 0, np.float64: 0, np.float32: 0, np.float16: 0,
    int: 1, bool: 1, np.int64: 1, np.int32: 1, np.int16: 1, np.int8: 1,
    np.uint32: 1, np.uint16: 1, np.uint8: 1,
}

Schema = list  # [(key, value type), ...]


class InfoColumns:
    """Reads the info columns of a step.

    `slices` are the env rows of each slice; `schema_slots[k]` is where
    slice k's stepper publishes its schema (a uint32 length, then the
    pickled schema), read only once a row of it is flagged, and once, since
    a schema never changes after it is adopted."""

    def __init__(self, values: np.ndarray, flags: np.ndarray, slices: Sequence[range], schema_slots: np.ndarray):
        self.num_envs = len(flags)
        self._ints = values
        self._floats = values.view(np.float64)
        self.flags = flags
        self._slices = list(slices)
        self._schema_slots = schema_slots
        self._schemas: list[Schema | None] = [None] * len(self._slices)
        self._of_row = np.empty(self.num_envs, dtype=np.int64)  # slice index of each row
        for k, rows in enumerate(self._slices):
            self._of_row[rows.start:rows.stop] = k
        # Once every slice has a schema and they are all one: per column,
        # (key, mask key, cells, dtype), so that a batch is array copies only
        # (``_core.info_batch``, which async recv()'s take_batch calls too).
        self.columns: list[tuple] | None = None

    def _schema(self, k: int) -> Schema:
        if self._schemas[k] is None:
            slot = self._schema_slots[k]
            length = int(slot[:4].view(np.uint32)[0])
            if not length:
                raise RuntimeError(f"shmvec: slice {k} wrote info columns without a schema")
            self._schemas[k] = pickle.loads(slot[4:4 + length].tobytes())
            if None not in self._schemas and all(s == self._schemas[0] for s in self._schemas):
                self.columns = self._columns_of(self._schemas[0])
        return self._schemas[k]

    def forget(self, k: int) -> None:
        """Slice k has a new stepper (its worker was restarted), which adopts
        a schema of its own."""
        self._schemas[k] = None
        self.columns = None

    def _columns_of(self, schema: Schema) -> list[tuple]:
        return [(key, f"_{key}", (self._ints if INFO_STORAGE[kind] else self._floats)[:, column], np.dtype(kind))
                for column, (key, kind) in enumerate(schema)]

    def rows(self) -> np.ndarray:
        """The rows whose info of the last step is in columns."""
        return np.flatnonzero(self.flags)

    def batch(self, rows: np.ndarray | None = None) -> dict[str, Any] | None:
        """The vectorized infos of the last step (of the envs of `rows`, in
        that order: an async batch), if every one of their infos is in
        columns (or absent) and all share one schema; else None."""
        flags = self.flags if rows is None else self.flags[rows]
        columns = self.columns
        if columns is None:  # until every slice has shown its schema
            if not flags[flags.argmax()]:  # most envs return no infos at all (argmax: no Python-level numpy call)
                return {}
            flagged = np.flatnonzero(flags) if rows is None else rows[flags != 0]
            used = np.unique(self._of_row[flagged]).tolist()  # the slices whose schemas they use
            schema = self._schema(used[0])
            if any(self._schema(k) != schema for k in used[1:]):
                return None
            columns = self._columns_of(schema)
        # Per column, its values cast to the dtype (0 where absent) and a mask
        # of its own; {} when no env had an info. One native call: numpy calls
        # per key cost more than a cheap env's step.
        return _core.info_batch(self.flags, columns, rows)

    def row(self, row: int) -> dict[str, Any]:
        """One row's info, as the env returned it (same value types)."""
        schema = self._schema(int(self._of_row[row]))
        out = {}
        for column, (key, kind) in enumerate(schema):
            if INFO_STORAGE[kind]:
                out[key] = kind(int(self._ints[row, column]))
            else:
                out[key] = kind(float(self._floats[row, column]))
        return out

    def clear(self, rows: Sequence[int]) -> None:
        """Marks rows as having no info in columns (e.g. restarted envs)."""
        self.flags[list(rows)] = 0
