"""RayVecEnv's async mode (batch_size < num_envs): which envs are where.

Envs go to the actors that host them; each actor's ShmVecEnv receives its
envs one at a time, so an actor can be asked for any number of its finished
envs (``SliceHost.recv(count)``). To gather envs from whichever actors finish
first without a Ray call per env, every actor with a chunk of envs in flight
(its share of a batch) has a recv call for that chunk in progress, and the
envs left over are asked for only when the next batch needs them. Results
beyond a batch wait for the next recv()."""

from __future__ import annotations

from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
import ray

from shmvec._engine.warning_relay import unwrapped
from shmvec.ray.batches import LeafBatches
from shmvec.ray.infos import merge_infos

__all__ = ["AsyncScheduler", "ActorBatch", "ErrorInAnotherCall"]


class ActorBatch(NamedTuple):
    """Envs an actor's recv() brought back, in the order they finished."""

    observations: Any
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    infos: dict[str, Any]
    env_ids: np.ndarray  # the actor's own rows; the vector env's once added
    restarts: int = 0  # workers the actor's ShmVecEnv has restarted so far


class ErrorInAnotherCall(NamedTuple):
    """What an actor's recv call returns when another of its calls has
    raised an env's error since the last reset. Ray may run an async actor's
    calls in another order than they were made, so the driver may see this
    call first: it waits for the one that carries the error."""

    why: str  # the actor's "reset all envs" message


class AsyncScheduler:
    """The send/recv bookkeeping of one RayVecEnv in async mode."""

    def __init__(self, actors: list, slices: list[range], batch_size: int, observations: LeafBatches,
                 actions: LeafBatches, action_space: gym.Space):
        self._num_envs = num_envs = slices[-1].stop
        self._actors, self._slices = actors, slices
        self._starts = np.array([rows.start for rows in slices])
        self._observations, self._actions, self._action_space = observations, actions, action_space
        # Envs sent (or reset) and not yet received by the caller.
        self.in_flight = np.zeros(num_envs, dtype=np.bool_)
        self.reset_pending = np.zeros(num_envs, dtype=np.bool_)
        # Per actor: envs in flight not yet asked for, and how many one recv call asks for.
        self._unasked = np.zeros(len(slices), dtype=np.int64)
        self._chunk = [max(1, round(batch_size * len(rows) / num_envs)) for rows in slices]
        self._calls: dict[ray.ObjectRef, tuple[int, int]] = {}  # recv calls in progress -> (actor, envs)
        self._results: list[ActorBatch] = []  # brought back, not yet received by the caller
        # async_reset()s so far. Sends carry it: Ray may run a send() after
        # the async_reset() made next, and the actor drops it then.
        self.epoch = 0

    def drop_all(self) -> int:
        """Forgets every env in flight (for async_reset), once the calls in
        progress have landed (each actor's ShmVecEnv drops what is still in
        flight); returns the epoch of the reset to come."""
        for ref in self._calls:
            try:
                unwrapped(ray.get(ref))  # dropped, but not the warnings its envs raised
            except Exception:  # the reset to come ends what failed
                pass
        self._calls.clear()
        self._results.clear()
        self.epoch += 1
        return self.epoch

    def all_reset(self) -> None:
        """Every env was reset: recv() hands them out."""
        self.in_flight[:] = False
        self.reset_pending[:] = True
        self._unasked[:] = [len(rows) for rows in self._slices]
        self.ask()

    def send(self, leaves: list, ids: np.ndarray) -> None:
        """Sends envs `ids` their actions (the leaves of a checked batch)."""
        owner = np.searchsorted(self._starts, ids, side="right") - 1
        for k in np.unique(owner):
            mine = np.flatnonzero(owner == k)
            self._actors[k].send.remote(self._actions.take(leaves, mine), ids[mine] - self._starts[k], self.epoch)
            self._unasked[k] += len(mine)
        self.in_flight[ids] = True
        self.ask()

    def available(self) -> int:
        """Envs the caller can still receive."""
        return int(self.in_flight.sum() + self.reset_pending.sum())

    def received(self) -> int:
        """Envs brought back and not yet handed out."""
        return sum(len(r.env_ids) for r in self._results)

    def ask(self, needed: int = 0) -> None:
        """Asks actors for their finished envs: a chunk from each actor with
        enough envs in flight and, when the next batch needs them (`needed`
        envs beyond the results at hand), the envs left over as well."""
        for k in range(len(self._actors)):
            while self._unasked[k] >= self._chunk[k]:
                self._call(k, self._chunk[k])
        short = needed - sum(count for _, count in self._calls.values())
        if short > 0:
            for k in np.flatnonzero(self._unasked):
                self._call(int(k), int(min(self._unasked[k], short)))

    def _call(self, k: int, count: int) -> None:
        self._calls[self._actors[k].recv.remote(count)] = (k, count)
        self._unasked[k] -= count

    def has_calls_to(self, k: int) -> bool:
        """Whether a recv call to actor `k` is in progress."""
        return any(j == k for j, _ in self._calls.values())

    def next_finished(self) -> tuple[int, ray.ObjectRef]:
        """Waits for a recv call to finish: its actor and the call's ref. The
        call stays in progress until ``done()`` or ``add()`` (a Ctrl-C
        before then finds it again)."""
        (ref,), _ = ray.wait(list(self._calls), num_returns=1)
        return self._calls[ref][0], ref

    def done(self, ref: ray.ObjectRef) -> None:
        """The call `ref` was dealt with, without a result to keep."""
        del self._calls[ref]

    def add(self, k: int, ref: ray.ObjectRef, result: ActorBatch) -> None:
        """Keeps actor `k`'s `result` (of its call `ref`) for the caller."""
        del self._calls[ref]
        self._results.append(result._replace(env_ids=result.env_ids + self._starts[k]))

    def send_again(self, k: int) -> None:
        """Actor `k` was rebuilt: the envs it had in flight go again, to come
        back with their restart reports (which ignore the action); the
        others report at their next send()."""
        for ref in [ref for ref, (j, _) in self._calls.items() if j == k]:
            del self._calls[ref]  # died with it
        rows = self._slices[k]
        received = {int(i) for r in self._results for i in r.env_ids}
        lost = [i for i in rows if (self.in_flight[i] or self.reset_pending[i]) and i not in received]
        self._unasked[k] = len(lost)
        if lost:
            actions = self._actions.checked_actions(self._action_space.sample(), self._num_envs)
            self._actors[k].send.remote(self._actions.take(actions, np.asarray(lost)), np.asarray(lost) - rows.start,
                                        self.epoch)

    def take(self, count: int) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The first `count` envs of the results at hand, as one batch, with
        their ids in ``infos["env_id"]``."""
        taken, have = [], 0
        while have < count:
            result = self._results.pop(0)
            n = min(count - have, len(result.env_ids))
            if n < len(result.env_ids):  # keep the rest of this actor's results for the next recv()
                self._results.insert(0, self._rows(result, np.arange(n, len(result.env_ids))))
            taken.append((result, n))
            have += n
        batches = self._observations
        obs = batches.join([batches.take(batches.flatten(r.observations), slice(0, n)) for r, n in taken])
        infos: dict[str, Any] = {}
        position = 0
        for r, n in taken:
            infos = merge_infos(infos, r.infos, np.arange(n), np.arange(position, position + n), count)
            position += n
        ids = np.concatenate([r.env_ids[:n] for r, n in taken]).astype(np.int64)
        infos["env_id"] = ids
        self.in_flight[ids] = False
        self.reset_pending[ids] = False
        rewards, terminations, truncations = (np.concatenate([getattr(r, name)[:n] for r, n in taken])
                                              for name in ("rewards", "terminations", "truncations"))
        return obs, rewards, terminations, truncations, infos

    def _rows(self, result: ActorBatch, rows: np.ndarray) -> ActorBatch:
        """Rows `rows` of a result."""
        infos = merge_infos({}, result.infos, rows, np.arange(len(rows)), len(rows))
        obs = self._observations.take(self._observations.flatten(result.observations), rows)
        return ActorBatch(obs, result.rewards[rows], result.terminations[rows], result.truncations[rows], infos,
                          result.env_ids[rows], result.restarts)
