"""The worker processes: starting them (pinned to CPUs when asked), telling
a dead or hung one while waiting for them, the restart budget, and a shutdown
that is bounded in time and leaves no process, fd or CPU reservation behind.

What a fresh worker is told (describe, attach, its envs marked restarted) is
the engine's business (``Engine._restart_failed``); this module only owns
the processes.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.util
import os
import resource
import time
import weakref
from collections.abc import Sequence

from shmvec import _core
from shmvec._engine.caller_state import caller_environ, caller_registrations, caller_warning_filters
from shmvec._engine.cpus import choose_cpus
from shmvec._engine.cycle import CLOSED, CommandCycle
from shmvec._engine.system import PARENT_ONLY_FDS
from shmvec._engine.thread_pools import env_pools_held_while_forking
from shmvec._engine.transport import REPLY_CAPACITY, REQUEST_CAPACITY
from shmvec._engine.worker import CLOSE_GRACE_S, FdHandle, WorkerSpec
from shmvec._engine.worker import main as worker_main
from shmvec.errors import ShmVecTimeoutError, WorkerDiedError, describe_exit, describe_worker

__all__ = ["WorkerPool", "CLOSE_GRACE_S", "START_TIMEOUT_S", "still_pending", "live_worker_pids", "out_of_fds",
           "fd_limit_reached"]

# With a `timeout`, a worker's process still gets at least this long to
# start (see WorkerPool.wait_started).
START_TIMEOUT_S = 60.0

# Every pool of this process not yet collected: their workers are shmvec's
# own, not other programs' load (system.cpus_busy_elsewhere).
_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def live_worker_pids() -> list[int]:
    """Pids of the workers of every pool of this process."""
    return [p.pid for pool in list(_POOLS) for p in pool.processes if p.pid is not None]


def _disown_workers_in_fork_child() -> None:
    """A fork child of this process does not own its workers: multiprocessing's
    exit hook there would terminate them (it terminates the daemon children it
    has records of), leaving the parent's vector env broken."""
    for pool in list(_POOLS):
        for p in pool.processes:
            mp.process._children.discard(p)


os.register_at_fork(after_in_child=_disown_workers_in_fork_child)


def still_pending(timeout: float) -> ShmVecTimeoutError:
    return ShmVecTimeoutError(f"The call timed out after {timeout} second(s); it is still pending: "
                              "wait for it again (its results are kept), or close() the vector env")


class WorkerPool:
    """The processes of `worker_rows` (one slice of envs each).

    `timeout` (seconds, < 0 for none) counts a worker as hung; with
    `restart`, a failed worker is given up on (and replaced by the engine,
    up to `max_restarts` in all) instead of breaking the cycle. Workers
    that are not `daemon` may start processes of their own (multiprocessing
    refuses that to daemons)."""

    def __init__(self, cycle: CommandCycle, worker_rows: Sequence[range], start_method: str,
                 timeout: float, restart: bool, max_restarts: int, daemon: bool = True):
        self.cycle = cycle
        self.channel: _core.FrontChannel | None = None
        self.worker_rows = list(worker_rows)
        self.num_workers = len(self.worker_rows)
        self.start_method = start_method
        self.timeout = timeout
        self.restart = restart
        self.max_restarts = max_restarts
        self.daemon = daemon
        self.restarts = 0
        # Set by the engine's close() for its own waits: their timeouts are
        # timeouts, not a close() that ran during a user's call.
        self.closing = False
        # Workers that died or hung during the current command, with why.
        self.failed: list[tuple[int, str]] = []
        self.interrupted_by: BaseException | None = None  # see _wait_channel()
        self.processes: list[mp.process.BaseProcess] = []
        self.sentinels: list[int] = []
        self.cpus: list[int | None] = []
        # fds to close at shutdown: [parent pipe's write end, arena memfd,
        # parent pipe's read end, CPU locks...]; the read end stays open to
        # start workers later.
        self.fds = [-1, -1, -1]
        # If the pool is garbage-collected unclosed, or the interpreter exits
        # with it, workers still go away: at exit before multiprocessing joins
        # the workers that are not daemons (its exit hook runs finalizers of
        # priority >= 0 first); never in a fork child of this process.
        self._finalizer = mp.util.Finalize(self, shutdown, (self.processes, self.cpus, self.fds, 1.0), exitpriority=0)
        _POOLS.add(self)

    # -- start ------------------------------------------------------------------

    def start(self, channel: _core.FrontChannel, fixed_size: int, factories: list[bytes], pin_workers,
              leave_free: int, busy_cpus: int) -> None:
        """Starts every worker over the arena (its memfd is ``fds[1]``); each
        then waits for its first command."""
        self.channel = channel
        self._fixed_size = fixed_size
        self._factories = factories
        if not self.num_workers:
            return
        _core.run_holding_interrupt(self._open_fds, pin_workers, leave_free, busy_cpus)
        for k in range(self.num_workers):  # one by one: if one cannot start, shutdown ends those before it
            self.processes.append(self.spawn(k))
        self.sentinels[:] = [p.sentinel for p in self.processes]

    def _open_fds(self, pin_workers, leave_free: int, busy_cpus: int) -> None:
        """Opens the parent-alive pipe and reserves CPUs, into `fds` (where
        shutdown closes them). Run with Ctrl-C held: one between an fd's
        opening and its store would leak it, and a CPU lock's fd would keep
        its CPU reserved for the life of this process."""
        # The parent-alive pipe: workers get the read end; only we hold the
        # write end. We keep the read end too, for workers started later.
        self.fds[2], self.fds[0] = os.pipe()
        PARENT_ONLY_FDS.add(self.fds[0])
        cpus, locks = choose_cpus(self.num_workers, pin_workers, leave_free=leave_free, busy_cpus=busy_cpus)
        self.cpus[:] = cpus
        self.fds += locks  # closed at shutdown, which frees the CPUs
        PARENT_ONLY_FDS.update(locks)

    def spawn(self, k: int) -> mp.process.BaseProcess:
        """Starts the process of worker `k`."""
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(["shmvec._engine.fork_server"])
        spec = WorkerSpec(
            index=k, num_workers=self.num_workers, first_row=self.worker_rows[k].start,
            factories=self._factories[k], arena=FdHandle(self.fds[1]), fixed_size=self._fixed_size,
            request_capacity=REQUEST_CAPACITY, reply_capacity=REPLY_CAPACITY,
            parent_alive=FdHandle(self.fds[2]),
            start_method=self.start_method, cpu=self.cpus[k],
            environ=caller_environ(self.start_method), registrations=caller_registrations(self.start_method),
            warning_filters=caller_warning_filters(self.start_method),
        )
        p = ctx.Process(target=worker_main, args=(spec,), name=f"shmvec-worker-{k}", daemon=self.daemon)
        check_fds_for_a_start()
        with env_pools_held_while_forking(self.start_method):
            p.start()
        return p

    # -- liveness -----------------------------------------------------------------

    def wait(self, restart: bool = False, call_timeout: float | None = None,
             call_deadline: float | None = None) -> None:
        """Waits for the posted workers. A call's deadline that comes before
        the pool's timeout raises ShmVecTimeoutError and leaves the command
        in flight; the pool's own timeout counts a worker as hung. With
        `restart` (and restarts on), failed workers are given up on (their
        part of the command is abandoned) and listed in `failed`."""
        limit, by_call = self.timeout, False
        if call_deadline is not None:
            left = max(call_deadline - time.monotonic(), 0.0)
            if limit < 0 or left < limit:
                limit, by_call = left, True
        code = self._wait_channel(limit)
        while code != 0 and not (code < 0 and by_call) and restart and self.restart:
            if code > 0:
                failed = [(code - 1, self.exit_cause(code - 1))]
            else:
                failed = [(w, f"hung for more than timeout={self.timeout} s") for w in self.channel.busy_workers()]
            for w, cause in failed:
                self.channel.abandon(w)
                self.kill(w)
                if all(w != listed for listed, _ in self.failed):  # (given up on by an earlier wait)
                    self.failed.append((w, cause))
            code = self._wait_channel(limit)
        if code < 0 and by_call:
            raise still_pending(call_timeout)
        self.check_wait(code)

    def wait_started(self) -> None:
        """Waits for the posted workers' answer to P.STARTED: their processes
        run shmvec's code. `timeout` is for envs that hang, and this is
        Python's start, with the main module imported again under forkserver
        and spawn (a training script's imports, torch's: seconds), so it gets
        at least START_TIMEOUT_S."""
        limit = self.timeout if self.timeout < 0 else max(self.timeout, START_TIMEOUT_S)
        code = self._wait_channel(limit)
        if code < 0:
            why = (f"{self._describe(self.channel.busy_workers())} did not start within {limit:g} s "
                   "(Python's start, and under forkserver and spawn the import of the main module again)")
            self.cycle.break_(f"{why}; close this vector env")
            raise ShmVecTimeoutError(f"{why}; close() the vector env")
        self.check_wait(code)

    def _wait_channel(self, limit: float) -> int:
        """The native wait. What it raises is a signal handler's exception
        (KeyboardInterrupt, or the program's own, a watchdog's): kept in
        `interrupted_by` for the command, which stays in flight."""
        try:
            return self.channel.wait(self.sentinels, limit)
        except BaseException as exc:
            self.interrupted_by = exc
            raise

    def take_interruption(self) -> BaseException | None:
        """The exception that interrupted the last wait, if any; forgotten
        here (it holds the frames of its traceback)."""
        exc, self.interrupted_by = self.interrupted_by, None
        return exc

    def check_wait(self, code: int, busy: list[int] | None = None) -> None:
        """Turns a failed wait into TimeoutError or WorkerDiedError (and a
        broken cycle). `busy`: the workers a timeout names (by default those
        that have not completed the command; async mode posts none)."""
        if code == 0:
            return
        if self.cycle.phase is CLOSED and not self.closing:  # close() ran during the wait (a signal handler's)
            raise self.cycle.closed_error()
        if code < 0:
            busy = self.channel.busy_workers() if busy is None else busy
            hung = f", {self._describe(busy)}" if busy else ""
            self.cycle.break_(
                f"a shmvec command timed out after {self.timeout} s; the vector env can only be closed")
            raise ShmVecTimeoutError(
                f"shmvec workers did not answer within timeout={self.timeout} s{hung} "
                "(an env may hang); close() the vector env"
            )
        worker = code - 1
        p = self.processes[worker]
        p.join(timeout=1.0)
        error = WorkerDiedError(worker, self.worker_rows[worker], p.exitcode)
        self.cycle.break_(str(error))
        raise error

    def _describe(self, workers: list[int]) -> str:
        """"shmvec worker 0 (envs 0..3), shmvec worker 1 (envs 4..7)"."""
        return ", ".join(describe_worker(w, self.worker_rows[w]) for w in workers)

    def exit_cause(self, w: int) -> str:
        p = self.processes[w]
        p.join(timeout=1.0)
        return f"died, {describe_exit(p.exitcode)}"

    def kill(self, w: int) -> None:
        self.processes[w].kill()
        self.processes[w].join(timeout=CLOSE_GRACE_S)

    def replace(self, w: int, cause: str) -> None:
        """Spends one restart on failed worker `w` and starts a fresh process
        for it (the engine has posted its first command); beyond the budget,
        WorkerDiedError and a broken cycle."""
        if self.restarts >= self.max_restarts:
            why = (f"{describe_worker(w, self.worker_rows[w])} failed ({cause}) and the restart budget "
                   f"max_restarts={self.max_restarts} is spent; close this vector env")
            self.cycle.break_(why)
            raise WorkerDiedError(w, self.worker_rows[w], self.processes[w].exitcode, why)
        self.restarts += 1
        try:
            fresh = self.spawn(w)
        except Exception as exc:  # the failed process stays, for shutdown to release
            why = fd_limit_reached(exc) if out_of_fds(exc) else f"{type(exc).__name__}: {exc}"
            why = (f"{describe_worker(w, self.worker_rows[w])} failed ({cause}) and could not be restarted "
                   f"({why}); close this vector env")
            self.cycle.break_(why)
            raise WorkerDiedError(w, self.worker_rows[w], self.processes[w].exitcode, why) from exc
        release(self.processes[w])
        self.processes[w] = fresh
        self.sentinels[w] = fresh.sentinel

    # -- shutdown -------------------------------------------------------------------

    def shutdown(self, grace: float) -> None:
        shutdown(self.processes, self.cpus, self.fds, grace)
        self._finalizer.cancel()  # (after: if Ctrl-C cuts the shutdown short, the finalizer ends it)


def shutdown(processes: list, cpus: list, fds: list[int], grace: float) -> None:
    """Closes our fds (workers see end-of-file on the parent pipe and exit),
    gives workers `grace` seconds in all, then kills what is left."""
    for k, fd in enumerate(fds):
        if fd >= 0:
            fds[k] = -1  # first: cut short after it, an fd is left open, never closed twice
            PARENT_ONLY_FDS.discard(fd)
            os.close(fd)
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    while processes:  # one by one: cut short, it can be run again
        p = processes.pop()
        if not ended(p):
            p.kill()
            p.join(timeout=CLOSE_GRACE_S)
        release(p)
    cpus.clear()


def out_of_fds(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


def fd_limit_reached(exc: OSError) -> str:
    """Why a start that ran out of file descriptors failed, and what to do."""
    if exc.errno == errno.ENFILE:
        return f"the system's open-file limit is reached ({exc.strerror}): close files"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (f"this process's open-file limit is reached ({exc.strerror}; it may open {soft}), and each "
            "worker holds a few while it starts: raise it (ulimit -n, or resource.setrlimit "
            "RLIMIT_NOFILE) or close files")


def check_fds_for_a_start() -> None:
    """Raises OSError (EMFILE) unless the fds that starting a process opens
    can be opened: multiprocessing's start (fork and forkserver, up to
    Python 3.13 at least) leaks its first pipe when its second cannot."""
    opened = []
    try:
        for _ in range(3):  # two pipes, and the fork server's socket
            opened += os.pipe()
    finally:
        for fd in opened:
            os.close(fd)


def ended(p: mp.process.BaseProcess) -> bool:
    """Whether worker `p` has ended. is_alive() asks waitpid(), which cannot
    tell where the program has SIGCHLD ignored (the kernel reaps children)
    or reaps children in a handler of its own; then the worker's sentinel,
    a pipe that its exit closes, does."""
    return not p.is_alive() or bool(mp.connection.wait([p.sentinel], timeout=0))


def release(p: mp.process.BaseProcess) -> None:
    """Frees the process object of worker `p`, which has ended (see ended():
    where waitpid() cannot tell, close() refuses, and there is nothing of
    the process left to free)."""
    try:
        p.close()
    except ValueError:
        if not ended(p):
            raise
