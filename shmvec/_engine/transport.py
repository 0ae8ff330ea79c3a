"""Requests to the workers and their replies, through each worker's request
and reply areas of the arena (the step itself needs neither: its actions and
results are in the arena's arrays).

A request larger than its area goes ahead in chunks, a reply larger than its
area is fetched in chunks; an env error in a reply is raised in the caller as
the env's own exception, with the worker's traceback as its cause.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shmvec import _core
from shmvec._engine import protocol as P
from shmvec._engine import warning_relay
from shmvec.errors import RemoteTraceback

__all__ = ["Transport", "REQUEST_CAPACITY", "REPLY_CAPACITY", "raise_remote"]

REQUEST_CAPACITY = 64 * 1024
REPLY_CAPACITY = 1024 * 1024  # virtual until touched: pages are allocated on first write


def raise_remote(error: P.RemoteError) -> None:
    """Raises an env's exception that a worker sent back (after the warnings
    its env raised first)."""
    warning_relay.show(error.warnings)
    exc = error.exc
    exc.__cause__ = RemoteTraceback(f"\n(in shmvec env {error.row})\n{error.tb}")
    raise exc


class Transport:
    """Posts commands with their requests and reads the replies.

    `wait()` waits until every posted worker has finished (the worker pool's
    wait: it raises if one died or hung)."""

    def __init__(self, channel: _core.FrontChannel, boot: _core.Mapping, num_workers: int,
                 wait: Callable[[], None]):
        self.channel = channel
        self.num_workers = num_workers
        self._wait = wait
        buf = memoryview(boot)
        self._request_areas, self._reply_areas = [], []
        for k in range(num_workers):
            req, rep = _core.area_offsets(num_workers, REQUEST_CAPACITY, REPLY_CAPACITY, k)
            self._request_areas.append(buf[req:req + REQUEST_CAPACITY])
            self._reply_areas.append(buf[rep:rep + REPLY_CAPACITY])
        self._request_tag = 0  # the tag of the last request posted
        self.sending_chunks = False  # a request's chunks are going ahead of its command

    def post(self, code: int, requests: list[bytes] | None = None, workers: Iterable[int] | None = None) -> None:
        """Posts a command to every worker (or those listed); requests larger
        than the request area go ahead in chunks. Chunks and their command
        carry the request's tag (arg): a worker drops chunks of a transfer that
        was cut short (Ctrl-C) instead of gluing them to the next request."""
        self._request_tag = tag = self._request_tag % 0xFFFFFFFF + 1
        workers = list(range(self.num_workers)) if workers is None else list(workers)
        lens = []
        self.sending_chunks = True  # until the command itself is posted (see CommandRunner.begin)
        for k, w in enumerate(workers):
            data = requests[k] if requests else b""
            area = self._request_areas[w]
            while len(data) > REQUEST_CAPACITY:
                area[:REQUEST_CAPACITY] = data[:REQUEST_CAPACITY]
                self.channel.post([w], P.REQUEST_CHUNK, tag, [REQUEST_CAPACITY])
                self._wait()
                data = data[REQUEST_CAPACITY:]
            area[:len(data)] = data
            lens.append(len(data))
        self.sending_chunks = False
        self.channel.post(workers, code, tag, lens)

    def replies(self, workers: Iterable[int]) -> list[bytes]:
        """Each finished worker's reply, fetching chunks of large ones. Once
        every reply is in, the warnings their envs raised are shown, then
        the first env error (by env index) is raised."""
        replies, errors, forwarded = [], [], []
        for w in workers:
            status, length, total = self.channel.result(w)
            data = bytes(self._reply_areas[w][:length])
            while len(data) < total:
                self.channel.post([w], P.REPLY_CHUNK)
                self._wait()
                _, length, _ = self.channel.result(w)
                data += bytes(self._reply_areas[w][:length])
            if status & P.WARNED:
                shown, data = warning_relay.unframe(data)
                forwarded += shown
            if status & P.ERROR:
                errors.append(P.loads(data))
            else:
                replies.append(data)
        if forwarded:
            warning_relay.show(forwarded)
        if errors:
            raise_remote(min(errors, key=lambda e: e.row))
        return replies

    def collect(self, workers: Iterable[int]) -> list[bytes]:
        """Waits for the posted workers, then reads the replies of `workers`."""
        self._wait()
        return self.replies(workers)

    def request(self, code: int, requests: list[bytes] | None = None,
                workers: Iterable[int] | None = None) -> list[bytes]:
        """Posts a command and collects its replies (a set-up or upkeep
        command, whose caller has nothing to do meanwhile)."""
        workers = list(range(self.num_workers)) if workers is None else list(workers)
        self.post(code, requests, workers)
        return self.collect(workers)

    def close(self) -> None:
        """Drops the views of the arena, so that its mapping can go."""
        self._request_areas = self._reply_areas = []
        self.channel = None
