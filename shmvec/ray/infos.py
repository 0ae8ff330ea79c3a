"""Merging vectorised infos: rows of the infos an actor (or one of its
ShmVecEnv's recv() calls) returned, into the infos of a larger batch.

Gymnasium's own helper, ``VectorEnv._add_info``, adds one env's info as the
env returned it; here the infos are already vectorised. Taking each env's
info back out of them to add it again would be Python work per env on every
step, and would not give the same result: a value's type is gone once it is
in an array (a ``bool`` info comes back as ``np.bool_``, which ``_add_info``
puts in an object array, not a bool one). So this merge works on the arrays
and gives exactly what ``_add_info`` gives when it adds those envs one by
one: the keys in order, the dtypes, the ``_key`` masks, object arrays."""

from __future__ import annotations

import numpy as np

from shmvec.ray.batches import owned

__all__ = ["merge_infos"]


def merge_infos(into: dict, part: dict, source: np.ndarray, target: np.ndarray, num: int) -> dict:
    """Adds rows `source` of vectorised infos `part` to `into` (of `num` envs)
    at rows `target`."""
    masks = {f"_{key}" for key in part}
    for key, value in part.items():
        if key in masks:
            continue
        present = part[f"_{key}"][source]
        if not present.any():
            continue
        src, dst = source[present], target[present]
        if isinstance(value, dict):
            array = merge_infos(into.get(key, {}), value, src, dst, num)
        else:
            array = into.get(key)
            if array is None:
                # _add_info fills object arrays of unknown objects with None, others with 0
                if value.dtype == object and value.ndim == 1:
                    array = np.full(num, None, dtype=object)
                else:
                    array = np.zeros((num, *value.shape[1:]), dtype=value.dtype)
            if array.dtype == object:
                for s, d in zip(src, dst):
                    array[d] = owned(value[s])
            else:
                array[dst] = value[src]
        mask = into.get(f"_{key}")
        if mask is None:
            mask = np.zeros(num, dtype=np.bool_)
        mask[dst] = True
        into[key], into[f"_{key}"] = array, mask
    return into
