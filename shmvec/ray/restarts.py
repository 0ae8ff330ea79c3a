"""What RayVecEnv keeps for restarts: one budget for actors and workers,
and the observations each env was last handed."""

from __future__ import annotations

from typing import Any

import numpy as np

from shmvec.ray.batches import LeafBatches

__all__ = ["RestartBudget", "LastObservations"]


class RestartBudget:
    """One budget for the whole vector env, as in ShmVecEnv: actors Ray
    restarts and workers the actors' ShmVecEnvs restart, all counted
    together. (Each actor's ShmVecEnv also stops at max_restarts of its own.)"""

    def __init__(self, max_restarts: int, num_actors: int):
        self.max_restarts = max_restarts
        self._actors = 0
        self._workers = [0] * num_actors  # as reported by each actor's current life
        self._earlier_workers = 0  # worker restarts of actors' earlier lives

    @property
    def used(self) -> int:
        return self._actors + self._earlier_workers + sum(self._workers)

    @property
    def spent(self) -> bool:
        return self.used >= self.max_restarts

    def actor_restarted(self, k: int) -> None:
        """Actor `k` is being restarted: a new life, whose ShmVecEnv counts its workers afresh."""
        self._actors += 1
        self._earlier_workers += self._workers[k]
        self._workers[k] = 0

    def workers_reported(self, k: int, restarts: int) -> bool:
        """Notes the worker restarts actor `k` reports; True if beyond the budget."""
        self._workers[k] = restarts
        return self.used > self.max_restarts


class LastObservations:
    """The observations each env was last handed: what the envs of an actor
    Ray rebuilt report their episodes cut short at.

    Synchronous mode keeps each actor's last batch (which it needs anyway: a
    masked reset hands out the others' batches again); async mode keeps them
    env by env, leaf by leaf, as recv() hands envs out (with restarts only)."""

    def __init__(self, batches: LeafBatches, slices: list[range], per_env: bool):
        self._batches, self._slices, self._per_env = batches, slices, per_env
        self.of_actor: list[Any] = [None] * len(slices)  # synchronous mode
        self._leaves: list | None = None  # async mode

    def batch(self) -> Any:
        """Synchronous mode: the actors' last batches, as one."""
        return self._batches.join(self.of_actor)

    def remember(self, ids: np.ndarray, observations: Any) -> None:
        """Async mode: envs `ids` were handed `observations`."""
        if self._leaves is None:
            num_envs = self._slices[-1].stop
            self._leaves = [np.zeros((num_envs, *leaf.shape), leaf.dtype) if leaf.fixed else [None] * num_envs
                            for leaf in self._batches.leaves]
        for last, value in zip(self._leaves, self._batches.flatten(observations)):
            if isinstance(last, np.ndarray):
                last[ids] = value
            else:
                for i, v in zip(ids.tolist(), value):
                    last[i] = v

    def of(self, k: int) -> Any:
        """The observations actor `k`'s envs were last handed (None: never)."""
        if not self._per_env:
            return self.of_actor[k]
        if self._leaves is None:
            return None
        rows = self._slices[k]
        return self._batches.take(self._leaves, slice(rows.start, rows.stop))
