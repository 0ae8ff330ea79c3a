"""The engine under every front end: it builds the arena, starts the worker
pool and the caller's own slice, and runs the commands that drive them.

Its parts, each a module: ``plan`` (how many workers, which envs each
steps), ``pool`` (the processes, their liveness and restarts), ``transport``
(requests and replies), ``cycle`` (the state machine of the calls) and, in
async mode, ``async_steps`` (send/recv). A command is begun, then finished:
``begin_X(...)`` posts the workers' part and returns at once; ``finish()``
steps the caller's slice, waits for the workers and returns the result.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from shmvec import _core
from shmvec._engine import protocol as P
from shmvec._engine.async_steps import RECORD_CAPACITY, AsyncSteps
from shmvec._engine.caller_state import FilterSync
from shmvec._engine.commands import CommandRunner, _Command
from shmvec._engine.cpus import WorkerPlacement
from shmvec._engine.cycle import BROKEN, CLOSED, CommandCycle
from shmvec._engine.env_slice import EnvSlice, make_envs
from shmvec._engine.info_columns import InfoColumns
from shmvec._engine.layout import DataLayout
from shmvec._engine.plan import (busy_cpus_note, caller_cpus, check_observation_spaces, check_options,
                                 first_env_space, no_cpu_idle, plan_slices, split_slices, workers_follow_caller,
                                 workers_may_follow)
from shmvec._engine.pool import CLOSE_GRACE_S, WorkerPool, fd_limit_reached, live_worker_pids, out_of_fds
from shmvec._engine.system import IS_LINUX, busy_threads_share_our_group, cpus_busy_elsewhere
from shmvec._engine.torch_threads import TorchThreads
from shmvec._engine.torch_threads import check_setting as check_torch_threads
from shmvec._engine.transport import REPLY_CAPACITY, REQUEST_CAPACITY, Transport
from shmvec.errors import ShmVecError, WorkerDiedError, warn_performance

__all__ = ["Engine", "CLOSE_GRACE_S", "FIRST_ENV_SPACES"]

# observation_mode for SB3's front end: env 0's observation and action spaces,
# as DummyVecEnv takes them; the others need only their shapes and dtypes.
FIRST_ENV_SPACES = "first env's"


def _pickled_factories(env_fns, rows: range) -> bytes:
    """A worker's env factories, as it receives them (pickled under every
    start method: a restart rebuilds them from these bytes)."""
    try:
        return cloudpickle.dumps([env_fns[i] for i in rows])
    except Exception as exc:
        for i in rows:  # which one
            try:
                cloudpickle.dumps(env_fns[i])
            except Exception:
                raise TypeError(
                    f"env_fns[{i}] cannot be pickled for its worker process ({type(exc).__name__}: {exc}); "
                    "shmvec pickles env factories (cloudpickle: lambdas and closures work) under every start "
                    "method, fork included: make unpicklable objects (locks, open files, sockets) inside the "
                    "factory") from exc
        raise


def _create_arena_file(fds: list[int], size: int) -> None:
    """The arena's memfd, into the pool's fds (where shutdown closes it)."""
    fds[1] = _core.create_shared_file(size)


class Engine(CommandRunner):
    """Steps `env_fns` in `num_workers` processes (and, with `caller_steps`,
    one slice in the calling process), all through one shared arena. Its
    commands (``CommandRunner``, its base) run through `cycle`, the front
    end's ``CommandCycle``."""

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        *,
        cycle: CommandCycle | None = None,
        num_workers: int | None = None,
        caller_steps: bool | None = None,
        pin_workers: bool | str | Sequence[int] = "auto",
        start_method: str | None = None,
        autoreset_code: int = 0,
        reset_call: str = "seed-and-options",
        timeout: float | None = None,
        async_mode: bool = False,
        restart_failed_workers: bool = False,
        max_restarts: int = 10,
        observation_mode: Any = "same",
        torch_threads: str | int | None = "auto",
        daemon: bool = True,
        max_concurrency: int | None = None,
    ):
        if not IS_LINUX:
            raise OSError(
                "shmvec runs on Linux only (it needs memfd and futex); "
                "use gymnasium.vector.SyncVectorEnv or AsyncVectorEnv on this platform"
            )
        env_fns, timeout_s, start_method = check_options(
            env_fns, num_workers, caller_steps, async_mode, timeout, start_method, pin_workers, max_restarts)
        check_torch_threads(torch_threads)
        self.cycle = cycle or CommandCycle(lambda: ShmVecError("this shmvec engine is closed"))
        self.num_envs = len(env_fns)
        self.async_mode = async_mode
        self.owner_pid = os.getpid()  # its workers serve this process only
        # Looked at once (it may take 80 ms on a busy machine), for the worker count, pinning and the note.
        busy_cpus = cpus_busy_elsewhere(own_pids=live_worker_pids()) if num_workers != 0 else 0
        # With no CPU idle: whether a worker more gets a share of the CPUs of its own (15 ms more).
        shares = no_cpu_idle(busy_cpus) and busy_threads_share_our_group(own_pids=live_worker_pids())
        requested, caller_steps_given = num_workers, caller_steps
        follows = workers_follow_caller(async_mode, pin_workers, busy_cpus)
        num_workers, caller_steps = plan_slices(self.num_envs, num_workers, caller_steps, async_mode, busy_cpus,
                                                follows, shares, max_concurrency)
        # Whether its workers may follow the caller, now or later (WorkerPlacement watches).
        watched = num_workers > 0 and workers_may_follow(async_mode, pin_workers,
                                                                num_workers + (1 if caller_steps else 0))
        follows = follows and watched
        note = busy_cpus_note(self.num_envs, requested, num_workers, caller_steps, async_mode, busy_cpus, follows,
                              shares)
        if note:
            warn_performance(note)
        self.num_workers = num_workers
        # The workers an idle machine gets: torch's count where reproducible numbers are asked for.
        idle_workers = num_workers if not busy_cpus else plan_slices(
            self.num_envs, requested, caller_steps_given, async_mode, max_concurrency=max_concurrency)[0]
        self._torch_threads = TorchThreads(torch_threads, num_workers, busy_cpus, lock_step=not async_mode,
                                           idle_workers=idle_workers)
        # Released by close(), or when the engine is collected unclosed.
        self._release_torch_threads = weakref.finalize(self, self._torch_threads.release)
        slices = split_slices(self.num_envs, num_workers + (1 if caller_steps else 0))
        caller_rows = slices.pop(0) if caller_steps else None
        self.worker_rows = slices
        self.pool = WorkerPool(self.cycle, slices, start_method, timeout_s, bool(restart_failed_workers),
                               int(max_restarts), bool(daemon))
        self._placement = WorkerPlacement(self.pool, follows) if watched else None
        self._reset_mask: np.ndarray | None = None  # the last reset's
        self.restarted_rows: list[int] = []  # envs restarted by the last command (or recv)
        # Async mode: envs restarted whose envs in flight the front end has
        # not sent again yet (kept until it has: a Ctrl-C may come between).
        self.to_send_again: list[int] = []
        self.filter_sync = FilterSync()  # the workers start with the caller's filters of now
        self._command: _Command | None = None  # begun, results not yet collected
        # The command finish() completed last, until the front end's call
        # returns its result (see finish()).
        self.handed_out: _Command | None = None
        self._caller: EnvSlice | None = None
        self.transport: Transport | None = None
        self.async_steps: AsyncSteps | None = None  # send/recv, in async mode
        try:
            self._start(env_fns, pin_workers, leave_free=caller_cpus(caller_steps, async_mode), busy_cpus=busy_cpus)
            if caller_rows is not None:
                factories = [env_fns[i] for i in caller_rows]
                self._caller = EnvSlice(make_envs(factories, caller_rows.start), caller_rows.start)
            self._describe_and_attach(autoreset_code, reset_call, observation_mode)
        except BaseException as exc:
            try:
                self.close(terminate=True)
            except Exception:  # the first error is the one to report
                pass
            if out_of_fds(exc):
                raise OSError(exc.errno, f"shmvec could not start its workers: {fd_limit_reached(exc)}") from exc
            raise

    @property
    def timeout(self) -> float:
        """Seconds a wait for workers may take (< 0: no limit)."""
        return self.pool.timeout

    @property
    def restarts(self) -> int:
        return self.pool.restarts

    @property
    def restart_failed_workers(self) -> bool:
        return self.pool.restart

    @property
    def closed(self) -> bool:
        return self.cycle.phase is CLOSED

    @property
    def in_flight(self) -> bool:
        """A command was begun and its results are still to be collected."""
        return self._command is not None

    # -- set-up -------------------------------------------------------------

    def _start(self, env_fns, pin_workers, leave_free: int, busy_cpus: int) -> None:
        w = self.num_workers
        self._fixed_size = fixed = _core.fixed_region_size(w, REQUEST_CAPACITY, REPLY_CAPACITY)
        # With Ctrl-C held: one before the store would leak the memfd.
        _core.run_holding_interrupt(_create_arena_file, self.pool.fds, fixed)
        self._boot = _core.Mapping(self.pool.fds[1], fixed)
        self._channel = _core.FrontChannel(self._boot, w, REQUEST_CAPACITY, REPLY_CAPACITY, True)
        self.transport = Transport(self._channel, self._boot, w, self.pool.wait)
        factories = [_pickled_factories(env_fns, rows) for rows in self.worker_rows]
        self.pool.start(self._channel, fixed, factories, pin_workers, leave_free, busy_cpus)
        if w:
            self._channel.post(list(range(w)), P.STARTED)

    def _describe_and_attach(self, autoreset_code: int, reset_call: str, observation_mode: Any) -> None:
        descriptions = [self._caller.describe()] if self._caller is not None else []
        if self.num_workers:
            try:
                self.pool.wait_started()
                replies = self.transport.request(P.DESCRIBE)
            except WorkerDiedError as exc:
                raise WorkerDiedError.while_starting(exc, self.pool.start_method) from None
            descriptions += [P.loads(r) for r in replies]
        observation_spaces = [space for d in descriptions for space in d["observation_spaces"]]
        action_spaces = [space for d in descriptions for space in d["action_spaces"]]
        if observation_mode == FIRST_ENV_SPACES:
            obs_space, batched_obs_space = first_env_space(observation_spaces, "observation"), None
            act_space = first_env_space(action_spaces, "action")
        else:
            obs_space, batched_obs_space = check_observation_spaces(observation_spaces, observation_mode)
            for row, space in enumerate(action_spaces):
                if space != action_spaces[0]:
                    raise RuntimeError(
                        f"Some environments have an action space different from `{action_spaces[0]}` "
                        f"(env {row}: `{space}`). In order to batch actions, the action spaces from all "
                        "environments must be equal."
                    )
            act_space = action_spaces[0]
        self.description = {
            "observation_space": obs_space,
            "batched_observation_space": batched_obs_space,  # observation_mode="different" only
            "action_space": act_space,
            "metadata": descriptions[0]["metadata"],
            "render_mode": descriptions[0]["render_mode"],
        }
        # Async mode: a pair of rings per worker, and one for the caller's own slice.
        rings = self.num_workers + (1 if self._caller is not None else 0) if self.async_mode else 0
        async_size = _core.async_region_size(self.num_envs, rings, RECORD_CAPACITY) if rings else 0
        self.layout = DataLayout(obs_space, act_space, self.num_envs, self._fixed_size, async_size, RECORD_CAPACITY,
                                 rings, tuple(rows.start for rows in self._slice_rows()))
        total = self._fixed_size + self.layout.size
        _core.resize_shared_file(self.pool.fds[1], total)
        self._data = _core.Mapping(self.pool.fds[1], total)
        self.views = self.layout.views(self._data)
        self.info_columns = InfoColumns(self.views["info_values"], self.views["info_flags"], self._slice_rows(),
                                        self.views["info_schemas"])
        self.views["action_dtypes"][:] = self.layout.action_space_codes  # until the first batch
        if self._caller is not None:
            self._caller.attach(self.layout, self._data, obs_space, act_space, autoreset_code, reset_call)
        if self.async_mode:
            self.async_steps = AsyncSteps(self, self._data, self.layout.async_offset, self._caller,
                                          self._torch_threads)
        if self.num_workers:
            self._attach_request = P.dumps((self.layout, obs_space, act_space, autoreset_code, reset_call))
            self.transport.request(P.ATTACH, [self._attach_request] * self.num_workers)

    def _slice_rows(self) -> list[range]:
        """The rows of every slice: the caller's first, then each worker's."""
        return ([self._caller.rows] if self._caller is not None else []) + list(self.worker_rows)

    def begin_reset(self, seeds: list, options: dict | None, mask: np.ndarray | None) -> None:
        # A torch imported since the env was made (a policy built before the
        # first reset) would compete with the workers at its default threads.
        self._torch_threads.look()
        super().begin_reset(seeds, options, mask)

    # -- restarts -------------------------------------------------------------

    def restart_failed(self) -> None:
        """Replaces the pool's failed workers with fresh ones that rebuild
        their envs from the same factories. The envs are marked restarted:
        each one's next step, whatever its action, reports its episode cut
        short as its autoreset mode reports a truncation
        (Stepper.mark_restarted). Their rows go to `restarted_rows`."""
        failed, self.pool.failed = self.pool.failed, []
        for w, cause in failed:
            if self.async_mode:  # what it had in flight is lost: the front end sends it again
                self._channel.reset_async_worker(w)
            self._channel.post([w], P.STARTED)  # before it starts: the first command it sees
            self.pool.replace(w, cause)
            try:
                self.pool.wait_started()
                self.transport.request(P.DESCRIBE, None, [w])
            except Exception as exc:  # its factories raised: no reset can bring these envs back
                self.cycle.break_(f"shmvec worker {w} was restarted ({cause}), but its envs could not be "
                                  f"rebuilt ({type(exc).__name__}: {exc}); close this vector env")
                raise
            self.transport.request(P.ATTACH, [self._attach_request], [w])
            self.transport.request(P.MARK_RESTARTED, None, [w])
            self.info_columns.forget(w + (1 if self._caller is not None else 0))
            self.restarted_rows += list(self.worker_rows[w])
            if self.async_mode:
                self.to_send_again += list(self.worker_rows[w])
            self.filter_sync.forget()  # it took the caller's filters of now
            if self._placement is not None:
                self._placement.forget()

    def mark_restarted(self) -> None:
        """Marks every env restarted (a Ray actor that was rebuilt)."""
        if self._caller is not None:
            self._caller.mark_restarted()
        if self.num_workers:
            self.transport.request(P.MARK_RESTARTED)

    # -- shutdown -------------------------------------------------------------

    def close(self, terminate: bool = False) -> None:
        """Closes envs and workers; with `terminate` (or when a worker is dead
        or hung) kills workers at once. Idempotent and bounded in time.
        Afterwards no worker, fd or mapping of ours remains."""
        if self.closed:
            return
        if not self.in_owner:  # a fork child's copy (e.g. its exit's __del__): the workers are the parent's
            self.cycle.close()
            return
        was = self.cycle.close()
        self._command = None  # its results are not wanted any more: waited out below
        errors: list[BaseException] = []
        graceful = bool(self.pool.processes) and not terminate and was is not BROKEN
        if graceful:
            # Bounded even if an env hangs and no timeout was set (async mode's
            # envs in flight included): a worker that times out is then killed.
            self.pool.timeout = CLOSE_GRACE_S if self.pool.timeout < 0 else min(self.pool.timeout, CLOSE_GRACE_S)
            self.pool.closing = True  # (only while close() waits: see WorkerPool.check_wait)
            try:
                if self._channel.busy:
                    self._wait_out_unread()
                self.post(P.CLOSE, None, self.filter_sync.changed())  # envs' close() may warn
                self.transport.collect(range(self.num_workers))
            except BaseException as exc:  # a broken worker must not stop the shutdown
                errors.append(exc)
                graceful = False
            finally:
                self.pool.closing = False
        if self._caller is not None:
            caller, self._caller = self._caller, None
            try:
                # Not under a step that another thread (or this one, below a
                # signal handler) is inside: after it, as a worker would.
                caller.close_when_free(CLOSE_GRACE_S)
            except Exception as exc:
                if hasattr(exc, "add_note"):  # (3.11+) a worker's names its env in its traceback
                    exc.add_note(f"(in shmvec env {caller.failed_row})")
                errors.insert(0, exc)  # the caller's envs come first
        self._release_torch_threads()
        self.pool.shutdown(CLOSE_GRACE_S if graceful else 0.0)
        # Drop our views so the mappings go away (user-held copy=False views
        # keep theirs alive, as any numpy view keeps its buffer).
        self.views = self.info_columns = self.async_steps = None
        if self.transport is not None:
            self.transport.close()
        self._data = self._boot = self._channel = self.pool.channel = None
        for exc in errors:
            if not isinstance(exc, (WorkerDiedError, TimeoutError, ShmVecError)):
                raise exc
