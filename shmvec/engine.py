"""The engine under every front end: the arena, the worker processes, the
caller's own slice, and the commands that drive them. Front ends (Gymnasium,
SB3, Ray actors) stay thin over it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import weakref
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np

from shmvec import _core
from shmvec import protocol as P
from shmvec._system import IS_LINUX, PARENT_ONLY_FDS, allowed_cpu_ids, usable_cpus
from shmvec.cpus import choose_cpus
from shmvec.env_slice import EnvSlice, make_envs
from shmvec.errors import RemoteTraceback, ShmVecError, ShmVecTimeoutError, WorkerDiedError, describe_exit
from shmvec.info_columns import InfoColumns
from shmvec.layout import DataLayout
from shmvec.torch_threads import TorchThreads
from shmvec.torch_threads import check_setting as check_torch_threads
from shmvec.worker import FdHandle, WorkerSpec
from shmvec.worker import main as worker_main

__all__ = ["Engine", "split_slices", "default_num_workers", "plan_slices"]

START_METHODS = ("fork", "forkserver", "spawn")
REQUEST_CAPACITY = 64 * 1024
REPLY_CAPACITY = 1024 * 1024  # virtual until touched: pages are allocated on first write
RECORD_CAPACITY = 8 * 1024  # per env, for async records (infos); larger ones are fetched
CLOSE_GRACE_S = 5.0



def default_num_workers(num_envs: int, caller_steps: bool, async_mode: bool = False) -> int:
    """One stepping process per usable CPU, the caller counting as one: it
    steps a slice itself, or in async mode it runs the user's policy while
    the workers step (CartPole x64, a torch MLP, 2 CPUs: one worker beside
    the caller made 95k steps/s, two 73k, medians of 4 fresh processes)."""
    slots = usable_cpus() - (1 if caller_steps or async_mode else 0)
    cap = num_envs - (1 if caller_steps else 0)
    return max(0, min(slots, cap)) if caller_steps else max(1, min(slots, cap))


def plan_slices(num_envs: int, num_workers: int | None, caller_steps: bool | None,
                async_mode: bool) -> tuple[int, bool]:
    """(num_workers, caller_steps) for `num_envs` envs.

    Left to shmvec (``None``): one stepping process per CPU, the caller
    counting as one: it steps a slice (it would idle otherwise), except in
    async mode, where send() must return at once and the caller's CPU runs
    the user's policy. With an explicit `num_workers`, every worker
    gets at least one env, and the caller steps a slice of its own only if
    envs are left after that (unless told otherwise)."""
    if num_workers is not None and num_workers > num_envs:
        raise ValueError(f"num_workers={num_workers} is more than the {num_envs} envs: "
                         "each worker needs at least one env")
    if caller_steps is None:
        caller_steps = not async_mode and (num_workers is None or num_workers < num_envs)
    if num_workers is None:
        num_workers = default_num_workers(num_envs, caller_steps, async_mode)
    if caller_steps and num_workers >= num_envs:
        raise ValueError(f"caller_steps=True needs an env for the caller besides one per worker: "
                         f"{num_envs} envs for num_workers={num_workers}")
    if num_workers == 0 and not caller_steps:
        raise ValueError("num_workers=0 needs caller_steps=True (someone has to step the envs)")
    return int(num_workers), bool(caller_steps)


# The caller's slice, as a fraction of an even share: besides its envs the
# caller runs the front end and the user's own loop (the policy), and a
# worker that finishes first only waits (on HalfCheetah x16, 2 CPUs, 7 and 9
# envs stepped faster than 8 and 8 in interleaved passes).
CALLER_SHARE = 7 / 8


def split_slices(num_envs: int, num_slices: int, caller_first: bool = False) -> list[range]:
    """Contiguous slices whose sizes differ by at most one, the larger ones
    last. With `caller_first`, the first slice is the caller's, a little
    smaller than an even share (CALLER_SHARE)."""
    if caller_first and num_slices > 1:
        size = min(max(1, round(num_envs / num_slices * CALLER_SHARE)), num_envs - (num_slices - 1))
        rest = split_slices(num_envs - size, num_slices - 1)
        return [range(0, size)] + [range(size + r.start, size + r.stop) for r in rest]
    base, extra = divmod(num_envs, num_slices)
    out, start = [], 0
    for k in range(num_slices):
        size = base + (1 if k >= num_slices - extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _check_pin_workers(pin: Any) -> None:
    if isinstance(pin, bool) or pin == "auto":
        return
    if not isinstance(pin, Sequence) or isinstance(pin, str):
        raise TypeError(f"pin_workers must be \"auto\", False, True or a list of CPU ids, got {pin!r}")
    allowed = set(allowed_cpu_ids())
    for cpu in pin:
        if isinstance(cpu, bool) or not isinstance(cpu, (int, np.integer)):
            raise TypeError(f"pin_workers must list CPU ids (ints), got {cpu!r}")
        if cpu not in allowed:
            raise ValueError(f"pin_workers lists CPU {cpu}, but this process may only run on CPUs {sorted(allowed)}")


@dataclass
class _Command:
    """A command begun and not yet finished; the caller's slice result is
    kept so that an interrupted wait can be resumed."""

    code: int
    caller_fn: Callable[[EnvSlice], Any]
    plain_step: bool
    collect: Callable[[Any, list[bytes]], Any] | None  # (caller's result, replies) -> the result
    caller_done: bool = False
    caller_result: Any = None
    caller_error: BaseException | None = None


def check_observation_spaces(spaces: list, observation_mode: Any) -> Any:
    """The single observation space the arena is laid out for, after
    checking the envs' spaces as SyncVectorEnv does for `observation_mode`
    ("same", "different", or a (batched, single) pair of spaces)."""
    if observation_mode == "same":
        single = spaces[0]
        for row, space in enumerate(spaces):
            if space != single:
                raise RuntimeError(
                    "ShmVecEnv(..., observation_mode='same') however the sub-environments observation spaces "
                    f"are not equivalent. single_observation_space={single}, sub-environment {row} "
                    f"observation_space={space}. If this is intentional, use `observation_mode='different'` instead."
                )
        return single
    # Gymnasium 1.x only, as observation_mode (the front end refuses it on 0.29)
    from gymnasium.spaces.utils import is_space_dtype_shape_equiv

    single = spaces[0] if observation_mode == "different" else observation_mode[1]
    for row, space in enumerate(spaces):
        if not is_space_dtype_shape_equiv(space, single):
            raise RuntimeError(
                "ShmVecEnv(..., observation_mode='different' or custom space) however the sub-environments "
                f"observation spaces do not share a common shape and dtype, single_observation_space={single}, "
                f"sub-environment {row} observation space={space}"
            )
    return single


def _still_pending(timeout: float) -> ShmVecTimeoutError:
    return ShmVecTimeoutError(f"The call timed out after {timeout} second(s); it is still pending: "
                              "wait for it again (its results are kept), or close() the vector env")


def _raise_remote(error: P.RemoteError) -> None:
    exc = error.exc
    exc.__cause__ = RemoteTraceback(f"\n(in shmvec env {error.row})\n{error.tb}")
    raise exc


class Engine:
    """Steps `env_fns` in `num_workers` processes (and, with `caller_steps`,
    one slice in the calling process), all through one shared arena."""

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        *,
        num_workers: int | None = None,
        caller_steps: bool | None = None,
        pin_workers: bool | str | Sequence[int] = "auto",
        start_method: str | None = None,
        autoreset_code: int = 0,
        timeout: float | None = None,
        async_mode: bool = False,
        restart_failed_workers: bool = False,
        max_restarts: int = 10,
        observation_mode: Any = "same",
        torch_threads: str | int | None = "auto",
    ):
        if not IS_LINUX:
            raise OSError(
                "shmvec runs on Linux only (it needs memfd and futex); "
                "use gymnasium.vector.SyncVectorEnv or AsyncVectorEnv on this platform"
            )
        env_fns = list(env_fns)
        if not env_fns:
            raise ValueError("env_fns is empty: pass at least one env factory")
        if not all(callable(fn) for fn in env_fns):
            raise TypeError("env_fns must be callables that each return a gymnasium.Env")
        if num_workers is not None and (not isinstance(num_workers, (int, np.integer)) or isinstance(num_workers, bool)):
            raise TypeError(f"num_workers must be an int or None, got {num_workers!r}")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
                raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
            if not timeout > 0:
                raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
            if timeout == float("inf"):
                timeout = None
        start_method = start_method or "forkserver"
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        _check_pin_workers(pin_workers)
        check_torch_threads(torch_threads)

        if async_mode and caller_steps:
            raise ValueError("in async mode the caller cannot step envs itself: use caller_steps=False")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, (int, np.integer)) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        self.restart_failed_workers = bool(restart_failed_workers)
        self.max_restarts = int(max_restarts)
        self.restarts = 0
        # Workers that died or hung during the current command, with why;
        # rows of the envs restarted by the last command (or recv).
        self._failed: list[tuple[int, str]] = []
        self.restarted_rows: list[int] = []
        self.num_envs = len(env_fns)
        self.async_mode = async_mode
        num_workers, caller_steps = plan_slices(self.num_envs, num_workers, caller_steps, async_mode)
        num_slices = num_workers + (1 if caller_steps else 0)
        # Released by close(), or when the engine is collected unclosed.
        self._torch_threads = weakref.finalize(self, TorchThreads(torch_threads, num_workers).release)
        self.num_workers = num_workers
        self.timeout = -1.0 if timeout is None else float(timeout)
        self.start_method = start_method
        self.closed = False
        self.broken: str | None = None  # why the engine can no longer step
        self.caller_interrupted = False  # the caller's slice stopped mid-batch (Ctrl-C)
        self._command: _Command | None = None  # begun, results not yet collected
        self._processes: list[mp.process.BaseProcess] = []
        self._cpus: list[int | None] = []
        self._caller: EnvSlice | None = None

        self._caller_steps = bool(caller_steps)
        slices = split_slices(self.num_envs, num_slices, caller_first=caller_steps)
        caller_rows = slices.pop(0) if caller_steps else None
        self.worker_rows = slices
        # fds to close at shutdown: [parent pipe's write end, arena memfd,
        # parent pipe's read end]; the last two stay open to restart workers.
        self._fds = [-1, -1, -1]
        # If the engine is garbage-collected unclosed, workers still go away.
        self._finalizer = weakref.finalize(self, _shutdown, self._processes, self._cpus, self._fds, 1.0)
        try:
            self._start_workers(env_fns, pin_workers)
            if caller_rows is not None:
                factories = [env_fns[i] for i in caller_rows]
                self._caller = EnvSlice(make_envs(factories, caller_rows.start), caller_rows.start)
            self._describe_and_attach(autoreset_code, observation_mode)
        except BaseException:
            try:
                self.close(terminate=True)
            except Exception:  # the first error is the one to report
                pass
            raise

    # -- set-up -------------------------------------------------------------

    def _start_workers(self, env_fns, pin_workers) -> None:
        w = self.num_workers
        fixed = _core.fixed_region_size(w, REQUEST_CAPACITY, REPLY_CAPACITY)
        self._fixed_size = fixed
        self._fds[1] = _core.create_shared_file(fixed)
        self._boot = _core.Mapping(self._fds[1], fixed)
        self._channel = _core.FrontChannel(self._boot, w, REQUEST_CAPACITY, REPLY_CAPACITY, True)
        buf = memoryview(self._boot)
        self._request_areas, self._reply_areas = [], []
        for k in range(w):
            req, rep = _core.area_offsets(w, REQUEST_CAPACITY, REPLY_CAPACITY, k)
            self._request_areas.append(buf[req:req + REQUEST_CAPACITY])
            self._reply_areas.append(buf[rep:rep + REPLY_CAPACITY])
        self._sentinels: list[int] = []
        if w == 0:
            return
        # The parent-alive pipe: workers get the read end; only we hold the
        # write end. We keep the read end too, for workers started later.
        self._fds[2], self._fds[0] = os.pipe()
        PARENT_ONLY_FDS.add(self._fds[0])
        cpus, locks = choose_cpus(w, pin_workers, leave_free=1 if self._caller_steps or self.async_mode else 0)
        self._cpus[:] = cpus
        self._fds += locks  # closed at shutdown, which frees the CPUs
        PARENT_ONLY_FDS.update(locks)
        self._factories = [cloudpickle.dumps([env_fns[i] for i in rows]) for rows in self.worker_rows]
        for k in range(w):
            self._processes.append(self._spawn(k))
        self._sentinels[:] = [p.sentinel for p in self._processes]
        self._channel.post(list(range(w)), P.DESCRIBE)

    def _spawn(self, k: int) -> mp.process.BaseProcess:
        """Starts the process of worker `k` (it then waits for DESCRIBE)."""
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Workers start in milliseconds when the server has these loaded.
            ctx.set_forkserver_preload(["shmvec.worker"])
        spec = WorkerSpec(
            index=k, num_workers=self.num_workers, first_row=self.worker_rows[k].start,
            factories=self._factories[k], arena=FdHandle(self._fds[1]), fixed_size=self._fixed_size,
            request_capacity=REQUEST_CAPACITY, reply_capacity=REPLY_CAPACITY,
            parent_alive=FdHandle(self._fds[2]),
            start_method=self.start_method, cpu=self._cpus[k],
        )
        p = ctx.Process(target=worker_main, args=(spec,), name=f"shmvec-worker-{k}", daemon=True)
        p.start()
        return p

    def _describe_and_attach(self, autoreset_code: int, observation_mode: Any) -> None:
        descriptions = []
        if self._caller is not None:
            descriptions.append(self._caller.describe())
        if self.num_workers:
            replies = self._collect(range(self.num_workers))
            descriptions += [P.loads(r) for r in replies]
        first = descriptions[0]
        observation_spaces = [space for d in descriptions for space in d["observation_spaces"]]
        action_spaces = [space for d in descriptions for space in d["action_spaces"]]
        single_obs = check_observation_spaces(observation_spaces, observation_mode)
        for row, space in enumerate(action_spaces):
            if space != action_spaces[0]:
                raise RuntimeError(
                    f"Some environments have an action space different from `{action_spaces[0]}` "
                    f"(env {row}: `{space}`). In order to batch actions, the action spaces from all "
                    "environments must be equal."
                )
        self.description = {
            "observation_space": single_obs,
            "observation_spaces": observation_spaces,
            "action_space": action_spaces[0],
            "metadata": first["metadata"],
            "render_mode": first["render_mode"],
        }
        obs_space, act_space = single_obs, action_spaces[0]
        async_size = 0
        if self.async_mode:
            async_size = _core.async_region_size(self.num_envs, self.num_workers, RECORD_CAPACITY)
        self.layout = DataLayout(obs_space, act_space, self.num_envs, self._fixed_size,
                                 async_size, RECORD_CAPACITY)
        total = self._fixed_size + self.layout.size
        _core.resize_shared_file(self._fds[1], total)
        self._data = _core.Mapping(self._fds[1], total)
        self.views = self.layout.views(self._data)
        engine = weakref.ref(self)  # no cycle: an engine dropped unclosed is collected at once
        self.info_columns = None if self.async_mode else InfoColumns(
            self.views["info_values"], self.views["info_flags"], self._slice_rows(),
            lambda k: engine()._info_schema(k))
        self.views["action_dtypes"][:] = self.layout.action_space_codes  # until the first batch
        if self._caller is not None:
            self._caller.attach(self.layout, self._data, obs_space, act_space, autoreset_code)
        if self.async_mode:
            # Restarts: when each worker last finished an env (or had none in flight).
            self._progress = [(0, time.monotonic())] * self.num_workers
            self._next_check = 0.0
            owner = [w for w, rows in enumerate(self.worker_rows) for _ in rows]
            self._channel.attach_async(self._data, self.layout.async_offset, self.num_envs,
                                       RECORD_CAPACITY, owner)
        if self.num_workers:
            self._attach_request = P.dumps((self.layout, obs_space, act_space, autoreset_code))
            self._post(P.ATTACH, [self._attach_request] * self.num_workers)
            self._collect(range(self.num_workers))

    def _slice_rows(self) -> list[range]:
        """The rows of every slice: the caller's first, then each worker's."""
        return ([self._caller.rows] if self._caller is not None else []) + list(self.worker_rows)

    def _info_schema(self, k: int):
        """Slice k's info-column schema (see shmvec.info_columns)."""
        if self._caller is not None:
            if k == 0:
                return self._caller.stepper.info_schema
            k -= 1
        self._post(P.INFO_SCHEMA, None, [k])
        return P.loads(self._collect([k])[0])

    # -- commands -----------------------------------------------------------

    def check_usable(self) -> None:
        if self.broken:
            raise ShmVecError(self.broken)

    def _wait(self, restart: bool = False, call_timeout: float | None = None,
              call_deadline: float | None = None) -> None:
        """Waits for the posted workers. A call's deadline that comes before
        the engine's timeout raises ShmVecTimeoutError and leaves the command
        in flight; the engine's own timeout counts a worker as hung."""
        limit, by_call = self.timeout, False
        if call_deadline is not None:
            left = max(call_deadline - time.monotonic(), 0.0)
            if limit < 0 or left < limit:
                limit, by_call = left, True
        code = self._channel.wait(self._sentinels, limit)
        while code != 0 and not (code < 0 and by_call) and restart and self.restart_failed_workers:
            # Give up on the failed workers' part of this command, finish
            # waiting for the others; _restart_failed() replaces them after.
            if code > 0:
                failed = [(code - 1, self._exit_cause(code - 1))]
            else:
                failed = [(w, f"hung for more than timeout={self.timeout} s") for w in self._channel.busy_workers()]
            for w, cause in failed:
                self._channel.abandon(w)
                self._processes[w].kill()
                self._processes[w].join(timeout=CLOSE_GRACE_S)
                self._failed.append((w, cause))
            code = self._channel.wait(self._sentinels, limit)
        if code < 0 and by_call:
            raise _still_pending(call_timeout)
        self._check_wait(code)

    def _exit_cause(self, w: int) -> str:
        p = self._processes[w]
        p.join(timeout=1.0)
        return f"died, {describe_exit(p.exitcode)}"

    def _restart_failed(self) -> None:
        """Replaces failed workers with fresh ones that rebuild their envs
        from the same factories. The envs are marked restarted: each one's
        next step, whatever its action, reports its episode cut short as its
        autoreset mode reports a truncation (Stepper.mark_restarted). Their
        rows go to `restarted_rows`."""
        failed, self._failed = self._failed, []
        for w, cause in failed:
            if self.restarts >= self.max_restarts:
                self.broken = (f"shmvec worker {w} failed ({cause}) and the restart budget "
                               f"max_restarts={self.max_restarts} is spent; close this vector env")
                raise WorkerDiedError(w, self.worker_rows[w], self._processes[w].exitcode, self.broken)
            self.restarts += 1
            self._processes[w].close()
            if self.async_mode:  # what it had in flight is lost: the front end sends it again
                self._channel.reset_async_worker(w)
            self._channel.post([w], P.DESCRIBE)  # before it starts: the first command it sees
            self._processes[w] = self._spawn(w)
            self._sentinels[w] = self._processes[w].sentinel
            self._collect([w])
            self._post(P.ATTACH, [self._attach_request], [w])
            self._collect([w])
            self._post(P.MARK_RESTARTED, None, [w])
            self._collect([w])
            if self.info_columns is not None:
                self.info_columns.forget(w + (1 if self._caller is not None else 0))
            self.restarted_rows += list(self.worker_rows[w])

    def mark_restarted(self) -> None:
        """Marks every env restarted (a Ray actor that was rebuilt)."""
        if self._caller is not None:
            self._caller.mark_restarted()
        if self.num_workers:
            self._post(P.MARK_RESTARTED, None)
            self._collect(range(self.num_workers))

    def _check_wait(self, code: int) -> None:
        """Turns a failed wait into TimeoutError or WorkerDiedError."""
        if code == 0:
            return
        if code < 0:
            self.broken = (
                f"a shmvec command timed out after {self.timeout} s; the vector env can only be closed"
            )
            raise ShmVecTimeoutError(
                f"shmvec workers did not answer within timeout={self.timeout} s "
                "(an env may hang); close() the vector env"
            )
        worker = code - 1
        p = self._processes[worker]
        p.join(timeout=1.0)
        error = WorkerDiedError(worker, self.worker_rows[worker], p.exitcode)
        self.broken = str(error)
        raise error

    def drain(self) -> None:
        """Waits out (and discards) a command whose results nobody will read:
        the workers' part of a batch whose caller slice was interrupted."""
        if self.num_workers and self._channel.busy:
            self._wait()

    def _read_replies(self, workers) -> list[bytes]:
        """Each finished worker's reply, fetching chunks of large ones; the
        first env error (by env index) is raised after every reply is in."""
        replies, errors = [], []
        for w in workers:
            status, length, total = self._channel.result(w)
            data = bytes(self._reply_areas[w][:length])
            while len(data) < total:
                self._channel.post([w], P.REPLY_CHUNK)
                self._wait()
                _, length, _ = self._channel.result(w)
                data += bytes(self._reply_areas[w][:length])
            if status == P.ERROR:
                errors.append(P.loads(data))
            else:
                replies.append(data)
        if errors:
            _raise_remote(min(errors, key=lambda e: e.row))
        return replies

    def _collect(self, workers) -> list[bytes]:
        self._wait()
        return self._read_replies(workers)

    _request_tag = 0  # the tag of the last request posted

    def _post(self, code: int, requests: list[bytes] | None, workers=None) -> None:
        """Posts a command to every worker (or those listed); requests larger
        than the request area go ahead in chunks. Chunks and their command
        carry the request's tag (arg): a worker drops chunks of a transfer that
        was cut short (Ctrl-C) instead of gluing them to the next request."""
        self._request_tag = tag = self._request_tag % 0xFFFFFFFF + 1
        workers = list(range(self.num_workers)) if workers is None else list(workers)
        lens = []
        for k, w in enumerate(workers):
            data = requests[k] if requests else b""
            area = self._request_areas[w]
            while len(data) > REQUEST_CAPACITY:
                area[:REQUEST_CAPACITY] = data[:REQUEST_CAPACITY]
                self._channel.post([w], P.REQUEST_CHUNK, tag, [REQUEST_CAPACITY])
                self._wait()
                data = data[REQUEST_CAPACITY:]
            area[:len(data)] = data
            lens.append(len(data))
        self._channel.post(workers, code, tag, lens)

    @property
    def in_flight(self) -> bool:
        """A command was begun and its results are still to be collected."""
        return self._command is not None

    def begin(self, code: int, caller_fn: Callable[[EnvSlice], Any], requests: list[bytes] | None = None,
              collect: Callable[[Any, list[bytes]], Any] | None = None) -> None:
        """Starts one command: the workers' part is posted (they start at
        once); the caller's own slice runs in finish(), so that begin()
        returns at once, as AsyncVectorEnv's *_async calls do."""
        self.check_usable()
        if self._command is not None:
            raise RuntimeError("a shmvec command is already in flight: finish() it first")
        self.drain()
        self.restarted_rows = []
        plain_step = code == P.STEP and requests is None
        if self.num_workers:
            if plain_step:
                self._channel.post_step_all()
            else:
                self._post(code, requests)
        self._command = _Command(code, caller_fn, plain_step, collect)

    def finish(self, timeout: float | None = None):
        """Runs the caller's slice, then waits for the workers; returns the
        command's result. Env errors are raised only
        once every slice is done, so nothing is left in flight.

        If `timeout` seconds pass first (``ShmVecTimeoutError``) or the wait is
        interrupted (``KeyboardInterrupt``), the command stays in flight and
        finish() may be called again: no result is lost. If the caller's own
        slice is interrupted, its batch is half done: the command is dropped
        (``caller_interrupted``) and the workers' part is drained later."""
        command = self._command
        if command is None:
            raise RuntimeError("no shmvec command is in flight")
        self.check_usable()
        self.caller_interrupted = False
        deadline = None if timeout is None else time.monotonic() + timeout
        if not command.caller_done:
            command.caller_done = True
            if self._caller is not None:
                try:
                    command.caller_result = command.caller_fn(self._caller)
                except Exception as exc:
                    command.caller_error = exc
                except BaseException:  # KeyboardInterrupt: workers finish; drain() waits for them
                    self._command = None
                    self.caller_interrupted = True
                    raise
        if deadline is not None and time.monotonic() > deadline:
            # The caller's own slice took the whole time: the call did not
            # complete within `timeout`, though its results are not lost.
            raise _still_pending(timeout)
        replies: list[bytes] = []
        if self.num_workers:
            try:
                self._wait(restart=True, call_timeout=timeout, call_deadline=deadline)
            except (ShmVecTimeoutError, KeyboardInterrupt) as exc:
                if not self.broken:
                    raise  # still in flight: finish() may be called again
                self._command = None
                raise command.caller_error or exc
            except Exception:
                self._command = None
                if command.caller_error is not None:
                    raise command.caller_error from None
                raise
            self._command = None
            try:
                failed = {w for w, _ in self._failed}
                # On the step path only workers with infos or episode ends reply.
                if command.plain_step:
                    workers = self._channel.workers_with_replies()
                else:
                    workers = [w for w in range(self.num_workers) if w not in failed]
                replies = self._read_replies(workers)
                if failed:
                    self._restart_failed()
                    restarted = sorted(failed)
                    if command.code == P.STEP:  # their next step is their restart report: take it now
                        self._post(P.STEP, None, restarted)
                        replies += self._collect(restarted)
                    elif command.code == P.RESET:  # reset them, as asked (without seeds)
                        reset = [cloudpickle.dumps(([None] * len(self.worker_rows[w]), None, None)) for w in restarted]
                        self._post(P.RESET, reset, restarted)
                        replies += self._collect(restarted)
                    else:  # their results are lost, not replaced
                        raise ShmVecError(f"shmvec workers {restarted} failed during this call and were "
                                          "restarted (their next step reports it); call again")
            except Exception:
                if command.caller_error is None:
                    raise
        self._command = None
        if command.caller_error is not None:
            raise command.caller_error  # the caller's envs come first by index
        if command.collect is None:
            return None
        return command.collect(command.caller_result, replies)

    # -- the operations front ends use ------------------------------------
    # Each is begin_X(...) then finish(timeout), or X(...) for both at once;
    # finish() returns what X returns.

    def begin_step(self, object_actions: list | None = None) -> None:
        """Steps every env with the actions already written to the arena
        (`object_actions`: per-env values of action leaves without a fixed
        shape). Its result: the records, in env order, of envs with infos,
        ended SAME_STEP episodes or observation leaves without a fixed shape."""
        if object_actions is None:
            self.begin(P.STEP, EnvSlice.step, collect=self._step_records)
        else:
            requests = [P.dumps([object_actions[i] for i in rows]) for rows in self.worker_rows]
            self.begin(P.STEP, lambda s: s.step([object_actions[i] for i in s.rows]), requests,
                       collect=self._step_records)

    def step(self, object_actions: list | None = None) -> list:
        self.begin_step(object_actions)
        return self.finish()

    def _step_records(self, caller_records, replies: list[bytes]) -> list:
        records = self._merge(caller_records, replies)
        if self.restarted_rows:  # their restart reports came last
            records.sort(key=lambda record: record[0])
        return records

    @staticmethod
    def _merge(caller_records, replies: list[bytes]) -> list:
        records = list(caller_records) if caller_records else []
        for data in replies:
            if data:
                part = P.loads(data)
                if part:
                    records.extend(part)
        return records

    # -- async mode -------------------------------------------------------------

    def send(self, rows: list[int]) -> None:
        """Queues envs (whose actions are in the arena) to their workers."""
        self.check_usable()
        if self.restart_failed_workers:
            self._progress_hung(time.monotonic())  # a worker given work now starts its clock now
        self._channel.send(rows)

    def recv(self, count: int) -> list[int]:
        """Waits for `count` envs to finish; returns their rows in finishing
        order. With restarts, a worker found dead or hung (now, or every
        CHECK_EVERY_S while other envs keep coming) is replaced instead:
        then it returns [] and `restarted_rows` says which envs are new (the
        front end sends again those it had in flight)."""
        self.check_usable()
        self.restarted_rows = []
        if self.restart_failed_workers and time.monotonic() >= self._next_check and self._restart_async():
            return []
        code, rows = self._channel.recv(count, self._sentinels, self.timeout)
        if code != 0 and self.restart_failed_workers and self._restart_async():
            return []
        self._check_wait(code)
        return rows

    CHECK_EVERY_S = 0.02

    def _restart_async(self) -> bool:
        """Replaces async workers that died, or that have had envs in flight
        and finished none for `timeout` seconds; whether it did."""
        now = time.monotonic()
        self._next_check = now + self.CHECK_EVERY_S
        dead = self._channel.first_dead(self._sentinels) - 1
        if dead >= 0:
            self._failed.append((dead, self._exit_cause(dead)))
        self._failed += [(w, f"hung for more than timeout={self.timeout} s")
                         for w in self._progress_hung(now) if w != dead]
        for w, _ in self._failed:
            self._processes[w].kill()
            self._processes[w].join(timeout=CLOSE_GRACE_S)
            self._progress[w] = (0, now)  # its rings start again from 0
        if not self._failed:
            return False
        self._restart_failed()
        return True

    def _progress_hung(self, now: float) -> list[int]:
        """Notes when each worker last finished an env (or had none in
        flight); returns those with envs in flight and none finished for
        `timeout` seconds."""
        hung = []
        for w, (done, left) in enumerate(self._channel.async_progress()):
            if done != self._progress[w][0] or not left:
                self._progress[w] = (done, now)
            elif self.timeout >= 0 and now - self._progress[w][1] >= self.timeout:
                hung.append(w)
        return hung

    def wait_finished(self, count: int, timeout: float) -> bool:
        """Waits up to `timeout` seconds for `count` envs to finish, popping
        nothing; True when they did or a worker died (recv() then handles
        it). Only reads shared memory: another thread may send() meanwhile."""
        self.check_usable()
        return self._channel.wait_finished(count, self._sentinels, timeout) != -1

    def async_record(self, row: int):
        """The record of an env's last async step (None if it has none);
        raises the env's exception if the step failed."""
        length, is_error, overflow = self._channel.record(row)
        if not length:
            return None
        if overflow:
            owner = next(w for w, rows in enumerate(self.worker_rows) if row in rows)
            self._post(P.FETCH_RECORD, [P.dumps(row)], [owner])
            data = P.loads(self._collect([owner])[0])
        else:
            data = self._channel.record_bytes(row)
        record = P.loads(data)
        if is_error:
            _raise_remote(record)
        return record

    def begin_reset(self, seeds: list, options: dict | None, mask: np.ndarray | None) -> None:
        """Resets the envs (those in `mask`); its result: records like a step's."""
        def part(rows):
            return (
                [seeds[i] for i in rows],
                options,
                None if mask is None else mask[rows.start:rows.stop].copy(),
            )

        requests = [cloudpickle.dumps(part(rows)) for rows in self.worker_rows]
        self.begin(P.RESET, lambda s: s.reset(*part(s.rows)), requests, collect=self._merge)

    def reset(self, seeds: list, options: dict | None, mask: np.ndarray | None) -> list:
        self.begin_reset(seeds, options, mask)
        return self.finish()

    def begin_call(self, name: str, args: tuple = (), kwargs: dict | None = None,
                   rows: Sequence[int] | None = None) -> None:
        """Calls (or reads) `name` on the envs in `rows` (all by default); its
        result: the values in the order of `rows`."""
        kwargs = kwargs or {}
        rowset = None if rows is None else sorted(set(int(r) for r in rows))
        request = cloudpickle.dumps((name, args, kwargs, rowset))

        def collect(caller_result, replies):
            results = list(caller_result or [])
            for data in replies:
                results.extend(P.loads(data))
            if rows is not None:  # back to the order (and repeats) the caller asked for
                by_row = dict(zip(rowset, results))
                return [by_row[int(r)] for r in rows]
            return results

        self.begin(P.CALL, lambda s: s.call(name, args, kwargs, rowset), [request] * self.num_workers,
                   collect=collect)

    def call(self, name: str, args: tuple = (), kwargs: dict | None = None,
             rows: Sequence[int] | None = None) -> list:
        self.begin_call(name, args, kwargs, rows)
        return self.finish()

    def set_attr(self, name: str, values: Sequence[Any]) -> None:
        requests = [cloudpickle.dumps((name, [values[i] for i in rows])) for rows in self.worker_rows]
        caller_rows = self._caller.rows if self._caller is not None else range(0)
        self.begin(P.SET_ATTR, lambda s: s.set_attr(name, [values[i] for i in caller_rows]), requests)
        self.finish()

    # -- shutdown -------------------------------------------------------------

    def close(self, terminate: bool = False) -> None:
        """Closes envs and workers; with `terminate` (or when a worker is dead
        or hung) kills workers at once. Idempotent and bounded in time.
        Afterwards no worker, fd or mapping of ours remains."""
        if self.closed:
            return
        self.closed = True
        self._command = None  # its results are not wanted any more; drain() waits it out
        errors: list[BaseException] = []
        graceful = bool(self._processes) and not terminate and not self.broken
        if graceful:
            # Bounded even if an env hangs and no timeout was set.
            self.timeout = CLOSE_GRACE_S if self.timeout < 0 else min(self.timeout, CLOSE_GRACE_S)
            try:
                self.drain()
                self._post(P.CLOSE, None)
                self._collect(range(self.num_workers))
            except BaseException as exc:  # a broken worker must not stop the shutdown
                errors.append(exc)
                graceful = False
        if self._caller is not None:
            try:
                self._caller.close()
            except Exception as exc:
                errors.append(exc)
            self._caller = None
        self._finalizer.detach()
        self._torch_threads()
        _shutdown(self._processes, self._cpus, self._fds, CLOSE_GRACE_S if graceful else 0.0)
        # Drop our views so the mappings go away (user-held copy=False views
        # keep theirs alive, as any numpy view keeps its buffer).
        self.views = self.info_columns = None
        self._request_areas = self._reply_areas = []
        self._data = self._boot = None
        self._channel = None
        for exc in errors:
            if not isinstance(exc, (WorkerDiedError, TimeoutError, ShmVecError)):
                raise exc


def _shutdown(processes: list, cpus: list, fds: list[int], grace: float) -> None:
    """Closes our fds (workers see end-of-file on the parent pipe and exit),
    gives workers `grace` seconds in all, then kills what is left."""
    for k, fd in enumerate(fds):
        if fd >= 0:
            PARENT_ONLY_FDS.discard(fd)
            os.close(fd)
            fds[k] = -1
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(timeout=CLOSE_GRACE_S)
        p.close()
    processes.clear()
    cpus.clear()
