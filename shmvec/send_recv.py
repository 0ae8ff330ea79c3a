"""ShmVecEnv's async mode (``batch_size < num_envs``), EnvPool-style:
``async_reset()``, then ``recv()`` returns the first ``batch_size`` envs to
finish and ``send(actions, env_ids)`` steps them again; a slow env does not
stall the others. The engine's side is ``shmvec._engine.async_steps``."""

from __future__ import annotations

from typing import Any

import numpy as np

from shmvec.contract import check_async, checked_env_ids, seeds_for
from shmvec.step_infos import vectorize_batch

__all__ = ["SendRecv"]


class SendRecv:
    """async_reset/send/recv of ``ShmVecEnv`` (its base), over its engine,
    cycle and BatchIO."""

    def _init_send_recv(self) -> None:
        # Envs sent and not yet received; envs reset by async_reset() waiting
        # to be received, with their reset records.
        self._in_flight = np.zeros(self.num_envs, dtype=np.bool_)
        self._reset_ready: list[int] = []
        self._reset_records: dict[int, tuple] = {}

    def async_reset(self, *, seed: int | list[int | None] | None = None,
                    options: dict[str, Any] | None = None) -> None:
        """Resets every env and returns at once; ``recv()`` then returns the
        reset observations ``batch_size`` envs at a time (rewards 0, flags False)."""
        self._cycle.check_usable()
        check_async(self, "async_reset")
        seeds = seeds_for(seed, self.num_envs)
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict or None, got {type(options).__name__}")
        steps = self._engine.async_steps
        while self._in_flight.any():  # let them land, then drop their results
            finished = steps.recv(int(self._in_flight.sum()), discard=True)
            self._in_flight[finished or self._engine.restarted_rows] = False  # a restart lost its own
        records = self._engine.reset(seeds, options, None)
        self._cycle.reset_done()
        self._io.rewards[:] = 0.0
        self._io.terminations[:] = False
        self._io.truncations[:] = False
        self._reset_records = {record.row: record for record in records}
        self._reset_ready = list(range(self.num_envs))

    def send(self, actions: Any, env_ids: Any) -> None:
        """Hands envs `env_ids` their next actions and returns at once."""
        self._cycle.check_steppable("send")
        check_async(self, "send")
        ids = checked_env_ids(env_ids, self.num_envs, self._in_flight, self._reset_ready)
        self._io.write_actions(actions, ids)
        self._engine.async_steps.send(ids.tolist())
        self._in_flight[ids] = True

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Waits for ``batch_size`` envs to finish and returns their
        (observations, rewards, terminations, truncations, infos), in the
        order they finished; ``infos["env_id"]`` says which envs they are."""
        self._cycle.check_usable()
        check_async(self, "recv")
        available = len(self._reset_ready) + int(np.count_nonzero(self._in_flight))
        if available < self.batch_size:
            raise RuntimeError(
                f"recv() needs {self.batch_size} envs in flight, but only {available} are: "
                "send() more first (or async_reset())"
            )
        rows = self._reset_ready[: self.batch_size]
        del self._reset_ready[: self.batch_size]
        records = [self._reset_records.pop(r) for r in rows if r in self._reset_records]
        steps = self._engine.async_steps
        done = None
        while len(rows) < self.batch_size:
            finished = steps.recv(self.batch_size - len(rows))
            if self._engine.restarted_rows:
                self._send_again(self._engine.restarted_rows)
                continue
            done = np.array(finished, dtype=np.int64)  # an array indexes faster than a list
            self._in_flight[done] = False
            rows += finished
            records += steps.records(finished)
        # The last envs to finish are usually the whole batch: their array serves.
        ids = done if done is not None and len(done) == len(rows) else np.asarray(rows, dtype=np.int64)
        infos = vectorize_batch(self._io, records, rows)  # first: it stores observation leaves without a fixed shape
        infos["env_id"] = ids
        io = self._io
        result = (io.observations_at(ids), io.rewards.take(ids), io.terminations.take(ids),
                  io.truncations.take(ids), infos)
        if self._restarts:
            io.remember(ids)
        return result

    def _send_lost(self) -> None:
        """In async mode, after a command during which workers were replaced."""
        if self._async_mode and self._engine.restarted_rows:
            self._send_again(self._engine.restarted_rows)

    def _send_again(self, restarted: list[int]) -> None:
        """Fresh workers replaced failed ones: the envs they had in flight
        go again, to come back with their restart reports (which ignore the
        action); the others report at their next send()."""
        rows = np.asarray(restarted)
        lost = rows[self._in_flight[rows]].tolist()
        self._io.restore(lost)  # the failed worker may have written some of their rows
        self._engine.async_steps.send(lost)
