"""``RayVecEnv``: a vector env whose envs are split over Ray actors, each
stepping its slice in a ``shmvec.ShmVecEnv`` (``shmvec.ray.actor``). Here:
construction, synchronous reset/step, async mode's entry points (its
bookkeeping is ``shmvec.ray.scheduler``), calls and close; the calls to the
actors, their deaths and restarts are ``shmvec.ray.actor_calls``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import ray
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from shmvec import _core
from shmvec.contract import (AttributesByCall, check_async, check_async_reset_options, check_sync, check_wait,
                             checked_env_ids, checked_reset_mask, seeds_for)
from shmvec._engine.cycle import ENV_RAISED, INTERRUPTED, NEEDS_RESET, WAITING_STEP, CommandCycle
from shmvec._engine.plan import split_slices
from shmvec._engine.pool import CLOSE_GRACE_S, still_pending
from shmvec._engine.warning_relay import unwrapped
from shmvec.ray.actor_calls import ActorCalls
from shmvec.ray.batches import LeafBatches
from shmvec.ray.errors import ActorDiedError
from shmvec.ray.infos import merge_infos
from shmvec.ray.restarts import LastObservations
from shmvec.ray.scheduler import ActorBatch, AsyncScheduler, ErrorInAnotherCall

__all__ = ["RayVecEnv"]


class RayVecEnv(AttributesByCall, ActorCalls, VectorEnv):
    """Steps many Gymnasium envs across a Ray cluster: the envs are split into
    `num_actors` contiguous slices, each stepped by a ``shmvec.ShmVecEnv`` in
    its own Ray actor, which sizes its workers from the CPUs Ray grants it.

    It honours the ``gymnasium.vector.VectorEnv`` contract exactly as
    ``SyncVectorEnv`` does (same seeds and actions give the same results,
    infos included). Each step goes to every actor at once and is gathered
    in one round (``step_async``/``step_wait``: a step that Ctrl-C or a
    timeout interrupts stays pending, for ``step_wait()`` to return). With
    ``batch_size`` below the number of envs it offers
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
        # Every call checks this state machine (shmvec._engine.cycle). It waits
        # only for a step: one that a Ctrl-C or a timeout interrupts stays
        # pending (_pending_step: how to step each actor, and its calls).
        self._cycle = CommandCycle(lambda: ClosedEnvironmentError("this RayVecEnv is closed; create a new one"))
        self._pending_step: tuple[Callable[[int], ray.ObjectRef], list] | None = None
        self._handing_out: tuple | None = None  # async mode: a batch a Ctrl-C kept from the caller
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
        self._create_actors(env_fns, async_mode, shmvec_kwargs, actor_options)
        self.closed = False
        try:
            descriptions = self._start_actors()
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
        self._obs_batches = LeafBatches(self.single_observation_space)
        self._action_batches = LeafBatches(self.single_action_space)
        self._last = LastObservations(self._obs_batches, self.slices, per_env=async_mode)
        # Synchronous mode, under DISABLED autoreset: the envs that must be
        # reset before the next step.
        self._ended = np.zeros(num_envs, dtype=np.bool_)
        self._scheduler = AsyncScheduler(self._actors, self.slices, self.batch_size, self._obs_batches,
                                         self._action_batches, self.action_space) if async_mode else None

    # -- synchronous stepping -------------------------------------------------

    def reset(self, *, seed: int | list[int | None] | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Resets every env (or those in ``options["reset_mask"]``) and returns
        the batched observations and infos, as ``SyncVectorEnv`` does."""
        self._check_open()
        check_sync(self, "reset", "async_reset")
        self._cycle.check_idle("reset")  # AlreadyPendingCallError while a step is pending
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
            results = self._stepped([reset(k, self._actors[k]) for k in actors], actors)
        except ActorDiedError as exc:
            self._restart_or_raise(exc)
            return self.reset(seed=seed, options=given)
        except Exception:
            raise
        except BaseException:  # a Ctrl-C: some envs may have reset, others not
            self._cycle.half_done(INTERRUPTED)
            raise
        if mask is None:
            self._cycle.reset_done()
        self._ended[:] = False if mask is None else self._ended & ~mask
        infos: dict[str, Any] = {}
        for k, (obs, part, restarts) in zip(actors, results):
            self._count_restarts(k, restarts)
            self._last.of_actor[k] = obs
            infos = self._merge(infos, part, self.slices[k])
        return self._last.batch(), infos

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Steps every env with its action; returns batched (observations,
        rewards, terminations, truncations, infos)."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Hands every actor its envs' actions and returns at once."""
        self._check_open()
        check_sync(self, "step", "send/recv")
        self._cycle.check_steppable("step_async")  # AlreadyPendingCallError while a step is pending
        if self._ended.any():
            raise RuntimeError(
                f"envs {np.flatnonzero(self._ended).tolist()} ended their episodes and autoreset_mode is "
                "DISABLED: reset them with reset(options={'reset_mask': mask}) before stepping again")
        leaves = self._action_batches.checked_actions(actions, self.num_envs)

        def step(k: int) -> ray.ObjectRef:
            return self._actors[k].step.remote(
                self._action_batches.take(leaves, slice(self.slices[k].start, self.slices[k].stop)))

        # With Ctrl-C held: one then is raised once the step is pending, for step_wait() to collect.
        _core.run_holding_interrupt(self._post_step, step)

    def _post_step(self, step: Callable[[int], ray.ObjectRef]) -> None:
        refs: list = []
        try:
            for k in range(len(self._actors)):
                refs.append(step(k))
        except BaseException:  # a second Ctrl-C: some actors step, the others not
            if refs:
                self._cycle.half_done(INTERRUPTED)
            raise
        self._pending_step = (step, refs)
        self._cycle.begin(WAITING_STEP)

    def step_wait(self, timeout: float | None = None) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The results of ``step_async()``. After `timeout` seconds,
        ``TimeoutError``; the step stays pending, as after a Ctrl-C (its
        results are kept): call ``step_wait()`` again."""
        if self._cycle.phase is not WAITING_STEP:
            check_wait(self, WAITING_STEP, "send/recv")
        step, refs = self._pending_step
        if timeout is not None and ray.wait(refs, num_returns=len(refs), timeout=timeout)[1]:
            raise still_pending(timeout)
        try:
            batch = self._step_batch(step, refs)
        except Exception:
            self._cycle.finish()  # (if an env error or a spent budget has not moved it on already)
            raise
        # Only now: a Ctrl-C before this leaves the step pending, to be gathered again.
        self._cycle.finish()
        self._pending_step = None
        return batch

    def _step_batch(self, step: Callable[[int], ray.ObjectRef], refs: list) -> tuple:
        """The batch of a step from the actors' calls `refs` (made by `step`);
        made again from the same calls, it is the same."""
        results = self._step_results(step, refs)
        infos: dict[str, Any] = {}
        for k, (obs, _, _, _, part, restarts) in enumerate(results):
            self._count_restarts(k, restarts)
            self._last.of_actor[k] = obs
            infos = self._merge(infos, part, self.slices[k])
        rewards, terminations, truncations = (np.concatenate([r[i] for r in results]) for i in (1, 2, 3))
        if self.autoreset_mode is AutoresetMode.DISABLED:
            self._ended = terminations | truncations
        return self._last.batch(), rewards, terminations, truncations, infos

    def _merge(self, infos: dict, part: dict, rows: range) -> dict:
        return merge_infos(infos, part, np.arange(len(rows)), np.arange(rows.start, rows.stop), self.num_envs)

    # -- async mode (batch_size < num_envs) -------------------------------------

    def async_reset(self, *, seed: int | list[int | None] | None = None,
                    options: dict[str, Any] | None = None) -> None:
        """Resets every env; ``recv()`` then returns the reset observations
        ``batch_size`` envs at a time (rewards 0, flags False)."""
        self._check_open()
        check_async(self, "async_reset")
        seeds = seeds_for(seed, self.num_envs)
        check_async_reset_options(options)
        self._cycle.check_usable()
        self._handing_out = None  # a batch a Ctrl-C kept from the caller: reset too
        try:
            epoch = self._scheduler.drop_all()
            actors = range(len(self._actors))
            self._stepped([self._actors[k].async_reset.remote(seeds[self.slices[k].start:self.slices[k].stop],
                                                              options, epoch) for k in actors], actors)
        except ActorDiedError as exc:
            self._restart_or_raise(exc)
            return self.async_reset(seed=seed, options=options)
        except Exception:
            raise
        except BaseException:  # a Ctrl-C: some actors may have reset, others not
            self._cycle.half_done(INTERRUPTED)
            raise
        _core.run_holding_interrupt(self._all_reset)  # (with Ctrl-C held: the cycle and the scheduler agree)

    def _all_reset(self) -> None:
        self._cycle.reset_done()
        self._scheduler.all_reset()

    def send(self, actions: Any, env_ids: Any) -> None:
        """Hands envs `env_ids` their next actions and returns at once."""
        self._check_open()
        check_async(self, "send")
        self._cycle.check_steppable("send")
        scheduler = self._scheduler
        ids = checked_env_ids(env_ids, self.num_envs, scheduler.in_flight,
                              np.flatnonzero(scheduler.reset_pending).tolist(), self._handing_out)
        # With Ctrl-C held: every actor gets its envs' actions and they are marked in flight, or none.
        _core.run_holding_interrupt(scheduler.send, self._action_batches.checked_actions(actions, len(ids)), ids)

    def recv(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Waits for ``batch_size`` envs to finish and returns their
        (observations, rewards, terminations, truncations, infos), in the
        order they finished; ``infos["env_id"]`` says which envs they are."""
        self._check_open()
        check_async(self, "recv")
        if self._handing_out is None:
            self._gather_batch()
        batch, self._handing_out = self._handing_out, None
        return batch

    def _gather_batch(self) -> None:
        """recv()'s batch, gathered, as `_handing_out`. A Ctrl-C loses no env:
        an actor's call stays in progress until its result is kept (with
        Ctrl-C held), and one as the batch is taken comes once it is
        `_handing_out`, for the next recv() to return."""
        if self._cycle.phase is NEEDS_RESET:  # an env raised: its actor's envs wait for no call
            raise RuntimeError(self._cycle.why)
        scheduler = self._scheduler
        available = scheduler.available()
        if available < self.batch_size:
            raise RuntimeError(
                f"recv() needs {self.batch_size} envs in flight, but only {available} are: "
                "send() more first (or async_reset())")
        self._cycle.check_usable()
        have = scheduler.received()
        scheduler.ask(self.batch_size - have)
        while have < self.batch_size:
            k, ref = scheduler.next_finished()
            try:
                result: ActorBatch = self._stepped([ref], [k])[0]
            except ActorDiedError as exc:
                self._restart_or_raise(exc)
                scheduler.send_again(k)  # (drops its calls, this one included)
                scheduler.ask(self.batch_size - have)
                continue
            if isinstance(result, ErrorInAnotherCall):
                scheduler.done(ref)
                if scheduler.has_calls_to(k):
                    continue  # the call that carries the env's error is still to come
                self._cycle.half_done(ENV_RAISED)
                raise RuntimeError(result.why)
            self._count_restarts(k, result.restarts)
            _core.run_holding_interrupt(scheduler.add, k, ref, result)
            have = scheduler.received()
        _core.run_holding_interrupt(self._take_batch)

    def _take_batch(self) -> None:
        batch = self._scheduler.take(self.batch_size)
        if self._restart:
            self._last.remember(batch[4]["env_id"], batch[0])
        self._handing_out = batch

    # -- the rest of the contract (AttributesByCall: render, get_attr, ...) -----

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls method `name` of every env (or reads the attribute)."""
        self._check_open()
        self._cycle.check_idle("call")  # AlreadyPendingCallError while a step is pending
        return tuple(itertools.chain.from_iterable(
            self._fan_out(lambda k, actor: actor.call.remote(name, args, kwargs))))

    def _set_attr(self, name: str, values: list[Any]) -> None:
        """set_attr() (of AttributesByCall), with one value per env."""
        self._cycle.check_idle("set_attr")
        self._fan_out(lambda k, actor: actor.set_attr.remote(
            name, list(values[self.slices[k].start:self.slices[k].stop])))

    def close_extras(self, terminate: bool = False, **kwargs: Any) -> None:
        """Closes every actor's envs (at most a few seconds, unless
        `terminate`) and releases the actors."""
        self._cycle.close()
        actors, self._actors = getattr(self, "_actors", []), []
        if not actors or not ray.is_initialized():
            return
        if not terminate:
            refs = [actor.close.remote() for actor in actors]
            closed, _ = ray.wait(refs, num_returns=len(refs), timeout=CLOSE_GRACE_S)
            for ref in closed:  # the warnings the envs' close() raised
                try:
                    unwrapped(ray.get(ref))
                except Exception:  # close() goes on (an env's error here is the actor's to log)
                    pass
        for actor in actors:
            ray.kill(actor)

    def _check_open(self) -> None:
        self._cycle.check_usable()
