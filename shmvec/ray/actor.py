"""Inside a Ray actor: the ShmVecEnv that steps one slice of a RayVecEnv's
envs, sized from the CPUs Ray granted the actor."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import ray

from shmvec._engine.cycle import NEEDS_RESET
from shmvec._engine.warning_relay import Warned, WorkerRelay
from shmvec.ray.batches import LeafBatches
from shmvec.ray.infos import merge_infos
from shmvec.ray.scheduler import ActorBatch, ErrorInAnotherCall
from shmvec.vector_env import ShmVecEnv

__all__ = ["SliceHost", "shmvec_env_for_grant"]

# How long a waiting recv() in an actor waits at a time before it looks
# whether the actor is closing.
WAIT_SLICE_S = 0.1


# This actor process's: what its envs warn goes to the driver (see relayed()).
_relay: WorkerRelay | None = None


def _install_relay() -> None:
    """Keeps the warnings raised on the actor's event loop, where its
    ShmVecEnv runs (its workers' come back there), for the driver, which
    shows them under its own filters. Here each is kept once per place
    (Python's "default" filter), whatever this Ray worker's filters were:
    they hide DeprecationWarnings, which the driver's may show."""
    global _relay
    if _relay is None:
        warnings.simplefilter("default")
        _relay = WorkerRelay(thread=threading.get_ident())
        _relay.install()


def relayed(method):
    """An actor method whose result the driver fetches: the warnings kept
    while it ran go with its result (``Warned``), or with its exception
    (its ``shmvec_warnings``). Calls that wait (recv) let others run on the
    event loop meanwhile: a warning then goes with whichever ends first."""
    @functools.wraps(method)
    async def with_warnings(self, *args, **kwargs):
        try:
            result = await method(self, *args, **kwargs)
        except Exception as exc:
            if _relay is not None and _relay.pending:
                exc.shmvec_warnings = _relay.take()
            raise
        return Warned(result, _relay.take()) if _relay is not None and _relay.pending else result
    return with_warnings


def _granted_workers(num_envs: int, caller_steps: bool) -> int:
    """Worker processes for the CPUs Ray granted this process (the caller,
    when it steps envs itself, counts as one)."""
    granted = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    stepping = min(max(1, int(granted)), num_envs)
    return stepping - 1 if caller_steps else stepping


def shmvec_env_for_grant(env_fns: list, batch_size: int | None, kwargs: dict[str, Any]) -> ShmVecEnv:
    """A ShmVecEnv sized from Ray's CPU grant unless `num_workers` is given."""
    kwargs = dict(kwargs)
    if (batch_size is not None and batch_size < len(env_fns) and kwargs.get("caller_steps") is None
            and kwargs.get("num_workers") != 0):
        # Async mode: recv() runs on the actor's event loop, which steps no
        # envs while it has workers (with none it steps them all, in recv()).
        kwargs["caller_steps"] = False
    if kwargs.get("num_workers") is None:
        caller_steps = kwargs.get("caller_steps")
        if caller_steps is None:
            caller_steps = batch_size is None or batch_size == len(env_fns)
        kwargs["num_workers"] = _granted_workers(len(env_fns), caller_steps)
    return ShmVecEnv(env_fns, batch_size=batch_size, **kwargs)


class SliceHost:
    """A Ray actor's body: one slice of a RayVecEnv's envs in a ShmVecEnv.

    An asyncio actor, so that it stays responsive: a recv() that has to wait
    for envs waits in a thread (reading shared memory only), and the actor
    takes send()s, calls and the rest meanwhile. Everything that touches the
    ShmVecEnv runs on the event loop's thread, one call at a time. Results
    carry the ShmVecEnv's count of worker restarts (the RayVecEnv's budget
    counts them), and the warnings its envs raised (``relayed``)."""

    envs: ShmVecEnv | None = None

    @relayed
    async def start(self, env_fns: list, batch_size: int | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        _install_relay()
        if self.envs is not None:  # Ray said the actor restarted, though it did not: start afresh
            self.envs.close(terminate=True)
        self.envs = shmvec_env_for_grant(env_fns, batch_size, kwargs)
        self._batches = LeafBatches(self.envs.single_observation_space)
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="shmvec-recv")
        self._recv_lock = asyncio.Lock()  # one recv() at a time, in the order they came
        self._closing = False
        self._epoch = 0  # of the driver's last async_reset() run here (see send())
        e = self.envs
        return {"observation_space": e.single_observation_space, "action_space": e.single_action_space,
                "metadata": e.metadata, "render_mode": e.render_mode, "num_workers": e.num_workers}

    def _restarts(self) -> int:
        return self.envs._engine.restarts

    @relayed
    async def restarted(self, last_observations: Any) -> None:
        """This actor was rebuilt: every env's next step reports its restart,
        truncated at `last_observations` (None: never handed out)."""
        self.envs._restarted(last_observations)

    @relayed
    async def reset(self, seed: list, options: dict | None):
        return (*self.envs.reset(seed=seed, options=options), self._restarts())

    @relayed
    async def step(self, actions: Any):
        return (*self.envs.step(actions), self._restarts())

    @relayed
    async def async_reset(self, seed: list, options: dict | None, epoch: int) -> None:
        self._epoch = epoch
        self.envs.async_reset(seed=seed, options=options)

    async def send(self, actions: Any, env_ids: np.ndarray, epoch: int) -> None:
        # (Not relayed: the driver fetches no result. What it warns goes with the next call's.)
        # Dropped when it is not to step the envs, or would only fail where
        # nobody fetches its result (Ray logs such errors as unhandled):
        # - Ray runs an async actor's calls in any order: a send() the
        #   driver made before close() or an async_reset() (of a later
        #   `epoch`) may come after it;
        # - once an env here raised, in a recv() call whose result the
        #   driver has not seen yet, the driver's next recv() raises that
        #   error and asks for a reset.
        if self._closing or epoch < self._epoch or self.envs._cycle.phase is NEEDS_RESET:
            return
        self.envs.send(actions, env_ids)

    @relayed
    async def recv(self, count: int):
        """The first `count` envs of this slice to finish (the ShmVecEnv
        receives one at a time, so any count can be asked for); None once
        the actor closes (see send()); ErrorInAnotherCall once an env's
        error went to another call."""
        async with self._recv_lock:
            if self.envs._cycle.phase is NEEDS_RESET:  # an env raised, in an earlier recv() here
                return ErrorInAnotherCall(self.envs._cycle.why)
            parts = []
            for _ in range(count):
                if self._closing or not await self._wait_for_one():
                    return None
                parts.append(self.envs.recv())
        observations, rewards, terminations, truncations, part_infos = zip(*parts)
        ids = np.concatenate([part.pop("env_id") for part in part_infos])
        infos: dict[str, Any] = {}
        first = np.zeros(1, dtype=np.int64)
        for k, part in enumerate(part_infos):
            infos = merge_infos(infos, part, first, np.array([k]), count)
        return ActorBatch(self._batches.join(observations), np.concatenate(rewards), np.concatenate(terminations),
                          np.concatenate(truncations), infos, ids, self._restarts())

    async def _wait_for_one(self) -> bool:
        """Until the ShmVecEnv's recv() would not wait (or would find a
        failure to handle, or the timeout is up), without blocking the loop;
        False if the actor closes meanwhile."""
        envs, loop = self.envs, asyncio.get_running_loop()
        engine, start = envs._engine, time.monotonic()
        while not envs._has_results_at_hand():
            if await loop.run_in_executor(self._waiter, engine.async_steps.wait_finished, 1, WAIT_SLICE_S):
                return True
            if self._closing:
                return False
            if 0 <= engine.timeout <= time.monotonic() - start:
                return True  # recv() tells a hung worker (restarted or TimeoutError)
        return True

    @relayed
    async def call(self, name: str, args: tuple, kwargs: dict) -> tuple:
        return self.envs.call(name, *args, **kwargs)

    @relayed
    async def set_attr(self, name: str, values: list) -> None:
        self.envs.set_attr(name, values)

    @relayed
    async def close(self) -> None:
        self._closing = True
        async with self._recv_lock:  # a waiting recv() stops within WAIT_SLICE_S
            self.envs.close()
        self._waiter.shutdown()
