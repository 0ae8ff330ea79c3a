"""Running commands: the caller's side of one command (begin, then finish)
and the operations the front ends use (begin_step, reset, call, set_attr).

``begin()`` moves the cycle to the command's WAITING phase and posts the
workers' part (they start at once); ``finish()`` steps the caller's own
slice, waits for the workers, reads their replies (replacing failed workers
and making good their part of a step or reset) and moves the cycle on. A
timeout or Ctrl-C in the wait leaves the command in flight: ``finish()`` may
be called again and no result is lost. A Ctrl-C while the caller steps its
own slice waits for the slice to end, then does the same.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from shmvec import _core
from shmvec._engine import protocol as P
from shmvec._engine.caller_state import FilterSync, pickled_filters
from shmvec._engine.cycle import (BROKEN, CLOSED, ENV_RAISED, IDLE, INTERRUPTED, NEEDS_RESET, WAITING_CALL,
                                  WAITING_RESET, WAITING_STEP)
from shmvec._engine.env_slice import EnvSlice
from shmvec._engine.pool import still_pending
from shmvec._engine.protocol import StepRecord
from shmvec.errors import ShmVecError, ShmVecTimeoutError

__all__ = ["CommandRunner"]

# This process's id, kept up to date in fork children: in_owner() is asked on
# every async send and recv, where os.getpid() would cost a system call.
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)

# The phase of the cycle while each kind of command is in flight.
_PHASE_OF = {P.STEP: WAITING_STEP, P.RESET: WAITING_RESET, P.CALL: WAITING_CALL,
             P.SET_ATTR: WAITING_CALL}


class _Command:
    """A command begun and not yet finished; the caller's slice result, and
    then the command's result, are kept so that an interrupted finish() can
    be resumed. (A plain class with slots: one is made per step.)"""

    __slots__ = ("code", "caller_fn", "plain_step", "collect", "caller_done", "caller_result", "caller_error",
                 "collected", "built", "result")

    def __init__(self, code: int, caller_fn: Callable[[EnvSlice], Any], plain_step: bool,
                 collect: Callable[[Any, list[bytes]], Any] | None):
        self.code = code
        self.caller_fn = caller_fn
        self.plain_step = plain_step
        self.collect = collect  # (caller's result, replies) -> the result
        self.caller_done = False
        self.caller_result: Any = None
        self.caller_error: BaseException | None = None
        self.collected = False  # `result` holds collect()'s result
        self.built = False  # `result` is final (finish()'s `build` made it, if it had one)
        self.result: Any = None


class CommandRunner:
    """The commands of ``Engine`` (its base class), over its cycle, pool,
    transport, channel and caller slice."""

    filter_sync: FilterSync  # the caller's warning filters, as its workers last took them

    def _wait_out_unread(self) -> None:
        """Waits out a command whose results nobody will read (the workers'
        part of a batch whose caller slice was interrupted, an async record
        fetch that a Ctrl-C cut short): its replies are dropped. With
        restarts, a worker that died meanwhile is given up on, to be
        replaced as the next command collects its replies."""
        self.pool.wait(restart=True)

    @property
    def in_owner(self) -> bool:
        """Whether this is the process that made the engine, whose workers
        serve it only (not a fork child of it)."""
        return _pid == self.owner_pid

    def check_owner(self) -> None:
        """Raises in a fork child: the workers serve the process that made
        the engine (a child's command would reach them beside the parent's)."""
        if not self.in_owner:
            raise ShmVecError(f"this vector env was made in process {self.owner_pid}; its workers serve that "
                              "process only, so a fork child cannot use it: make a new one in the child")

    def begin(self, code: int, caller_fn: Callable[[EnvSlice], Any], requests: list[bytes] | None = None,
              collect: Callable[[Any, list[bytes]], Any] | None = None) -> None:
        """Starts one command: the workers' part is posted (they start at
        once); the caller's own slice runs in finish(), so that begin()
        returns at once, as AsyncVectorEnv's *_async calls do.

        Ctrl-C can land anywhere here: once the workers got the command
        (their channel's posted id moved on, and not for a chunk of its
        request), it stays in flight, for finish() to collect; before, the
        call never began."""
        self.check_owner()
        # Warning filters the caller set since the workers last took theirs go with the command.
        filters = self.filter_sync.changed() if self.num_workers else None
        plain_step = code == P.STEP and requests is None and filters is None
        command = _Command(code, caller_fn, plain_step, collect)
        posted = self._channel.posted_id if self.num_workers else 0
        phase = _PHASE_OF[code]
        cycle = self.cycle
        if cycle.phase is not IDLE and cycle.phase is not NEEDS_RESET:
            cycle.check_idle(f"{phase.value}_async")  # raises, changing nothing: another call is pending
        self._torch_threads.end_idle_helpers()  # (before the judge may lower torch's count again)
        judge = self._torch_threads.judge  # set while torch's threads wait on how long the policy takes
        if judge is not None:
            judge.command_begins(code == P.STEP)
        self.handed_out = None  # a result Ctrl-C kept from the caller is not wanted any more
        try:
            # In here: Python may raise a Ctrl-C as begin() returns (before
            # 3.11, or under a profiler), which must not leave the cycle
            # waiting for a command that never began.
            cycle.begin(phase)
            self._command = command
            if self.num_workers and self._channel.busy:
                self._wait_out_unread()
            if self.restarted_rows:
                self.restarted_rows = []
            if self._placement is not None:  # lock-step: workers on the caller's CPU while every CPU is busy
                self._placement.before_command()
            if self.num_workers:
                if plain_step:
                    self._channel.post_step_all()
                else:
                    self.post(code, requests, filters)
        except BaseException:
            if self.num_workers and self._channel.posted_id != posted and not (
                    requests is not None and self.transport.sending_chunks):
                raise  # the workers have it: in flight
            self._command = None
            self.cycle.finish()
            raise

    def post(self, code: int, requests: list[bytes] | None, filters: list | None) -> None:
        """Posts a command to every worker, with `filters` (FilterSync.changed()'s) ahead of its requests."""
        if filters is None:
            self.transport.post(code, requests)
            return
        head = P.dumps(pickled_filters(filters))
        requests = requests or [b""] * self.num_workers
        self.transport.post(code | P.TAKE_FILTERS, [P.prefixed(head, r) for r in requests])
        self.filter_sync.taken(filters)

    def finish(self, timeout: float | None = None, build: Callable[[Any], Any] | None = None):
        """Runs the caller's slice, then waits for the workers; returns the
        command's result, or what `build` makes of it (the front end's
        batch). Env errors are raised only once every slice is done, so
        nothing is left in flight.

        If `timeout` seconds pass first (``ShmVecTimeoutError``) or the wait is
        interrupted (``KeyboardInterrupt``), the command stays in flight and
        finish() may be called again: no result is lost. Reading the
        workers' replies and `build` run with Ctrl-C held (as the caller's
        slice does): a Ctrl-C then is raised once the result is made, and
        the next finish() returns that result. Anything else ends the
        command, and the cycle moves on (see shmvec._engine.cycle): an env
        error in a step or reset, or a second Ctrl-C that stopped the caller's
        own slice, leaves the batch half done."""
        command = self._command
        if command is None:  # (one in flight means the cycle is waiting for it: not broken, not closed)
            raise RuntimeError("no shmvec command is in flight")
        try:
            if not command.collected:
                self._complete(command, timeout)
            if not command.built:
                _core.run_holding_interrupt(self._collect, command, build)
        except BaseException as exc:
            if self.cycle.phase is CLOSED and isinstance(exc, Exception):
                # close() ran meanwhile (a signal handler's) and tore down what the call was reading
                raise self.cycle.closed_error() from None
            if self._command is not None:
                raise  # a timeout, an interrupted wait, or a Ctrl-C held while the result was made: in flight
            if command.collected:
                self.cycle.finish()  # `build` failed: as if it had run after finish() returned
            elif self.cycle.phase is not BROKEN:
                if isinstance(exc, KeyboardInterrupt):  # the caller's own slice stopped mid-batch
                    self.cycle.half_done(INTERRUPTED)
                elif isinstance(exc, Exception) and not isinstance(exc, ShmVecError) and command.code in (
                        P.STEP, P.RESET):
                    self.cycle.half_done(ENV_RAISED)  # some envs stepped, others did not
                else:
                    self.cycle.finish()
            raise
        # The result is handed out: the front end's call clears handed_out
        # as its last act before it returns it. Python may raise a Ctrl-C
        # on the way there (before 3.11 at every return from a function, or
        # under a profiler); the next step_wait() then returns the result
        # (see unreturned_step()) instead of losing a step that was made.
        # The phase before the command: a Ctrl-C between the two then finds
        # the command still there, not gone while a phase waits for it.
        self.handed_out = command
        self.cycle.finish()
        self._command = None
        if command.code == P.STEP and self._torch_threads.judge is not None:
            self._torch_threads.judge.step_returns()
        return command.result

    def abandon(self, timeout: float) -> None:
        """Ends the command in flight for close(), which nobody will collect:
        waits for its workers' part at most `timeout` seconds (then
        ShmVecTimeoutError), or raises what the wait for them raises. The
        caller's own slice is not run for it: an env of it may hang."""
        command, self._command = self._command, None
        if command is not None and not command.collected and self.num_workers:
            self.pool.wait(call_timeout=timeout, call_deadline=time.monotonic() + timeout)

    def unreturned_step(self) -> Any:
        """The results of a step that finish() completed but that Ctrl-C
        stopped on its way back to the caller (see finish()), or None."""
        command = self.handed_out
        if command is not None and command.code == P.STEP and self.cycle.phase is IDLE:
            return command.result
        return None

    def _complete(self, command: _Command, timeout: float | None) -> None:
        """Runs the caller's slice, then waits for the workers. `timeout=0`
        polls, as in AsyncVectorEnv: the workers' part is looked at once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not command.caller_done:
            if self._caller is not None:
                self._run_caller_slice(command)
                if deadline is not None and time.monotonic() > deadline:
                    # The caller's own slice took the whole time: the call did
                    # not complete within `timeout` (its results are kept; the
                    # next wait finds the slice done, and polls only the workers).
                    raise still_pending(timeout)
            else:
                command.caller_done = True
        if self.num_workers:
            try:
                self.pool.wait(restart=True, call_timeout=timeout, call_deadline=deadline)
            except BaseException as exc:
                # A timeout, or a signal handler's exception (Ctrl-C's, a watchdog's)
                interrupted = self.pool.take_interruption() is exc or isinstance(exc, KeyboardInterrupt)
                if interrupted or isinstance(exc, ShmVecTimeoutError):
                    if self.cycle.phase is not BROKEN:
                        raise  # still in flight: finish() may be called again
                    self._command = None
                    raise command.caller_error or exc
                if isinstance(exc, Exception):
                    self._command = None
                    if command.caller_error is not None:
                        raise command.caller_error from None
                raise

    def _collect(self, command: _Command, build: Callable[[Any], Any] | None) -> None:
        """Reads the command's result (the caller's slice's, the workers'
        replies) into it, then makes `build`'s of it; any error ends the
        command. Runs with Ctrl-C held (see finish())."""
        try:
            if not command.collected:
                replies: list[bytes] = []
                if self.num_workers:
                    try:
                        replies = self._worker_replies(command)
                    except Exception:
                        if command.caller_error is None:
                            raise
                if command.caller_error is not None:
                    raise command.caller_error  # the caller's envs come first by index
                if command.collect is not None:
                    command.result = command.collect(command.caller_result, replies)
                command.collected = True
            if build is not None:
                command.result = build(command.result)
        except BaseException:
            self._command = None
            raise
        command.built = True

    def _run_caller_slice(self, command: _Command) -> None:
        """The caller's own part of `command`, with Ctrl-C held: one that
        comes meanwhile is raised once every env of the slice is done, and
        the command stays in flight (as after a Ctrl-C in the wait). A
        second Ctrl-C stops the slice at once (an env may hang): the batch
        is then half done."""
        _core.run_holding_interrupt(self._caller_slice, command)

    def _caller_slice(self, command: _Command) -> None:
        own = self._caller
        if own is None or not own.enter():  # close() came first (from another thread, or a signal handler)
            raise self.cycle.closed_error()
        try:
            command.caller_result = command.caller_fn(own)
        except Exception as exc:
            command.caller_error = exc  # raised once the workers are done too
        except BaseException:  # stopped mid-slice: workers finish; the next command waits them out
            self._command = None
            raise
        finally:
            own.leave()
        command.caller_done = True

    def _worker_replies(self, command: _Command) -> list[bytes]:
        """The workers' replies to a finished command; failed workers are
        replaced, and a step or reset is made good for their envs."""
        # On the step path only workers with infos or episode ends reply.
        if not self.pool.failed:
            return self.transport.replies(self._channel.workers_with_replies() if command.plain_step
                                          else range(self.num_workers))
        failed = sorted({w for w, _ in self.pool.failed})
        workers = self._channel.workers_with_replies() if command.plain_step else range(self.num_workers)
        # Replaced first: an env error in the others' replies must not leave
        # them dead, for the next wait to count again.
        self.restart_failed()
        replies = self.transport.replies([w for w in workers if w not in failed])
        if command.code == P.STEP:  # their next step is their restart report: take it now
            replies += self.transport.request(P.STEP, None, failed)
        elif command.code == P.RESET:
            # Reset again, without the seeds and options (a reset that killed
            # its worker would do it again); envs the mask left out lost their
            # episodes: their next step reports the restart.
            mask = self._reset_mask
            reset = [cloudpickle.dumps(([None] * len(rows), None, None if mask is None else mask[rows].copy()))
                     for rows in (self.worker_rows[w] for w in failed)]
            replies += self.transport.request(P.RESET, reset, failed)
        else:  # their results are lost, not replaced
            raise ShmVecError(f"shmvec workers {failed} failed during this call and were "
                              "restarted (their next step reports it); call again")
        return replies

    # -- the operations front ends use ------------------------------------
    # Each is begin_X(...) then finish(timeout), or X(...) for both at once;
    # finish() returns what X returns.

    def begin_step(self, object_actions: list | None = None) -> None:
        """Steps every env with the actions already written to the arena
        (`object_actions`: per-env values of action leaves without a fixed
        shape). Its result: the StepRecords, in env order, of envs with infos
        that are not in columns, ended SAME_STEP episodes or observation
        leaves without a fixed shape."""
        if object_actions is None:
            self.begin(P.STEP, EnvSlice.step, collect=self._step_records)
        else:  # (in a method of its own: its closure would cost every step a cell)
            self._begin_step_with_objects(object_actions)

    def _begin_step_with_objects(self, object_actions: list) -> None:
        requests = [P.dumps([object_actions[i] for i in rows]) for rows in self.worker_rows]
        self.begin(P.STEP, lambda s: s.step([object_actions[i] for i in s.rows]), requests,
                   collect=self._step_records)

    def _step_records(self, caller_records, replies: list[bytes]) -> list[StepRecord]:
        if not caller_records and not replies:
            return []
        records = self._records(caller_records, replies)
        if self.restarted_rows:  # their restart reports came last
            records.sort(key=lambda record: record.row)
        return records

    @staticmethod
    def _records(caller_records, replies: list[bytes]) -> list[StepRecord]:
        records = list(map(StepRecord._make, caller_records)) if caller_records else []
        for data in replies:
            if data:
                part = P.loads(data)
                if part:
                    records.extend(map(StepRecord._make, part))
        return records

    def begin_reset(self, seeds: list, options: dict | None, mask: np.ndarray | None) -> None:
        """Resets the envs (those in `mask`); its result: records like a step's."""
        def part(rows):
            return (
                [seeds[i] for i in rows],
                options,
                None if mask is None else mask[rows.start:rows.stop].copy(),
            )

        requests = [cloudpickle.dumps(part(rows)) for rows in self.worker_rows]
        self._reset_mask = mask  # for workers that die in it (see _worker_replies)
        self.begin(P.RESET, lambda s: s.reset(*part(s.rows)), requests, collect=self._records)

    def reset(self, seeds: list, options: dict | None, mask: np.ndarray | None) -> list[StepRecord]:
        self.begin_reset(seeds, options, mask)
        return self.finish()

    def begin_call(self, name: str, args: tuple = (), kwargs: dict | None = None,
                   rows: Sequence[int] | None = None) -> None:
        """Calls (or reads) `name` on the envs in `rows` (all by default), as
        often as each is named and in that order, as DummyVecEnv does; its
        result: the values in the order of `rows`."""
        kwargs = kwargs or {}
        rows = None if rows is None else [int(r) for r in rows]
        request = cloudpickle.dumps((name, args, kwargs, rows))

        def collect(caller_result, replies):
            # Each slice answers for its own rows, in the order of `rows`.
            answers = [(self._caller.rows, iter(caller_result or []))] if self._caller is not None else []
            answers += [(own, iter(P.loads(data))) for own, data in zip(self.worker_rows, replies)]
            if rows is None:
                return [value for _, values in answers for value in values]
            return [next(values) for r in rows for own, values in answers if r in own]

        self.begin(P.CALL, lambda s: s.call(name, args, kwargs, rows), [request] * self.num_workers,
                   collect=collect)

    def call(self, name: str, args: tuple = (), kwargs: dict | None = None,
             rows: Sequence[int] | None = None) -> list:
        self.begin_call(name, args, kwargs, rows)
        return self.finish()

    def set_attr(self, name: str, values: Sequence[Any]) -> None:
        requests = [cloudpickle.dumps((name, [values[i] for i in rows])) for rows in self.worker_rows]
        caller_rows = self._caller.rows if self._caller is not None else range(0)
        # Its result, None per env, is what call_wait() returns if Ctrl-C left it pending.
        self.begin(P.SET_ATTR, lambda s: s.set_attr(name, [values[i] for i in caller_rows]), requests,
                   collect=lambda caller_result, replies: [None] * self.num_envs)
        self.finish()
