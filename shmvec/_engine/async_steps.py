"""Async mode (``batch_size < num_envs``), EnvPool-style: envs are sent to
their workers one by one and come back in the order they finish, through
per-worker rings in the arena; a slow env does not stall the others.

The caller's own slice, when it has one, has rings too: ``recv()`` steps its
envs one by one while too few have finished, where it would otherwise wait,
and they come back in the same order as the workers' (on 2 CPUs the caller's
CPU was idle while it waited for its one worker; see plan.plan_slices).
Without workers (``num_workers=0``, or one CPU idle, which the caller
takes: see plan.default_num_workers) the caller's slice is every env, and
recv() steps them all.

With restarts, a worker found dead (checked every CHECK_EVERY_S) or hung
(envs in flight and none finished for `timeout`) is replaced while the
other envs keep flowing; the front end sends again the envs it had in
flight.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from shmvec import _core
from shmvec._engine import protocol as P
from shmvec._engine import warning_relay
from shmvec._engine.cycle import ENV_RAISED, INTERRUPTED
from shmvec._engine.protocol import StepRecord
from shmvec._engine.transport import raise_remote
from shmvec._engine.warning_relay import Warned

if TYPE_CHECKING:
    from shmvec._engine.engine import Engine
    from shmvec._engine.env_slice import EnvSlice
    from shmvec._engine.torch_threads import TorchThreads

__all__ = ["AsyncSteps", "RECORD_CAPACITY", "RecordsLost"]

RECORD_CAPACITY = 8 * 1024  # per env, for async records (infos); larger ones are fetched


class RecordsLost(Exception):
    """A worker died keeping the record of an env that finished (one too
    large for its slot), before recv() fetched it. The worker was replaced:
    the engine's `to_send_again` are its envs."""


class AsyncSteps:
    """send/recv over an engine's workers, and the caller's own slice
    (`own`) if it has one."""

    CHECK_EVERY_S = 0.02
    POLL_S = 0.001  # without workers, wait_finished()'s look at what another thread's send() queued

    def __init__(self, engine: Engine, data: _core.Mapping, offset: int, own: EnvSlice | None,
                 torch_threads: TorchThreads):
        self._engine = engine
        # Its judge (set while torch's threads are held for the workers) times
        # the caller's time away from a send() to the next recv() and from a
        # recv() to the next send(): an update in either may get torch's
        # threads back (see torch_threads.GapJudge).
        self._torch_threads = torch_threads
        self._away = False  # the caller's time away under way (torch's idle helpers are ended as it ends)
        self._pool = engine.pool
        self._channel = engine.pool.channel
        self._info = engine.info_columns
        self._own = own
        self._own_overflow: dict[int, bytes] = {}  # the own slice's records too large for their slots
        # Each env's stepper: its worker, or num_workers for the caller's own slice.
        self._owner = [0] * engine.num_envs
        for w, rows in enumerate(engine.worker_rows):
            self._owner[rows.start:rows.stop] = [w] * len(rows)
        if own is not None:
            self._owner[own.rows.start:own.rows.stop] = [engine.num_workers] * len(own.rows)
        self._channel.attach_async(data, offset, engine.num_envs, RECORD_CAPACITY, self._owner,
                                   engine.num_workers + (own is not None))
        # Restarts: when each worker last finished an env (or had none in flight).
        self._progress = [(0, time.monotonic())] * engine.num_workers
        self._next_check = 0.0

    def send(self, rows: np.ndarray) -> None:
        """Queues envs (whose actions are in the arena) to their workers;
        `rows` is an int64 array, read natively with no Python int per env."""
        self._engine.cycle.check_usable()
        self._engine.check_owner()
        if self._pool.restart:
            self._progress_hung(time.monotonic())  # a worker given work now starts its clock now
        self._channel.send(rows)

    def send_actions(self, ids: np.ndarray, in_flight: np.ndarray, views: list, values: list) -> int:
        """send()'s step in one native call: checks the env ids against
        `in_flight` (returns ``_core.env_ids_problem``'s problem, having done
        nothing, if there is one), writes `values` (per action leaf, a row
        per env) into `views`, queues the envs to their workers and marks them
        in `in_flight`. A Ctrl-C lands before it or after it."""
        self._engine.cycle.check_usable()
        self._engine.check_owner()
        if self._pool.restart:
            self._progress_hung(time.monotonic())  # a worker given work now starts its clock now
        self._caller_returns()
        problem = self._channel.send_actions(ids, in_flight, views, values)
        if not problem:
            self.caller_leaves()
        return problem

    def recv(self, count: int, into: _core.RowQueue, discard: bool = False) -> None:
        """Waits for `count` envs to finish and appends their rows to `into`
        in finishing order, in one native call: a Ctrl-C cannot land between
        taking them and keeping them. (`discard`, their results to be
        dropped, changes nothing: the workers step what they were sent.)
        With restarts, a worker found dead or hung (now, or every
        CHECK_EVERY_S while other envs keep coming) is replaced instead:
        then no row is appended and the engine's `to_send_again` says which
        envs are new (the front end sends again those it had in flight)."""
        engine, pool = self._engine, self._pool
        engine.cycle.check_usable()
        engine.check_owner()
        self._caller_returns()
        engine.restarted_rows = []
        if pool.restart and time.monotonic() >= self._next_check and self._restart():
            return
        self._step_own(count)
        code = self._channel.recv(count, pool.sentinels, pool.timeout, into)
        if code != 0 and pool.restart and self._restart():
            return
        if code != 0:
            pool.check_wait(code, self._workers_in_flight())

    def take_batch(self, count: int, finished: _core.RowQueue, in_flight: np.ndarray, sources: list,
                   front: Any) -> tuple | None:
        """recv()'s usual batch in one native call, without restarts (see
        ``FrontChannel.take_batch``): the batch, handed out, infos from the
        info columns included, or None when one of its envs has a record
        (they wait in `finished` for recv()). Only with nothing in `finished`."""
        self._engine.check_owner()
        self._caller_returns()
        self._step_own(count)
        pool, info = self._pool, self._info
        taken = self._channel.take_batch(count, pool.sentinels, pool.timeout, finished, in_flight, sources,
                                         info.flags, info.columns, front)
        if type(taken) is int:
            pool.check_wait(taken, self._workers_in_flight())  # raises
        return taken

    def _caller_returns(self) -> None:
        """The caller's time away since its last send() (or recv()) ends (a
        recv() may call this twice: the second finds no time away under way)."""
        if self._away:
            self._away = False
            self._torch_threads.end_idle_helpers()
        judge = self._torch_threads.judge
        if judge is not None:
            judge.command_begins(True)

    def caller_leaves(self) -> None:
        """A send() or recv() returns: the caller's time away starts."""
        self._away = True
        judge = self._torch_threads.judge
        if judge is not None:
            judge.step_returns()

    def land_own(self) -> None:
        """Steps every env of the caller's own that is in flight; their
        results wait for recv(). A call to the envs then finds each after
        the step it was sent, as a worker's envs are (a worker runs a call
        after the steps sent before it)."""
        self._step_own(self._engine.num_envs)

    def _step_own(self, count: int) -> None:
        """Steps the caller's own queued envs while fewer than `count` envs
        have finished, and at least one, so that none of them waits for good
        behind workers that keep ahead (see FrontChannel.step_own). A Ctrl-C
        during the steps is held until they are done; a second one stops
        them inside an env's step, which leaves the batch half done."""
        if self._own is not None and self._channel.own_pending:
            _core.run_holding_interrupt(self._step_own_held, count)

    def _step_own_held(self, count: int) -> None:
        own = self._own
        if not own.enter():  # close() came first (from another thread, or a signal handler)
            raise self._engine.cycle.closed_error()
        try:
            self._channel.step_own(own.stepper, count, True, P.dumps, P.encode_error, self._own_overflow)
        except KeyboardInterrupt:
            self._engine.cycle.half_done(INTERRUPTED)
            raise
        finally:
            own.leave()

    def _restart(self) -> bool:
        """Replaces workers that died, or that have had envs in flight and
        finished none for `timeout` seconds; whether it did."""
        self._replaced = False
        _core.run_holding_interrupt(self._find_and_replace_failed)
        return self._replaced

    def _find_and_replace_failed(self) -> None:
        """_restart(), with Ctrl-C held: one in the middle would leave a
        worker half replaced, or a dead one listed twice."""
        pool = self._pool
        now = time.monotonic()
        self._next_check = now + self.CHECK_EVERY_S
        listed = {w for w, _ in pool.failed}  # given up on by a wait that a Ctrl-C cut short
        dead = self._channel.first_dead(pool.sentinels) - 1
        if dead >= 0 and dead not in listed:
            pool.failed.append((dead, pool.exit_cause(dead)))
        pool.failed += [(w, f"hung for more than timeout={pool.timeout} s")
                        for w in self._progress_hung(now) if w != dead and w not in listed]
        self._replace_failed(now)

    def _replace_failed(self, now: float) -> None:
        """Replaces the pool's failed workers, if any (with Ctrl-C held)."""
        pool = self._pool
        for w, _ in pool.failed:
            pool.kill(w)
            self._progress[w] = (0, now)  # its rings start again from 0
        if pool.failed:
            self._engine.restart_failed()
            self._replaced = True

    def _workers_in_flight(self) -> list[int]:
        """Workers with envs sent and not yet finished (those a timeout names)."""
        progress = self._channel.async_progress()[:self._engine.num_workers]
        return [w for w, (_, left) in enumerate(progress) if left]

    def _progress_hung(self, now: float) -> list[int]:
        """Notes when each worker last finished an env (or had none in
        flight); returns those with envs in flight and none finished for
        `timeout` seconds."""
        hung, timeout = [], self._pool.timeout
        for w, (done, left) in enumerate(self._channel.async_progress()[:self._engine.num_workers]):
            if done != self._progress[w][0] or not left:
                self._progress[w] = (done, now)
            elif timeout >= 0 and now - self._progress[w][1] >= timeout:
                hung.append(w)
        return hung

    def wait_finished(self, count: int, timeout: float) -> bool:
        """Waits up to `timeout` seconds for `count` envs to finish, popping
        nothing; True when they did or a worker died (recv() then handles
        it), or when the caller's own slice has the rest queued (recv() steps
        them). Only reads shared memory: another thread may send() meanwhile."""
        self._engine.cycle.check_usable()
        channel = self._channel
        if not self._engine.num_workers:  # nobody steps envs until recv(): wait for them to be sent
            deadline = time.monotonic() + timeout
            while channel.finished_ready + channel.own_pending < count and time.monotonic() < deadline:
                time.sleep(self.POLL_S)
            return channel.finished_ready + channel.own_pending >= count
        if self._own is not None:
            count -= min(count, channel.own_pending)
        return channel.wait_finished(count, self._pool.sentinels, timeout) != -1

    def records(self, rows: np.ndarray) -> list[StepRecord]:
        """The records of the envs of `rows` (an int64 array) that have one,
        in that order (see record())."""
        return [record for record in map(self.record, self._channel.rows_with_records(rows)) if record is not None]

    def _fetch_record(self, row: int) -> bytes:
        """A record too large for its slot, from the worker that keeps it
        (until the env's next step). The worker answers between two steps."""
        owner = int(self._owner[row])
        if self._channel.busy:  # a fetch that a Ctrl-C cut short: its answer is not needed
            self._wait_fetched()
        self._engine.transport.post(P.FETCH_RECORD, [P.dumps(row)], [owner])
        self._wait_fetched()
        return P.loads(self._engine.transport.replies([owner])[0])

    def _wait_fetched(self) -> None:
        """Waits for a worker's answer to a fetch. With restarts, a worker
        that died meanwhile took the records it kept along: it is replaced,
        and RecordsLost says so."""
        pool = self._pool
        if not pool.restart:
            pool.wait()
            return
        pool.wait(restart=True)  # a dead or hung worker is given up on, into pool.failed
        if pool.failed:
            _core.run_holding_interrupt(self._replace_failed, time.monotonic())
            raise RecordsLost

    def record(self, row: int) -> StepRecord | None:
        """The record of an env's last async step (None if it has none);
        raises the env's exception if the step failed (its batch is then
        half done: the cycle needs a reset)."""
        length, is_error, overflow = self._channel.record(row)
        if not length:
            return None
        if overflow:  # kept by its stepper until the env's next step
            data = self._own_overflow[row] if self._owner[row] == self._engine.num_workers \
                else self._fetch_record(row)
        else:
            data = self._channel.record_bytes(row)
        record = P.loads(data)
        if is_error:
            self._engine.cycle.half_done(ENV_RAISED)
            raise_remote(record)
        if type(record) is Warned:  # the env warned in its step: as if it had warned here
            try:
                warning_relay.show(record.warnings)
            except BaseException:  # the caller's filters made one an error: the env's
                self._engine.cycle.half_done(ENV_RAISED)
                raise
            record = record.record
            if record is None:  # warnings only
                return None
        return StepRecord._make(record)
