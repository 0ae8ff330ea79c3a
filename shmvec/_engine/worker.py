"""Entry point and command loop of a worker process.

A worker maps the arena, builds its slice of envs from cloudpickled
factories, and then serves commands: steps natively (``WorkerChannel.serve``
never returns to Python for a plain step), everything else here.
"""

from __future__ import annotations

import gc
import os
import signal
from dataclasses import dataclass
from multiprocessing import reduction

import cloudpickle
import gymnasium  # noqa: F401  (preloaded by the fork server with numpy)
import numpy  # noqa: F401

from shmvec import _core
from shmvec._engine import protocol as P
from shmvec._engine.caller_state import CallerRegistrations, take_environ, take_warning_filters
from shmvec._engine.system import close_arena_fds, pin_to_cpu
from shmvec._engine.env_slice import EnvSlice, make_envs
from shmvec._engine.thread_pools import hold_env_pools, hold_worker_pools
from shmvec._engine.warning_relay import WorkerRelay

__all__ = ["FdHandle", "WorkerSpec", "main", "CLOSE_GRACE_S"]

# How long a closing worker has to exit on its own: the front end's close()
# waits this long before it kills one, and a worker whose front end died
# (its parent pipe hung up) ends itself this long after, even mid-step.
CLOSE_GRACE_S = 5.0


def _rebuild_fd(dup: reduction.DupFd) -> "FdHandle":
    return FdHandle(dup.detach())


class FdHandle:
    """A file descriptor that survives every start method: inherited as is
    under fork, duplicated into the child (``DupFd``) when pickled for
    forkserver or spawn."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return (_rebuild_fd, (reduction.DupFd(self.fd),))


@dataclass
class WorkerSpec:
    index: int
    num_workers: int
    first_row: int
    factories: bytes  # cloudpickled list of env factories for this slice
    arena: FdHandle
    fixed_size: int
    request_capacity: int
    reply_capacity: int
    parent_alive: FdHandle  # read end of a pipe only the front end writes to
    start_method: str
    cpu: int | None
    environ: dict[str, str] | None = None  # the caller's variables, where not inherited (caller_state)
    registrations: dict[str, bytes] | None = None  # the caller's registered specs, where not inherited
    warning_filters: list[bytes] | None = None  # the caller's warning filters, where not inherited


def main(spec: WorkerSpec) -> None:
    # Ctrl-C reaches the whole process group; the front end decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.environ is not None:  # first: the pools' caps below are set in it
        take_environ(spec.environ)
    if spec.warning_filters is not None:
        take_warning_filters(spec.warning_filters)
    relay = WorkerRelay()  # what the filters show goes to the caller, with the reply
    relay.install()
    if spec.start_method == "fork":
        # The parent-only fds are closed already (a fork hook in system.py).
        # Everything else inherited is the front end's: never finalize it
        # here (a vector env's __del__ would close the parent's engine), and
        # let go of every arena, so that each is freed when its engine
        # closes: the mappings (we map our own below) and the memfds but ours.
        gc.freeze()
        _core.unmap_all()
        close_arena_fds(keep=spec.arena.fd)
    if spec.cpu is not None:
        pin_to_cpu(spec.cpu)
    # Between steps the worker sees its parent die; this also ends it inside
    # a step that takes long or never returns.
    _core.exit_when_hung_up(spec.parent_alive.fd, int(CLOSE_GRACE_S * 1e9), 0)
    hold_worker_pools()
    boot = _core.Mapping(spec.arena.fd, spec.fixed_size)
    channel = _core.WorkerChannel(boot, spec.index, spec.num_workers, spec.request_capacity,
                                  spec.reply_capacity, spec.parent_alive.fd)
    try:
        Worker(spec, channel, boot, relay).run()
    finally:
        relay.show_here()  # what no reply took (a close's last words, a front end gone)


class Worker:
    def __init__(self, spec: WorkerSpec, channel: _core.WorkerChannel, boot: _core.Mapping, relay: WorkerRelay):
        self.spec = spec
        self.channel = channel
        self.relay = relay
        buf = memoryview(boot)
        req_off, rep_off = _core.area_offsets(spec.num_workers, spec.request_capacity,
                                              spec.reply_capacity, spec.index)
        self.request_area = buf[req_off:req_off + spec.request_capacity]
        self.reply_area = buf[rep_off:rep_off + spec.reply_capacity]
        self.slice: EnvSlice | None = None
        self.setup_error: P.RemoteError | None = None
        self.data_mapping = None
        self.chunks: list[bytes] = []  # of a request larger than the request area
        self.chunk_tag = 0  # the tag (arg) of the request they belong to
        self.overflow: dict[int, bytes] = {}  # async records too large for their slots

    def run(self) -> None:
        command = self._next_command()
        if command[0] == P.STARTED:  # the process runs: `timeout` counts from here (pool.wait_started)
            self.channel.complete(P.OK)
            command = None
        elif command[0] == 0:  # the front end is gone
            return
        try:
            factories = cloudpickle.loads(self.spec.factories)
            envs = make_envs(factories, self.spec.first_row, CallerRegistrations(self.spec.registrations))
            self.slice = EnvSlice(envs, self.spec.first_row)
            hold_env_pools()
        except BaseException as exc:
            self.setup_error = P.RemoteError.capture(exc, getattr(exc, "shmvec_row", self.spec.first_row))
        while True:
            if command is None:
                command = self._next_command()
            code, arg, request_len, payload = command
            command = None
            if code == 0:  # the front end is gone
                return
            if payload is not None:  # a step reply too large for the reply area
                command = self._reply(P.OK, payload)
                continue
            request = bytes(self.request_area[:request_len])
            if code == P.REQUEST_CHUNK:
                if arg != self.chunk_tag:  # a new request: an earlier one was cut short
                    self.chunks.clear()
                    self.chunk_tag = arg
                self.chunks.append(request)
                self.channel.complete(P.OK)
                continue
            if self.chunks:
                if arg == self.chunk_tag:  # else they are stale: drop them
                    request = b"".join(self.chunks) + request
                self.chunks.clear()
            if code & P.TAKE_FILTERS:  # the caller changed its warning filters: this worker takes them
                code &= ~P.TAKE_FILTERS
                filters, request = P.split_prefixed(request)
                take_warning_filters(P.loads(filters))
            status, reply = self._handle(code, request)
            command = self._reply(status, reply)
            if code == P.CLOSE:
                return

    def _next_command(self):
        stepper = self.slice.stepper if self.slice is not None else None
        if stepper is None:
            cmd = self.channel.wait_command()
            return (0, 0, 0, None) if cmd is None else (*cmd, None)
        try:
            return self.channel.serve(stepper, P.dumps, self.relay.encode_error, self.overflow, self.relay)
        except BaseException as exc:  # an env failed during a natively served step
            error = P.RemoteError.capture(exc, stepper.failed_row)
            pending = self._reply(P.ERROR, P.dumps(error))
            return pending if pending is not None else self._next_command()

    def _handle(self, code: int, request: bytes) -> tuple[int, bytes]:
        failed_row = self.spec.first_row
        try:
            if code == P.DESCRIBE and self.setup_error is not None:
                return P.ERROR, P.dumps(self.setup_error)
            args = P.loads(request) if request else None
            if code == P.CLOSE:
                if self.slice is not None:
                    self.slice.close()
                return P.OK, b""
            if self.slice is None:
                raise RuntimeError("this worker failed to build its envs")
            result = self._dispatch(code, args)
            return P.OK, (b"" if result is None else P.dumps(result))
        except BaseException as exc:
            if self.slice is not None and self.slice.failed_row >= 0:
                failed_row = self.slice.failed_row
            return P.ERROR, P.dumps(P.RemoteError.capture(exc, failed_row))

    def _dispatch(self, code: int, args):
        s = self.slice
        if code == P.DESCRIBE:
            return s.describe()
        if code == P.ATTACH:
            layout, obs_space, act_space, autoreset_code, reset_call = args
            self.data_mapping = _core.Mapping(self.spec.arena.fd, layout.base_offset + layout.size)
            os.close(self.spec.arena.fd)  # the mappings keep the memory
            s.attach(layout, self.data_mapping, obs_space, act_space, autoreset_code, reset_call)
            if layout.async_offset is not None:
                self.channel.attach_async(self.data_mapping, layout.async_offset, layout.num_envs,
                                          layout.record_capacity, layout.async_rings)
            return None
        if code == P.FETCH_RECORD:
            return self.overflow[args]  # kept until the env's next step (see step_async_row)
        if code == P.STEP:  # a step whose actions have leaves without a fixed shape
            return s.step(args)
        if code == P.RESET:
            return s.reset(*args)
        if code == P.MARK_RESTARTED:
            return s.mark_restarted()
        if code == P.CALL:
            return s.call(*args)
        if code == P.SET_ATTR:
            return s.set_attr(*args)
        raise RuntimeError(f"unknown shmvec command {code}")

    def _reply(self, status: int, data: bytes):
        """Sends a reply, in chunks if it is larger than the reply area.
        Returns a command that arrived instead of a chunk request, if any."""
        status, data = self.relay.frame(status, data)
        capacity = len(self.reply_area)
        total = len(data)
        sent = min(total, capacity)
        self.reply_area[:sent] = data[:sent]
        self.channel.complete(status, sent, total)
        while sent < total:
            cmd = self.channel.wait_command()
            if cmd is None:
                return (0, 0, 0, None)
            if cmd[0] != P.REPLY_CHUNK:  # the front end gave up on this reply
                return (*cmd, None)
            n = min(total - sent, capacity)
            self.reply_area[:n] = data[sent:sent + n]
            sent += n
            self.channel.complete(status, n, total)
        return None
