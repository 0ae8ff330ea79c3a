"""Requests larger than a worker's request area travel in chunks ahead of
their command. A transfer cut short (Ctrl-C while a chunk is in flight) must
not leave its bytes to be glued onto the next request."""

from __future__ import annotations

import pytest
from fault_envs import FaultEnv

import shmvec
from shmvec._engine import protocol as P
from shmvec._engine.transport import REQUEST_CAPACITY


class InterruptAfterFirstChunk:
    """Wraps an engine's channel: the wait for the first request chunk
    raises KeyboardInterrupt, as a Ctrl-C during that wait does (the chunk
    stays in flight, the rest of the transfer is never sent)."""

    def __init__(self, channel):
        self.channel = channel
        self.armed = False

    def __getattr__(self, name):
        return getattr(self.channel, name)

    def post(self, workers, code, arg=0, request_lens=()):
        self.channel.post(workers, code, arg, list(request_lens))
        self.armed = self.armed or code == P.REQUEST_CHUNK

    def wait(self, sentinels, timeout=-1.0):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return self.channel.wait(sentinels, timeout)


@pytest.mark.parametrize("next_request", ["small", "chunked"])
def test_interrupted_chunked_request_leaves_nothing_behind(next_request, closing):
    envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=2, caller_steps=False, start_method="fork")
    closing(envs)
    engine = envs._engine
    real = engine.transport.channel  # the pool waits on the same channel
    big = b"x" * (3 * REQUEST_CAPACITY)
    engine.transport.channel = engine.pool.channel = InterruptAfterFirstChunk(real)
    try:
        with pytest.raises(KeyboardInterrupt):
            envs.set_attr("payload", big)
    finally:
        engine.transport.channel = engine.pool.channel = real
    value = "small" if next_request == "small" else b"y" * (2 * REQUEST_CAPACITY + 5)
    envs.set_attr("payload", value)  # the worker must not join the stale chunk to this
    assert envs.get_attr("payload") == (value,) * 4
    envs.reset()
