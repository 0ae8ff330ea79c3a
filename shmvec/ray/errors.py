"""The error a RayVecEnv raises when one of its actors dies."""

from __future__ import annotations

from typing import Any

from shmvec.errors import WorkerDiedError

__all__ = ["ActorDiedError"]


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

    def __init__(self, actor: int, env_indices: range, reason: str = "", call: Any = None):
        self.reason = reason
        self.call = call  # the Ray ObjectRef of the call that found the actor dead, where known
        super().__init__(actor, env_indices, None, (
            f"shmvec Ray actor {actor} (envs {env_indices.start}..{env_indices.stop - 1}) died: "
            f"{reason or 'no reason given'}; close this vector env and create a new one"))

    def __reduce__(self):
        return (type(self), (self.worker, self.env_indices, self.reason))
