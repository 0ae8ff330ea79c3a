"""Scale out over a Ray cluster: ``shmvec.ray.RayVecEnv`` splits its envs
into contiguous slices, each stepped by a ``shmvec.ShmVecEnv`` inside a Ray
actor (so each node uses its own cores through shared memory), behind one
``gymnasium.vector.VectorEnv``. ``register_rllib_env`` makes RLlib's env
runners build their vector envs as ``shmvec.ShmVecEnv``.

Needs ``pip install "shmvec[ray]"``; ``import shmvec`` never imports ray.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from typing import Any

from shmvec._gym_compat import require_gymnasium_1

require_gymnasium_1("shmvec.ray (RayVecEnv, register_rllib_env)", ImportError)

import gymnasium as gym
import numpy as np
import ray
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space
from ray.exceptions import RayActorError

from shmvec.contract import checked_reset_mask, per_env_values, seeds_for
from shmvec.engine import split_slices
from shmvec.errors import ShmVecError, WorkerDiedError
from shmvec.layout import flattener, leaves_of, unflattener
from shmvec.vector_env import ShmVecEnv

__all__ = ["ActorDiedError", "RayVecEnv", "register_rllib_env"]

CLOSE_GRACE_S = 5.0
# A call to an actor that Ray is restarting (older Rays, within ray>=2.9, have no such error).
_ACTOR_UNAVAILABLE = getattr(ray.exceptions, "ActorUnavailableError", ())


class ActorDiedError(WorkerDiedError):
    """A Ray actor of a ``RayVecEnv`` died (killed, out of memory, its node
    lost): a ``shmvec.WorkerDiedError`` whose ``worker`` is the actor's index.

    Example:
        >>> import shmvec
        >>> from shmvec.ray import ActorDiedError
        >>> error = ActorDiedError(1, range(32, 64), "its node was lost")
        >>> isinstance(error, shmvec.WorkerDiedError), error.worker, error.env_indices
        (True, 1, range(32, 64))
        >>> print(error)
        shmvec Ray actor 1 (envs 32..63) died: its node was lost; close this vector env and create a new one
    """

    def __init__(self, actor: int, env_indices: range, reason: str = ""):
        self.reason = reason
        super().__init__(actor, env_indices, None, (
            f"shmvec Ray actor {actor} (envs {env_indices.start}..{env_indices.stop - 1}) died: "
            f"{reason or 'no reason given'}; close this vector env and create a new one"))

    def __reduce__(self):
        return (type(self), (self.worker, self.env_indices, self.reason))


def _granted_workers(num_envs: int, caller_steps: bool) -> int:
    """Worker processes for the CPUs Ray granted this process (the caller,
    when it steps envs itself, counts as one)."""
    granted = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    stepping = min(max(1, int(granted)), num_envs)
    return stepping - 1 if caller_steps else stepping


def _shmvec_env(env_fns: list, batch_size: int | None, kwargs: dict[str, Any]) -> ShmVecEnv:
    """A ShmVecEnv sized from Ray's CPU grant unless `num_workers` is given."""
    kwargs = dict(kwargs)
    if kwargs.get("num_workers") is None:
        caller_steps = kwargs.get("caller_steps")
        if caller_steps is None:
            caller_steps = batch_size is None or batch_size == len(env_fns)
        kwargs["num_workers"] = _granted_workers(len(env_fns), caller_steps)
    return ShmVecEnv(env_fns, batch_size=batch_size, **kwargs)


def _owned(value: Any) -> Any:
    """Ray hands numpy arrays back read-only: the caller gets writable ones."""
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    if isinstance(value, dict):
        return {k: _owned(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_owned(v) for v in value)
    return value


def _merge_infos(into: dict, part: dict, source: np.ndarray, target: np.ndarray, num: int) -> dict:
    """Adds rows `source` of vectorised infos `part` to `into` (of `num` envs)
    at rows `target`, giving the keys (in order), dtypes and masks that
    ``VectorEnv._add_info`` gives when it adds those envs one by one."""
    masks = {f"_{key}" for key in part}
    for key, value in part.items():
        if key in masks:
            continue
        present = part[f"_{key}"][source]
        if not present.any():
            continue
        src, dst = source[present], target[present]
        if isinstance(value, dict):
            array = _merge_infos(into.get(key, {}), value, src, dst, num)
        else:
            array = into.get(key)
            if array is None:
                # _add_info fills object arrays of unknown objects with None, others with 0
                if value.dtype == object and value.ndim == 1:
                    array = np.full(num, None, dtype=object)
                else:
                    array = np.zeros((num, *value.shape[1:]), dtype=value.dtype)
            if array.dtype == object:
                for s, d in zip(src, dst):
                    array[d] = _owned(value[s])
            else:
                array[dst] = value[src]
        mask = into.get(f"_{key}")
        if mask is None:
            mask = np.zeros(num, dtype=np.bool_)
        mask[dst] = True
        into[key], into[f"_{key}"] = array, mask
    return into


class _Batches:
    """Batched values of a space, leaf by leaf (arrays for leaves of fixed
    shape, tuples for the others): validating, taking rows, joining."""

    def __init__(self, space: gym.Space):
        self.leaves = leaves_of(space)
        self.flatten, self.unflatten = flattener(space), unflattener(space)

    def check(self, batch: Any, count: int, what: str) -> list:
        """The leaves of a batch of `count` values, checked as ShmVecEnv checks actions."""
        try:
            values = self.flatten(batch)
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise ValueError(f"{what} do not have the structure of the space: {exc!r}") from None
        out = []
        for leaf, value in zip(self.leaves, values):
            if not leaf.fixed:
                value = tuple(value)
                if len(value) != count:
                    raise ValueError(f"{what} leaf {leaf.name()} has {len(value)} values for {count} envs")
            else:
                value = np.asarray(value)
                if value.shape != (count, *leaf.shape):
                    raise ValueError(f"{what} must have shape {(count, *leaf.shape)} ({count} envs), got {value.shape}")
                if not np.can_cast(value.dtype, leaf.dtype, "same_kind"):
                    raise TypeError(f"{what} of dtype {value.dtype} cannot be used for a space of dtype {leaf.dtype}")
            out.append(value)
        return out

    def take(self, leaves: list, rows: slice | np.ndarray) -> Any:
        return self.unflatten([
            leaf[rows] if isinstance(rows, slice) or isinstance(leaf, np.ndarray) else tuple(leaf[i] for i in rows)
            for leaf in leaves
        ])

    def row(self, batch: Any, i: int) -> Any:
        """Value `i` of a batch, as SyncVectorEnv holds one env's value, owned by the caller."""
        return self.unflatten([
            np.array(value[i, ...]) if leaf.fixed and (value.ndim > 1 or leaf.zero_dim_array) else _owned(value[i])
            for leaf, value in zip(self.leaves, self.flatten(batch))
        ])

    def join(self, batches: list) -> Any:
        """One batch of the rows of `batches`, in order, owned by the caller."""
        joined = []
        for parts in zip(*map(self.flatten, batches)):
            if isinstance(parts[0], np.ndarray):
                joined.append(np.concatenate(parts))  # a copy: writable
            else:
                joined.append(tuple(_owned(v) for v in itertools.chain.from_iterable(parts)))
        return self.unflatten(joined)


# How long a waiting recv() in an actor waits at a time before it looks
# whether the actor is closing.
WAIT_SLICE_S = 0.1
# How long Ray may take to restart a dead actor.
REVIVE_TIMEOUT_S = 60.0


class _SliceHost:
    """A Ray actor's body: one slice of a RayVecEnv's envs in a ShmVecEnv.

    An asyncio actor, so that it stays responsive: a recv() that has to wait
    for envs waits in a thread (reading shared memory only), and the actor
    takes send()s, calls and the rest meanwhile. Everything that touches the
    ShmVecEnv runs on the event loop's thread, one call at a time. Results
    carry the ShmVecEnv's count of worker restarts (the RayVecEnv's budget
    counts them)."""

    envs: ShmVecEnv | None = None

    async def start(self, env_fns: list, batch_size: int | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.envs is not None:  # Ray said the actor restarted, though it did not: start afresh
            self.envs.close(terminate=True)
        self.envs = _shmvec_env(env_fns, batch_size, kwargs)
        self._batches = _Batches(self.envs.single_observation_space)
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="shmvec-recv")
        self._recv_lock = asyncio.Lock()  # one recv() at a time, in the order they came
        self._closing = False
        e = self.envs
        return {"observation_space": e.single_observation_space, "action_space": e.single_action_space,
                "metadata": e.metadata, "render_mode": e.render_mode, "num_workers": e.num_workers}

    def _restarts(self) -> int:
        return self.envs._engine.restarts

    async def restarted(self, last_observations: Any) -> None:
        """This actor was rebuilt: every env's next step reports its restart,
        truncated at `last_observations` (None: never handed out)."""
        self.envs._restarted(last_observations)

    async def reset(self, seed: list, options: dict | None):
        return (*self.envs.reset(seed=seed, options=options), self._restarts())

    async def step(self, actions: Any):
        return (*self.envs.step(actions), self._restarts())

    async def async_reset(self, seed: list, options: dict | None) -> None:
        self.envs.async_reset(seed=seed, options=options)

    async def send(self, actions: Any, env_ids: np.ndarray) -> None:
        self.envs.send(actions, env_ids)

    async def recv(self, count: int):
        """The first `count` envs of this slice to finish (the ShmVecEnv
        receives one at a time, so any count can be asked for)."""
        async with self._recv_lock:
            parts = []
            for _ in range(count):
                await self._wait_for_one()
                parts.append(self.envs.recv())
        ids = np.concatenate([p[4].pop("env_id") for p in parts])
        infos: dict[str, Any] = {}
        first = np.zeros(1, dtype=np.int64)
        for k, p in enumerate(parts):
            infos = _merge_infos(infos, p[4], first, np.array([k]), count)
        return (self._batches.join([p[0] for p in parts]), *(np.concatenate([p[i] for p in parts]) for i in (1, 2, 3)),
                infos, ids, self._restarts())

    async def _wait_for_one(self) -> None:
        """Until the ShmVecEnv's recv() would not wait (or would find a
        failure to handle, or the timeout is up), without blocking the loop."""
        envs, loop = self.envs, asyncio.get_running_loop()
        engine, start = envs._engine, time.monotonic()
        while not envs._reset_ready:
            if await loop.run_in_executor(self._waiter, engine.wait_finished, 1, WAIT_SLICE_S):
                return
            if self._closing:
                raise ClosedEnvironmentError("this actor's envs are closing")
            if 0 <= engine.timeout <= time.monotonic() - start:
                return  # recv() tells a hung worker (restarted or TimeoutError)

    async def call(self, name: str, args: tuple, kwargs: dict) -> tuple:
        return self.envs.call(name, *args, **kwargs)

    async def set_attr(self, name: str, values: list) -> None:
        self.envs.set_attr(name, values)

    async def close(self) -> None:
        self._closing = True
        async with self._recv_lock:  # a waiting recv() stops within WAIT_SLICE_S
            self.envs.close()
        self._waiter.shutdown()


class RayVecEnv(VectorEnv):
    """Steps many Gymnasium envs across a Ray cluster: the envs are split into
    `num_actors` contiguous slices, each stepped by a ``shmvec.ShmVecEnv`` in
    its own Ray actor, which sizes its workers from the CPUs Ray grants it.

    It honours the ``gymnasium.vector.VectorEnv`` contract exactly as
    ``SyncVectorEnv`` does (same seeds and actions give the same results,
    infos included). Each step goes to every actor at once and is gathered
    in one round. With ``batch_size`` below the number of envs it offers
    ``ShmVecEnv``'s EnvPool-style ``async_reset``/``send``/``recv``: results
    are gathered from actors as they finish, so a slow node does not stall
    the rest.

    Args:
        env_fns: callables that each make one env; they are pickled to the
            actors, so they must be importable there (or closures/lambdas
            over such callables).
        num_actors: Ray actors, each with a contiguous slice of the envs.
        actor_options: options for ``ray.remote`` (``num_cpus``, default 1;
            ``scheduling_strategy="SPREAD"``; ``runtime_env``; ...).
        batch_size: envs per ``recv()``; below ``len(env_fns)``: async mode,
            which needs at least 2 envs per actor.
        **shmvec_kwargs: options of each actor's ``ShmVecEnv``
            (``autoreset_mode``, ``start_method``, ``timeout``, ...);
            ``num_workers`` defaults to the actor's granted CPUs (less one in
            synchronous mode, where the actor steps a slice itself). Results
            always belong to the caller: ``copy`` is not used.

    An actor that dies raises ``ActorDiedError`` (a ``shmvec.WorkerDiedError``)
    naming it and its envs. With ``restart_failed_workers=True`` (sync or
    async mode, as in ``ShmVecEnv``) Ray restarts it and its envs are
    rebuilt; each one's next step reports its episode cut short, exactly as
    ``ShmVecEnv`` reports the envs of a restarted worker (truncated, flagged
    in ``infos["shmvec_restarted"]``, per autoreset mode); in async mode the
    envs it had in flight come back from ``recv()`` that way. A
    ``call``/``set_attr`` it died in raises ``ShmVecError`` (call again); a
    reset is redone. ``max_restarts`` is one budget for the whole vector env:
    actors restarted and workers restarted inside them, all counted together
    (``restarts``); beyond it, ``WorkerDiedError``.

    Example (it needs a cluster, so it is not run as a doctest)::

        import gymnasium as gym
        import ray
        from shmvec.ray import RayVecEnv

        ray.init()  # or ray.init(address="auto") to join a running cluster
        envs = RayVecEnv([lambda: gym.make("CartPole-v1")] * 64, num_actors=2,
                         actor_options={"num_cpus": 4, "scheduling_strategy": "SPREAD"})
        obs, infos = envs.reset(seed=42)  # obs.shape == (64, 4)
        obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())
        envs.close()
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        num_actors: int,
        *,
        actor_options: dict[str, Any] | None = None,
        batch_size: int | None = None,
        **shmvec_kwargs: Any,
    ):
        super().__init__()
        self.closed = True  # until the actors are up, so __del__/close have nothing to do
        env_fns = list(env_fns)
        num_envs = len(env_fns)
        if not env_fns:
            raise ValueError("env_fns is empty: pass at least one env factory")
        batch_size = num_envs if batch_size is None else batch_size
        for name, value in (("num_actors", num_actors), ("batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= num_envs:
                raise ValueError(f"{name} must be an int in [1, num_envs={num_envs}], got {value!r}")
        self.num_envs, self.batch_size = num_envs, int(batch_size)
        self.slices = split_slices(num_envs, int(num_actors))
        async_mode = self.batch_size < num_envs
        if async_mode and min(len(rows) for rows in self.slices) < 2:
            raise ValueError(f"batch_size < num_envs (async mode) needs at least 2 envs per actor, "
                             f"got {num_envs} envs for {num_actors} actors")
        shmvec_kwargs["copy"] = False  # Ray copies results anyway
        options = {"num_cpus": 1, **(actor_options or {})}
        self._restart = bool(shmvec_kwargs.get("restart_failed_workers", False))
        # One budget for the whole vector env, as in ShmVecEnv: actors Ray
        # restarts and workers the actors' ShmVecEnvs restart, all counted
        # together. (Each actor's ShmVecEnv also stops at max_restarts of its own.)
        self.max_restarts = int(shmvec_kwargs.get("max_restarts", 10))  # ShmVecEnv's default
        self._actor_restarts = 0
        self._worker_restarts = [0] * len(self.slices)  # reported by each actor's current life
        self._spent = 0  # worker restarts of actors' earlier lives
        self._broken: str | None = None
        if self._restart:  # Ray restarts a dead actor's process; _revive() rebuilds its envs
            options.setdefault("max_restarts", self.max_restarts)
        actor_class = ray.remote(_SliceHost).options(**options)
        self._actors = [actor_class.remote() for _ in self.slices]
        # Each actor's ShmVecEnv receives one env at a time, so that the
        # front end can ask an actor for any number of finished envs.
        self._start_args = [([env_fns[i] for i in rows], 1 if async_mode else None, shmvec_kwargs)
                            for rows in self.slices]
        self.closed = False
        try:
            descriptions = self._gather(lambda k, a: a.start.remote(*self._start_args[k]))
        except BaseException:
            self.close(terminate=True)
            raise
        first = descriptions[0]
        for d in descriptions[1:]:
            for key in ("observation_space", "action_space"):
                if d[key] != first[key]:
                    self.close()
                    raise RuntimeError(f"the envs do not share one {key.replace('_', ' ')}: {first[key]} and {d[key]}")
        self.metadata = first["metadata"]
        self.autoreset_mode = self.metadata["autoreset_mode"]
        self.render_mode = first["render_mode"]
        self.num_workers = [d["num_workers"] for d in descriptions]
        self.single_observation_space = first["observation_space"]
        self.single_action_space = first["action_space"]
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._obs_batches = _Batches(self.single_observation_space)
        self._action_batches = _Batches(self.single_action_space)
        self._starts = np.array([rows.start for rows in self.slices])
        # Synchronous mode: each actor's last observations (a masked reset
        # leaves them to the envs it does not reset) and, under DISABLED
        # autoreset, the envs that must be reset before the next step.
        self._observations: list[Any] = [None] * len(self.slices)
        self._ended = np.zeros(num_envs, dtype=np.bool_)
        # Async mode: envs sent (or reset) and not yet received by the caller;
        # per actor, envs in flight not yet asked for and how many it returns
        # per call; Ray calls in progress and the results they brought, not
        # yet received.
        self._in_flight = np.zeros(num_envs, dtype=np.bool_)
        self._reset_pending = np.zeros(num_envs, dtype=np.bool_)
        self._unasked = np.zeros(len(self.slices), dtype=np.int64)
        self._chunk = [max(1, round(self.batch_size * len(rows) / num_envs)) for rows in self.slices]
        self._calls: dict[ray.ObjectRef, tuple[int, int]] = {}  # -> (actor, number of envs)
        self._results: list[tuple] = []
        self._reset_required: str | None = None
        # Async mode with restarts: the observations each env was last handed
        # (leaf by leaf), for the restart reports of an actor Ray rebuilt.
        self._last_obs: list | None = None

    # -- Ray calls ------------------------------------------------------------

    @property
    def restarts(self) -> int:
        """Actors and workers restarted so far, counted against max_restarts."""
        return self._actor_restarts + self._spent + sum(self._worker_restarts)

    def _gather(self, call: Callable[[int, Any], ray.ObjectRef], actors: Sequence[int] | None = None) -> list:
        """Makes `call` on every actor (or those listed) at once and gathers
        the results in one round."""
        actors = range(len(self._actors)) if actors is None else actors
        return self._get([call(k, self._actors[k]) for k in actors], actors)

    def _get(self, refs: list, actors: Sequence[int]) -> list:
        """ray.get of calls made to `actors` (one each); a dead actor raises
        ActorDiedError naming the actor of the call that failed (Ray's error
        may not say which: its actor_id can be None)."""
        try:
            return ray.get(refs)
        except RayActorError as exc:
            error = exc
        for k, ref in zip(actors, refs):
            try:
                ray.get(ref)
            except RayActorError as exc:
                raise ActorDiedError(k, self.slices[k], str(exc).strip().splitlines()[0]) from exc
            except Exception:
                pass  # another call's error: not the actor that died
        raise error

    def _revive(self, k: int, reason: str) -> None:
        """After actor `k` died (restart_failed_workers): waits for Ray to
        restart it and rebuilds its envs, marked restarted: each one's next
        step reports it, as a ShmVecEnv reports envs of a restarted worker."""
        actor, rows = self._actors[k], self.slices[k]
        if self.restarts >= self.max_restarts:
            self._broken = f"shmvec Ray actor {k} died and the restart budget max_restarts={self.max_restarts} is spent"
            raise ActorDiedError(k, rows, f"{reason}; the restart budget max_restarts={self.max_restarts} is spent")
        self._actor_restarts += 1
        self._spent += self._worker_restarts[k]
        self._worker_restarts[k] = 0
        deadline = time.monotonic() + REVIVE_TIMEOUT_S
        while True:
            try:
                self._get([actor.start.remote(*self._start_args[k])], [k])
                self._get([actor.restarted.remote(self._last_seen(k))], [k])
                return
            except ActorDiedError as exc:
                # "Temporarily unavailable": Ray is still restarting it.
                if isinstance(exc.__cause__, _ACTOR_UNAVAILABLE) and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                self._broken = f"shmvec Ray actor {k} died and Ray did not restart it"
                raise ActorDiedError(k, rows, f"{exc.reason}; Ray did not restart it") from exc

    def _last_seen(self, k: int) -> Any:
        """The observations actor `k`'s envs were last handed out (None: never)."""
        if self.batch_size == self.num_envs:
            return self._observations[k]
        if self._last_obs is None:
            return None
        rows = self.slices[k]
        return self._obs_batches.take(self._last_obs, slice(rows.start, rows.stop))

    def _count_restarts(self, k: int, reported: int) -> None:
        """Notes the worker restarts actor `k` reported; beyond the budget,
        WorkerDiedError."""
        self._worker_restarts[k] = reported
        if self.restarts > self.max_restarts:
            self._broken = (f"shmvec Ray actor {k} (envs {self.slices[k].start}..{self.slices[k].stop - 1}) "
                            f"restarted a worker and the restart budget max_restarts={self.max_restarts} is spent")
            raise WorkerDiedError(k, self.slices[k], None, self._broken + "; close this vector env")

    def _restart_or_raise(self, exc: ActorDiedError) -> None:
        """Revives the actor that `exc` names, or raises `exc` without restarts."""
        if not self._restart:
            raise exc
        self._revive(exc.worker, exc.reason)

    def _stepped(self, refs: list, actors: Sequence[int]) -> list:
        """Gathers results of steps: after an env error, some envs stepped and
        others did not, so only a full reset brings them back to a known state."""
        try:
            return self._get(refs, actors)
        except ActorDiedError:
            raise
        except Exception:
            self._reset_required = "an env raised during the last call; reset() all envs before stepping again"
            raise

    def _check_steppable(self) -> None:
        self._check_usable()
        if self._reset_required:
            raise RuntimeError(self._reset_required)

    # -- synchronous stepping -------------------------------------------------

    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Resets every env (or those in ``options["reset_mask"]``) and returns
        the batched observations and infos, as ``SyncVectorEnv`` does."""
        self._check_open()
        self._check_sync("reset", "async_reset")
        self._check_usable()
        seeds = seeds_for(seed, self.num_envs)
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict or None, got {type(options).__name__}")
        given, options = options, dict(options or {})
        mask = checked_reset_mask(options.pop("reset_mask"), self.num_envs) if "reset_mask" in options else None
        actors = [k for k, rows in enumerate(self.slices) if mask is None or mask[rows.start:rows.stop].any()]

        def reset(k, actor):
            rows = self.slices[k]
            part = options if mask is None else {**options, "reset_mask": mask[rows.start:rows.stop]}
            return actor.reset.remote(seeds[rows.start:rows.stop], part or None)

        try:
            results = self._gather(reset, actors)
        except ActorDiedError as exc:
            self._restart_or_raise(exc)
            return self.reset(seed=seed, options=given)
        if mask is None:
            self._reset_required = None
        self._ended[:] = False if mask is None else self._ended & ~mask
        infos: dict[str, Any] = {}
        for k, (obs, part, restarts) in zip(actors, results):
            self._count_restarts(k, restarts)
            self._observations[k] = obs
            infos = self._merge(infos, part, self.slices[k])
        return self._obs_batches.join(self._observations), infos

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Steps every env with its action; returns batched (observations,
        rewards, terminations, truncations, infos)."""
        self._check_open()
        self._check_sync("step", "send/recv")
        self._check_steppable()
        if self._ended.any():
            raise RuntimeError(
                f"envs {np.flatnonzero(self._ended).tolist()} ended their episodes and autoreset_mode is "
                "DISABLED: reset them with reset(options={'reset_mask': mask}) before stepping again")
        leaves = self._action_batches.check(actions, self.num_envs, "actions")
        results = self._step_results(lambda k: self._actors[k].step.remote(
            self._action_batches.take(leaves, slice(self.slices[k].start, self.slices[k].stop))))
        infos: dict[str, Any] = {}
        for k, (obs, _, _, _, part, restarts) in enumerate(results):
            self._count_restarts(k, restarts)
            self._observations[k] = obs
            infos = self._merge(infos, part, self.slices[k])
        rewards, terminations, truncations = (np.concatenate([r[i] for r in results]) for i in (1, 2, 3))
        if self.autoreset_mode is AutoresetMode.DISABLED:
            self._ended = terminations | truncations
        return self._obs_batches.join(self._observations), rewards, terminations, truncations, infos

    def _step_results(self, step: Callable[[int], ray.ObjectRef]) -> list:
        """Each actor's step result (`step(k)` makes actor k's call). With
        restart_failed_workers, an actor that died is restarted and stepped
        again: its envs' restart reports are their results."""
        actors = range(len(self._actors))
        refs = [step(k) for k in actors]
        try:
            return self._stepped(refs, actors)
        except ActorDiedError:
            if not self._restart:
                raise
        results = []
        for k, ref in zip(actors, refs):
            try:
                results += self._stepped([ref], [k])
            except ActorDiedError as exc:
                self._revive(k, exc.reason)
                results += self._stepped([step(k)], [k])
        return results

    def _check_usable(self) -> None:
        if self._broken:
            raise ShmVecError(self._broken + "; close this vector env")

    def _merge(self, infos: dict, part: dict, rows: range) -> dict:
        return _merge_infos(infos, part, np.arange(len(rows)), np.arange(rows.start, rows.stop), self.num_envs)

    def _check_sync(self, name: str, instead: str) -> None:
        ShmVecEnv._check_sync(self, name, instead)

    # -- async mode (batch_size < num_envs) -------------------------------------

    def async_reset(self, *, seed: int | list[int | None] | None = None,
                    options: dict[str, Any] | None = None) -> None:
        """Resets every env; ``recv()`` then returns the reset observations
        ``batch_size`` envs at a time (rewards 0, flags False)."""
        self._check_open()
        self._check_async("async_reset")
        seeds = seeds_for(seed, self.num_envs)
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict or None, got {type(options).__name__}")
        self._check_usable()
        if self._calls:  # let them land (each actor's ShmVecEnv drops what is still in flight)
            ray.wait(list(self._calls), num_returns=len(self._calls))
        self._calls.clear()
        self._results.clear()
        try:
            self._gather(lambda k, actor: actor.async_reset.remote(
                seeds[self.slices[k].start:self.slices[k].stop], options))
        except ActorDiedError as exc:
            self._restart_or_raise(exc)
            return self.async_reset(seed=seed, options=options)
        self._reset_required = None
        self._in_flight[:] = False
        self._reset_pending[:] = True
        self._unasked[:] = [len(rows) for rows in self.slices]
        self._ask()

    def send(self, actions: Any, env_ids: Any) -> None:
        """Hands envs `env_ids` their next actions and returns at once."""
        self._check_open()
        self._check_async("send")
        self._check_steppable()
        ids = np.asarray(env_ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"env_ids must be a 1-D array of ints, got {ids.dtype} of shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_envs):
            raise ValueError(f"env_ids must be in [0, {self.num_envs}), got {ids.tolist()}")
        if len(np.unique(ids)) != len(ids):
            raise ValueError(f"env_ids has repeated envs: {ids.tolist()}")
        if self._in_flight[ids].any():
            raise ValueError(f"envs {ids[self._in_flight[ids]].tolist()} are already in flight: "
                             "recv() them before sending again")
        if self._reset_pending[ids].any():
            raise ValueError(f"envs {ids[self._reset_pending[ids]].tolist()} have reset results not yet "
                             "received: recv() them first")
        leaves = self._action_batches.check(actions, len(ids), "actions")
        owner = np.searchsorted(self._starts, ids, side="right") - 1
        for k in np.unique(owner):
            mine = np.flatnonzero(owner == k)
            self._actors[k].send.remote(self._action_batches.take(leaves, mine), ids[mine] - self._starts[k])
            self._unasked[k] += len(mine)
        self._in_flight[ids] = True
        self._ask()

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Waits for ``batch_size`` envs to finish and returns their
        (observations, rewards, terminations, truncations, infos), in the
        order they finished; ``infos["env_id"]`` says which envs they are."""
        self._check_open()
        self._check_async("recv")
        available = int(self._in_flight.sum() + self._reset_pending.sum())
        if available < self.batch_size:
            raise RuntimeError(
                f"recv() needs {self.batch_size} envs in flight, but only {available} are: "
                "send() more first (or async_reset())")
        self._check_usable()
        have = sum(len(r[5]) for r in self._results)
        self._ask(self.batch_size - have)
        while have < self.batch_size:
            (ref,), _ = ray.wait(list(self._calls), num_returns=1)
            k, _ = self._calls.pop(ref)
            try:
                result = self._stepped([ref], [k])[0]
            except ActorDiedError as exc:
                self._restart_or_raise(exc)
                self._send_again(k)
                self._ask(self.batch_size - have)
                continue
            self._count_restarts(k, result[6])
            self._results.append((*result[:5], result[5] + self._starts[k]))
            have += len(result[5])
        return self._take(self.batch_size)

    def _send_again(self, k: int) -> None:
        """Actor `k` was rebuilt: the envs it had in flight go again, to come
        back with their restart reports (which ignore the action); the
        others report at their next send()."""
        for ref in [ref for ref, (j, _) in self._calls.items() if j == k]:
            del self._calls[ref]  # died with it
        rows = self.slices[k]
        received = {int(i) for r in self._results for i in r[5]}
        lost = [i for i in rows if (self._in_flight[i] or self._reset_pending[i]) and i not in received]
        self._unasked[k] = len(lost)
        if lost:
            actions = self._action_batches.check(self.action_space.sample(), self.num_envs, "actions")
            self._actors[k].send.remote(self._action_batches.take(actions, np.asarray(lost)),
                                        np.asarray(lost) - rows.start)

    def _ask(self, needed: int = 0) -> None:
        """Asks actors for their finished envs: a chunk from each actor with
        enough envs in flight and, when the next batch needs them (`needed`
        envs beyond the results at hand), the envs left over as well."""
        for k, actor in enumerate(self._actors):
            while self._unasked[k] >= self._chunk[k]:
                self._call(k, self._chunk[k])
        short = needed - sum(count for _, count in self._calls.values())
        if short > 0:
            for k in np.flatnonzero(self._unasked):
                self._call(int(k), int(min(self._unasked[k], short)))

    def _call(self, k: int, count: int) -> None:
        self._calls[self._actors[k].recv.remote(count)] = (k, count)
        self._unasked[k] -= count

    def _take(self, count: int) -> tuple:
        """The first `count` envs of the results at hand, as one batch."""
        taken, have = [], 0
        while have < count:
            result = self._results.pop(0)
            n = min(count - have, len(result[5]))
            if n < len(result[5]):  # keep the rest of this actor's results for the next recv()
                rest = np.arange(n, len(result[5]))
                self._results.insert(0, self._rows(result, rest))
            taken.append((result, n))
            have += n
        obs = self._obs_batches.join([self._obs_batches.take(self._obs_batches.flatten(r[0]), slice(0, n))
                                      for r, n in taken])
        infos: dict[str, Any] = {}
        position = 0
        for r, n in taken:
            infos = _merge_infos(infos, r[4], np.arange(n), np.arange(position, position + n), count)
            position += n
        ids = np.concatenate([r[5][:n] for r, n in taken]).astype(np.int64)
        infos["env_id"] = ids
        self._in_flight[ids] = False
        self._reset_pending[ids] = False
        if self._restart:  # what each env was last handed, for restart reports
            if self._last_obs is None:
                self._last_obs = [np.zeros((self.num_envs, *leaf.shape), leaf.dtype) if leaf.fixed
                                  else [None] * self.num_envs for leaf in self._obs_batches.leaves]
            for last, value in zip(self._last_obs, self._obs_batches.flatten(obs)):
                if isinstance(last, np.ndarray):
                    last[ids] = value
                else:
                    for i, v in zip(ids.tolist(), value):
                        last[i] = v
        return (obs, *(np.concatenate([r[i][:n] for r, n in taken]) for i in (1, 2, 3)), infos)

    def _rows(self, result: tuple, rows: np.ndarray) -> tuple:
        """Rows `rows` of an actor's result."""
        infos = _merge_infos({}, result[4], rows, np.arange(len(rows)), len(rows))
        obs = self._obs_batches.take(self._obs_batches.flatten(result[0]), rows)
        return (obs, result[1][rows], result[2][rows], result[3][rows], infos, result[5][rows])

    def _check_async(self, name: str) -> None:
        if self.batch_size == self.num_envs:
            raise RuntimeError(f"{name}() is for async mode: create the RayVecEnv with batch_size < num_envs")

    # -- the rest of the contract ---------------------------------------------

    def render(self) -> tuple[Any, ...]:
        """The rendered frames of every env."""
        return self.call("render")

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls method `name` of every env (or reads the attribute)."""
        self._check_open()
        return tuple(itertools.chain.from_iterable(
            self._fan_out(lambda k, actor: actor.call.remote(name, args, kwargs))))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute `name` of every env."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Sets `name` on every env: one value each if `values` is a list or
        tuple, else the same value for all."""
        self._check_open()
        values = per_env_values(values, self.num_envs)
        self._fan_out(lambda k, actor: actor.set_attr.remote(
            name, list(values[self.slices[k].start:self.slices[k].stop])))

    def _fan_out(self, call: Callable[[int, Any], ray.ObjectRef]) -> list:
        """`call` on every actor; after a restart, the caller must call again."""
        try:
            return self._gather(call)
        except ActorDiedError as exc:
            self._restart_or_raise(exc)
            raise ShmVecError(f"shmvec Ray actor {exc.worker} died during this call and was restarted "
                              "(its envs reset); call again") from exc

    @property
    def np_random_seed(self) -> tuple[int, ...]:
        return self.get_attr("np_random_seed")

    @property
    def np_random(self) -> tuple[np.random.Generator, ...]:
        return self.get_attr("np_random")

    def close_extras(self, terminate: bool = False, **kwargs: Any) -> None:
        """Closes every actor's envs (at most a few seconds, unless
        `terminate`) and releases the actors."""
        actors, self._actors = getattr(self, "_actors", []), []
        if not actors or not ray.is_initialized():
            return
        if not terminate:
            ray.wait([actor.close.remote() for actor in actors], num_returns=len(actors), timeout=CLOSE_GRACE_S)
        for actor in actors:
            ray.kill(actor)

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError("this RayVecEnv is closed; create a new one")


# -- RLlib ------------------------------------------------------------------------


def _rllib_env(env: str | Callable[[dict], gym.Env], config: dict) -> gym.Env:
    return gym.make(env, **config) if isinstance(env, str) else env(config)


def _rllib_creator(env: str | Callable[[dict], gym.Env], shmvec_kwargs: dict[str, Any], env_context: dict):
    """RLlib's env creator: one env, or a ShmVecEnv when RLlib asks for a vector env."""
    if "num_envs" not in env_context:
        # One env: the creator gets RLlib's EnvContext as it is (worker_index
        # and the rest), as with RLlib's own register_env.
        return _rllib_env(env, env_context)
    # RLlib's vector entry point passes a plain dict: the user's env_config and num_envs.
    config = dict(env_context)
    num_envs = config.pop("num_envs")
    return _shmvec_env([functools.partial(_rllib_env, env, config)] * num_envs, None, shmvec_kwargs)


def register_rllib_env(name: str, env: str | Callable[[dict], gym.Env], **shmvec_kwargs: Any) -> None:
    """Registers `name` with Ray Tune's registry so that RLlib's env runners
    (new API stack) step their envs in a ``shmvec.ShmVecEnv``.

    `env` is a Gymnasium env id or a callable that makes one env from RLlib's
    ``env_config`` (RLlib's ``EnvContext`` when RLlib asks for one env; under
    the vector entry point RLlib passes a plain dict, and each env gets it);
    `shmvec_kwargs` go to each ``ShmVecEnv`` (``num_workers`` defaults to the
    env runner's CPUs, ``num_cpus_per_env_runner``, less one).

    Example (``examples/rllib_ppo.py`` trains PPO this way)::

        from ray.rllib.algorithms.ppo import PPOConfig
        from shmvec.ray import register_rllib_env

        register_rllib_env("shmvec-cartpole", "CartPole-v1")
        config = (PPOConfig().environment("shmvec-cartpole")
                  .env_runners(num_envs_per_env_runner=8, num_cpus_per_env_runner=2,
                               gym_env_vectorize_mode="vector_entry_point"))
    """
    from ray.tune.registry import register_env

    register_env(name, functools.partial(_rllib_creator, env, dict(shmvec_kwargs)))
