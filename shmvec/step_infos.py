"""A step's infos for the Gymnasium front end, built exactly as
``SyncVectorEnv`` builds them: from the info columns (``InfoColumns``) and the
step's records, env by env, with Gymnasium's own ``VectorEnv._add_info``; an
episode that ended in the step adds its final observation and info as the
installed Gymnasium does (``_gym_compat.episode_end_infos``). The common case,
every info in columns or none at all, never gets here: ``InfoColumns.batch``
builds it with array copies (async batches too: ``InfoColumns.batch(rows)``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from shmvec import _gym_compat as compat
from shmvec._engine.batch_io import BatchIO
from shmvec._engine.info_columns import InfoColumns
from shmvec._engine.protocol import StepRecord
from shmvec._gym_compat import VectorEnv

__all__ = ["vectorize", "vectorize_batch"]


class _InfoBatch:
    """VectorEnv._add_info (and, under Gymnasium 0.29, the _init_info_arrays
    it calls) for a batch of `num_envs` rows (async results). Not a
    VectorEnv subclass: 0.29's VectorEnv has a __del__, which would run as
    every batch ends, a point where Python drops a Ctrl-C ("Exception
    ignored in")."""

    _add_info = VectorEnv._add_info
    if hasattr(VectorEnv, "_init_info_arrays"):
        _init_info_arrays = VectorEnv._init_info_arrays

    def __init__(self, num_envs: int):
        self.num_envs = num_envs


def _add_env_infos(target: VectorEnv | _InfoBatch, infos: dict[str, Any], row: int, info: dict | None,
                   ended: bool = False, final_obs: Any = None, final_info: Any = None) -> dict[str, Any]:
    """Adds one env's infos of a step to the batch's as SyncVectorEnv does,
    with the final observation and info of an episode that ended in it."""
    if ended:
        for part in compat.episode_end_infos(info, final_obs, final_info):
            infos = target._add_info(infos, part, row)
    elif info:
        infos = target._add_info(infos, info, row)
    return infos


def _add_row(target: VectorEnv | _InfoBatch, infos: dict[str, Any], io: BatchIO, position: int, row: int,
             record: StepRecord | None, columns: InfoColumns | None) -> dict[str, Any]:
    """Adds env `row`'s infos of a step, at `position` of the batch: from its
    record (storing its observation leaves without a fixed shape in `io`)
    and from `columns`, where its info is unless the record has it."""
    info = ended = final_info = final_obs = None
    if record is not None:
        info, ended, final_info = record.info, record.ended, record.final_info
        io.update_objects(row, record.objects)
        if ended:
            final_obs = io.final_obs(row, record.final_obs)
    if info is None and columns is not None and columns.flags[row]:
        info = columns.row(row)
    return _add_env_infos(target, infos, position, info, ended, final_obs, final_info)


def vectorize(target: VectorEnv, io: BatchIO, records: list[StepRecord],
              columns: InfoColumns | None = None) -> dict[str, Any]:
    """The infos of a step (or reset) of every env of `target`: its records
    (and the infos in `columns`), env by env. Also stores the records'
    observation leaves without a fixed shape in `io`."""
    infos: dict[str, Any] = {}
    by_row = {record.row: record for record in records}
    rows = sorted(by_row.keys() | set(columns.rows().tolist())) if columns is not None else list(by_row)
    for row in rows:
        infos = _add_row(target, infos, io, row, row, by_row.get(row), columns)
    return infos


def vectorize_batch(io: BatchIO, records: list[StepRecord], rows: np.ndarray,
                    columns: InfoColumns) -> dict[str, Any]:
    """Like vectorize, for a batch of async results: `rows` are the batch's
    envs in their order in it."""
    by_row = {record.row: record for record in records}
    batch = _InfoBatch(len(rows))
    infos: dict[str, Any] = {}
    for position, row in enumerate(rows.tolist()):
        record = by_row.get(row)
        if record is not None or columns.flags[row]:
            infos = _add_row(batch, infos, io, position, row, record, columns)
    return infos
