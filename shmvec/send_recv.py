"""ShmVecEnv's async mode (``batch_size < num_envs``), EnvPool-style:
``async_reset()``, then ``recv()`` returns the first ``batch_size`` envs to
finish and ``send(actions, env_ids)`` steps them again; a slow env does not
stall the others. The engine's side is ``shmvec._engine.async_steps``."""

from __future__ import annotations

from typing import Any

import numpy as np

from shmvec import _core
from shmvec._engine.async_steps import RecordsLost
from shmvec._engine.cycle import CLOSED, IDLE, NEEDS_RESET, WAITING_RESET
from shmvec.contract import check_async, check_async_reset_options, env_ids_array, raise_env_ids_problem, seeds_for
from shmvec.step_infos import vectorize_batch

__all__ = ["SendRecv"]


class SendRecv:
    """async_reset/send/recv of ``ShmVecEnv`` (its base), over its engine,
    cycle and BatchIO."""

    def _init_send_recv(self) -> None:
        # Envs sent and not yet received by the user; those of them that
        # finished (recv() took them from the engine but has not returned
        # them yet: a Ctrl-C cut it short); envs reset by async_reset()
        # waiting to be received, with their reset records.
        self._in_flight = np.zeros(self.num_envs, dtype=np.bool_)
        self._finished = _core.RowQueue()
        self._reset_ready: list[int] = []
        self._reset_records: dict[int, tuple] = {}
        self._handed_out: tuple | None = None  # a batch recv() made and a Ctrl-C kept from the user

    def async_reset(self, *, seed: int | list[int | None] | None = None,
                    options: dict[str, Any] | None = None) -> None:
        """Resets every env and returns at once; ``recv()`` then returns the
        reset observations ``batch_size`` envs at a time (rewards 0, flags False)."""
        self._cycle.check_usable()
        check_async(self, "async_reset")
        seeds = seeds_for(seed, self.num_envs)
        check_async_reset_options(options)
        self._finish_interrupted_reset()
        steps = self._engine.async_steps
        # Let every env in flight land, then drop its results. Landed envs
        # are kept in _finished until marked, so that a Ctrl-C anywhere here
        # leaves none in flight that no worker will return.
        while True:
            self._in_flight[self._finished.head(len(self._finished))] = False
            self._finished.clear()
            self._in_flight[self._engine.to_send_again] = False  # a restart lost its own: none will land
            self._engine.to_send_again = []
            if not self._in_flight.any():
                break
            steps.recv(int(self._in_flight.sum()), self._finished, discard=True)
        self._reset_ready.clear()  # an earlier reset's results: not to be handed out if this one is cut short
        self._reset_records.clear()
        self._handed_out = None
        self._reset_received(self._engine.reset(seeds, options, None))

    def _has_results_at_hand(self) -> bool:
        """Whether recv() holds envs it can hand out without waiting (reset
        results, envs an interrupted recv() had gathered, or the batch it was
        handing out)."""
        return bool(self._reset_ready or len(self._finished)) or self._handed_out is not None

    def _finish_interrupted_reset(self) -> None:
        """A Ctrl-C cut async_reset() short while the workers reset: its
        results are collected as if it had returned."""
        if self._cycle.phase is WAITING_RESET:
            self._reset_received(self._engine.finish())

    def _reset_received(self, records: list) -> None:
        """Every env was reset: recv() hands out their results."""
        self._cycle.reset_done()
        self._engine.to_send_again = []  # a worker replaced during the reset: none of its envs is in flight
        self._io.rewards[:] = 0.0
        self._io.terminations[:] = False
        self._io.truncations[:] = False
        self._reset_records = {record.row: record for record in records}
        self._reset_ready = list(range(self.num_envs))

    def send(self, actions: Any, env_ids: Any) -> None:
        """Hands envs `env_ids` their next actions and returns at once."""
        if self._cycle.phase is not IDLE:  # an interrupted async_reset() to finish, or a refusal
            self._finish_interrupted_reset()
            self._cycle.check_steppable("send")
        check_async(self, "send")
        ids = env_ids_array(env_ids, self._reset_ready, self._handed_out)
        values = self._io.action_rows(actions, len(ids))
        # Checked, written, sent and marked in flight in one call (native
        # with workers): a Ctrl-C cannot send an env without marking it.
        problem = self._engine.async_steps.send_actions(ids, self._in_flight, self._io.action_views, values)
        raise_env_ids_problem(problem, ids, self.num_envs, self._in_flight)

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Waits for ``batch_size`` envs to finish and returns their
        (observations, rewards, terminations, truncations, infos), in the
        order they finished; ``infos["env_id"]`` says which envs they are."""
        try:
            batch = self._next_batch()  # and kept in _handed_out: a Ctrl-C from here leaves it to the next recv()
        except Exception:
            self._raise_if_closed_meanwhile()
            raise
        self._raise_if_closed_meanwhile()
        self._engine.async_steps.caller_leaves()
        self._handed_out = None
        return batch

    def _raise_if_closed_meanwhile(self) -> None:
        """close() ran during recv() (from another thread, or a signal
        handler), tearing down what it read: the closed error, as in
        lock-step, not whatever the teardown made of the batch."""
        if self._cycle.phase is CLOSED:
            raise self._cycle.closed_error() from None

    def _next_batch(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """recv()'s batch, left in _handed_out for recv() to clear."""
        if self._cycle.phase is not IDLE:  # an interrupted async_reset() to finish, or a refusal
            self._finish_interrupted_reset()
            self._cycle.check_usable()
        check_async(self, "recv")
        if self._handed_out is not None:  # a Ctrl-C came as the last recv() returned it
            return self._handed_out
        if self._cycle.phase is NEEDS_RESET:  # an env raised (its error was raised once), or a step was cut short
            raise RuntimeError(self._cycle.why)
        available = len(self._reset_ready) + int(np.count_nonzero(self._in_flight))
        if available < self.batch_size:
            raise RuntimeError(
                f"recv() needs {self.batch_size} envs in flight, but only {available} are: "
                "send() more first (or async_reset())"
            )
        # Nothing is taken from the lists below before the batch is built: a
        # Ctrl-C anywhere before recv() returns leaves every env to the next.
        resets = min(len(self._reset_ready), self.batch_size)
        stepped = self.batch_size - resets
        steps = self._engine.async_steps
        sources = self._io.batch_sources
        if sources is not None and not resets and not len(self._finished) and not self._restarts:
            # The usual batch (workers step the envs, their infos are in
            # columns or empty): taken and handed out in one native call.
            # Not with restarts, whose batches io.remember() below.
            batch = steps.take_batch(stepped, self._finished, self._in_flight, sources, self)
            if batch is not None:
                return batch
        while True:
            if self._engine.to_send_again:  # a worker was replaced (now, or before a Ctrl-C)
                _core.run_holding_interrupt(self._send_again)
            if len(self._finished) < stepped:
                steps.recv(stepped - len(self._finished), self._finished)
                continue
            ids = self._finished.head(stepped)
            try:
                records = steps.records(ids) if stepped else []
                break
            except RecordsLost:  # their worker died keeping a record of theirs: replaced, its envs go again
                continue
        if resets:
            reset_rows = self._reset_ready[:resets]
            ids = np.concatenate((np.array(reset_rows, dtype=np.int64), ids))
            records = [self._reset_records[r] for r in reset_rows if r in self._reset_records] + records
        columns = self._engine.info_columns
        infos = columns.batch(ids) if not records else None
        if infos is None:  # first: it stores observation leaves without a fixed shape
            infos = vectorize_batch(self._io, records, ids, columns)
        if "env_id" in infos:  # raised before the hand-out: the batch stays for the next recv()
            raise ValueError(
                "an env's infos have the key 'env_id', which recv() sets to the ids of the batch's envs in "
                "async mode (as EnvPool does): rename that key in the env (or a wrapper), or step in "
                "lock-step (batch_size=None), which hands it through as SyncVectorEnv does")
        infos["env_id"] = ids
        io = self._io
        result = (io.observations_at(ids), io.rewards.take(ids), io.terminations.take(ids),
                  io.truncations.take(ids), infos)
        if self._restarts:
            io.remember(ids)
        # The batch's envs become the user's again in one call that a Ctrl-C
        # cannot cut (one meanwhile leaves the batch to the next recv()).
        if resets:
            _core.run_holding_interrupt(self._hand_out_resets, resets, stepped, result)
        else:
            _core.hand_out(self._finished, stepped, self._in_flight, self, result)
        return result

    def _hand_out_resets(self, resets: int, stepped: int, result: tuple) -> None:
        """_core.hand_out, for a batch that includes reset results."""
        for row in self._reset_ready[:resets]:
            self._reset_records.pop(row, None)
        del self._reset_ready[:resets]
        _core.hand_out(self._finished, stepped, self._in_flight, self, result)

    def _send_lost(self) -> None:
        """In async mode, after a command during which workers were replaced."""
        if self._async_mode and self._engine.to_send_again:
            _core.run_holding_interrupt(self._send_again)

    def _send_again(self) -> None:
        """Fresh workers replaced failed ones (the engine's `to_send_again`,
        cleared here): their envs not yet handed out go again, to come back
        with their restart reports (which ignore the action), those that
        had finished too (their results may be part in the dead worker: a
        record it kept, infos under its schema); the others report at their
        next send(). Run with Ctrl-C held: sent and cleared together."""
        restarted = self._engine.to_send_again
        rows = self._finished.head(len(self._finished))
        gone = np.isin(rows, restarted)
        if gone.any():
            self._finished.clear()
            self._finished.extend(rows[~gone])
        lost = [row for row in restarted if self._in_flight[row]]
        self._io.restore(lost)  # the failed worker may have written some of their rows
        self._engine.async_steps.send(np.array(lost, dtype=np.int64))
        self._engine.to_send_again = []
