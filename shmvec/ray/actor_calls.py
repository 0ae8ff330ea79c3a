"""RayVecEnv's side of its actors: creating them, calls to all of them at
once, and what an actor's death does: an ``ActorDiedError`` naming that
actor or, with ``restart_failed_workers``, a revival within the vector
env's one restart budget."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError

from shmvec import _core
from shmvec._engine.cycle import ENV_RAISED, CommandCycle
from shmvec._engine.warning_relay import show, unwrapped
from shmvec.errors import ShmVecError, WorkerDiedError
from shmvec.ray.actor import SliceHost
from shmvec.ray.errors import ActorDiedError
from shmvec.ray.restarts import LastObservations, RestartBudget

__all__ = ["ActorCalls"]

# A call to an actor that Ray is restarting (older Rays, within ray>=2.9, have no such error).
_ACTOR_UNAVAILABLE = getattr(ray.exceptions, "ActorUnavailableError", ())
# Ray queues an actor, without a word, until the cluster has the resources it
# asks for, and starts its process at low priority (nice 15): after this long,
# RayVecEnv says which actors wait and what for, at start and at a restart.
STARTUP_NOTICE_S = 30.0
# How long Ray may take to restart a dead actor: beside busy processes a
# niced actor takes ten times as long to start as on an idle node.
REVIVE_TIMEOUT_S = 300.0


def warnings_of(exc: BaseException) -> list:
    """The warnings an actor's call raised before it failed with `exc`
    (``relayed``), as Ray raises it in the driver (the actor's exception is its cause)."""
    return getattr(exc, "shmvec_warnings", None) or getattr(getattr(exc, "cause", None), "shmvec_warnings", None) or []


class ActorCalls:
    """A base of RayVecEnv: its Ray actors, one per slice of its envs
    (``slices``), each hosting a ShmVecEnv (``SliceHost``).

    RayVecEnv sets ``slices`` before ``_create_actors()``, and ``_last``
    (the observations each env was last handed) once it knows the
    observation space. Failures move RayVecEnv's ``_cycle`` (shmvec._engine.cycle):
    a failed step leaves its batch half done, a spent budget breaks it."""

    slices: list[range]
    _last: LastObservations
    _cycle: CommandCycle

    def _create_actors(self, env_fns: list, async_mode: bool, shmvec_kwargs: dict[str, Any],
                       actor_options: dict[str, Any] | None) -> None:
        """Creates the actors (their envs start in _start_actors)."""
        options = {"num_cpus": 1, **(actor_options or {})}
        self._actor_ask = {"CPU": options["num_cpus"], "GPU": options.get("num_gpus", 0),
                           **options.get("resources", {})}
        self._restart = bool(shmvec_kwargs.get("restart_failed_workers", False))
        self.max_restarts = int(shmvec_kwargs.get("max_restarts", 10))  # ShmVecEnv's default
        self._budget = RestartBudget(self.max_restarts, len(self.slices))
        self._revived_after: dict[int, ray.ObjectRef | None] = {}  # per actor: the failed call of its last revival
        if self._restart:  # Ray restarts a dead actor's process; _revive() rebuilds its envs
            options.setdefault("max_restarts", self.max_restarts)
        actor_class = ray.remote(SliceHost).options(**options)
        self._actors = [actor_class.remote() for _ in self.slices]
        # Each actor's ShmVecEnv receives one env at a time, so that the
        # front end can ask an actor for any number of finished envs.
        self._start_args = [([env_fns[i] for i in rows], 1 if async_mode else None, shmvec_kwargs)
                            for rows in self.slices]

    @property
    def restarts(self) -> int:
        """Actors and workers restarted so far, counted against max_restarts."""
        return self._budget.used

    def _start_actors(self) -> list:
        """Starts every actor's envs and returns their descriptions; if they
        are not all up within STARTUP_NOTICE_S, a RuntimeWarning says how many
        wait, what each asks for and what the cluster has free."""
        refs = [actor.start.remote(*args) for actor, args in zip(self._actors, self._start_args)]
        _, waiting = ray.wait(refs, num_returns=len(refs), timeout=STARTUP_NOTICE_S)
        if waiting:
            warnings.warn(
                f"RayVecEnv: {len(waiting)} of {len(refs)} actors have not started their envs after "
                f"{STARTUP_NOTICE_S:g} s; {self._resources_note()}. Ray starts an actor once the resources it "
                "asks for are free: close the vector envs or actors that hold them, ask for less with "
                "actor_options, or let an autoscaler add nodes (a slow env factory, or a node kept busy by "
                "other processes, takes this long too: Ray runs actors at nice 15). Still waiting; Ctrl-C "
                "stops.", RuntimeWarning, stacklevel=3)
        return self._get(refs, range(len(refs)))

    def _resources_note(self) -> str:
        """What each actor asks for, and what the cluster has free."""
        ask = {k: v for k, v in self._actor_ask.items() if v}
        available, cluster = ray.available_resources(), ray.cluster_resources()
        free = {k: available.get(k, 0) for k in ask}
        total = {k: cluster.get(k, 0) for k in ask}
        return f"each asks for {ask}, and the cluster has {free} free of {total}"

    def _gather(self, call: Callable[[int, Any], ray.ObjectRef]) -> list:
        """Makes `call` on every actor at once and gathers the results in one
        round. The calls are made with Ctrl-C held: to every actor, or none
        (a set_attr sets every env's value or none)."""
        refs: list = []
        _core.run_holding_interrupt(self._call_each, call, refs)
        return self._get(refs, range(len(self._actors)))

    def _call_each(self, call: Callable[[int, Any], ray.ObjectRef], refs: list) -> None:
        refs.extend(call(k, actor) for k, actor in enumerate(self._actors))

    def _get(self, refs: list, actors: Sequence[int]) -> list:
        """ray.get of calls made to `actors` (one each), showing the warnings
        their envs raised (all of them before an env's error, as a ShmVecEnv
        shows its workers'); a dead actor raises ActorDiedError naming the
        actor of the call that failed (Ray's error may not say which: its
        actor_id can be None)."""
        try:
            results = ray.get(refs)
        except Exception as exc:
            error = exc
        else:
            return [unwrapped(result) for result in results]
        for k, ref in zip(actors, refs):
            try:
                unwrapped(ray.get(ref))
            except RayActorError as exc:
                if isinstance(error, RayActorError):
                    raise ActorDiedError(k, self.slices[k], str(exc).strip().splitlines()[0], ref) from exc
            except Exception as exc:  # an env's error (or a warning the driver's filters make one)
                show(warnings_of(exc))
        raise error

    def _revive(self, died: ActorDiedError) -> None:
        """After an actor died (restart_failed_workers): waits for Ray to
        restart it and rebuilds its envs, marked restarted: each one's next
        step reports it, as a ShmVecEnv reports envs of a restarted worker.
        Its death is counted once: a Ctrl-C after a revival, before the call
        that failed is made again, leaves that call to fail again, and the
        revival it leads to rebuilds the envs without counting."""
        k = died.worker
        rows = self.slices[k]
        if died.call is None or self._revived_after.get(k) is not died.call:
            if self._budget.spent:
                self._cycle.break_(f"shmvec Ray actor {k} died and the restart budget "
                                   f"max_restarts={self.max_restarts} is spent; close this vector env")
                raise ActorDiedError(k, rows, f"{died.reason}; the restart budget max_restarts={self.max_restarts} "
                                     "is spent")
            _core.run_holding_interrupt(self._count_revival, k, died.call)
        try:
            self._rebuild(k, rows)
        except Exception:
            raise
        except BaseException:  # a Ctrl-C: Ray may have restarted the actor, but its envs are not rebuilt
            self._cycle.break_(f"a Ctrl-C stopped the restart of shmvec Ray actor {k}; close this vector env")
            raise

    def _count_revival(self, k: int, failed_call: ray.ObjectRef | None) -> None:
        self._budget.actor_restarted(k)
        self._revived_after[k] = failed_call

    def _rebuild(self, k: int, rows: range) -> None:
        """_revive()'s wait for Ray to restart actor `k`, then its envs."""
        actor = self._actors[k]
        began = time.monotonic()
        noticed = False
        while True:
            try:
                self._get([actor.start.remote(*self._start_args[k])], [k])
                self._get([actor.restarted.remote(self._last.of(k))], [k])
                return
            except ActorDiedError as exc:
                # "Temporarily unavailable": Ray is still restarting it.
                waited = time.monotonic() - began
                if isinstance(exc.__cause__, _ACTOR_UNAVAILABLE) and waited < REVIVE_TIMEOUT_S:
                    if waited >= STARTUP_NOTICE_S and not noticed:
                        noticed = True
                        warnings.warn(
                            f"RayVecEnv: Ray has not restarted actor {k} (envs {rows.start}..{rows.stop - 1}) "
                            f"after {STARTUP_NOTICE_S:g} s; {self._resources_note()}. Ray restarts it once a node "
                            "has them free; beside busy processes its process starts slowly (Ray runs actors at "
                            f"nice 15). Still waiting, up to {REVIVE_TIMEOUT_S:g} s in all.", RuntimeWarning,
                            stacklevel=2)
                    time.sleep(0.1)
                    continue
                self._cycle.break_(f"shmvec Ray actor {k} died and Ray did not restart it; close this vector env")
                raise ActorDiedError(k, rows, f"{exc.reason}; Ray did not restart it") from exc

    def _count_restarts(self, k: int, reported: int) -> None:
        """Notes the worker restarts actor `k` reported; beyond the budget,
        WorkerDiedError."""
        if self._budget.workers_reported(k, reported):
            self._cycle.break_(f"shmvec Ray actor {k} (envs {self.slices[k].start}..{self.slices[k].stop - 1}) "
                               f"restarted a worker and the restart budget max_restarts={self.max_restarts} is "
                               "spent; close this vector env")
            raise WorkerDiedError(k, self.slices[k], None, self._cycle.why)

    def _restart_or_raise(self, exc: ActorDiedError) -> None:
        """Revives the actor that `exc` names, or raises `exc` without restarts."""
        if not self._restart:
            raise exc
        self._revive(exc)

    def _stepped(self, refs: list, actors: Sequence[int]) -> list:
        """Gathers results of steps or resets: after an env error, some envs
        stepped (or reset) and others did not, so only a full reset brings
        them back to a known state."""
        try:
            return self._get(refs, actors)
        except ActorDiedError:
            raise
        except Exception:
            self._cycle.half_done(ENV_RAISED)
            raise

    def _step_results(self, step: Callable[[int], ray.ObjectRef], refs: list) -> list:
        """Each actor's step result, from `refs` (`step(k)` made actor k's
        call). With restart_failed_workers, an actor that died is restarted
        and stepped again (its new call replaces its ref: gathering again
        after a Ctrl-C revives nothing twice): its envs' restart reports
        are their results."""
        actors = range(len(self._actors))
        try:
            return self._stepped(refs, actors)
        except ActorDiedError:
            if not self._restart:
                raise
        results = []
        for k in actors:
            try:
                results += self._stepped([refs[k]], [k])
            except ActorDiedError as exc:
                self._revive(exc)
                refs[k] = step(k)
                results += self._stepped([refs[k]], [k])
        return results

    def _fan_out(self, call: Callable[[int, Any], ray.ObjectRef]) -> list:
        """`call` on every actor; after a restart, the caller must call again."""
        try:
            return self._gather(call)
        except ActorDiedError as exc:
            self._restart_or_raise(exc)
            raise ShmVecError(f"shmvec Ray actor {exc.worker} died during this call and was restarted "
                              "(its envs reset); call again") from exc
