"""Which call a vector env is waiting for: the state behind AsyncVectorEnv's
``*_async`` / ``*_wait`` pairs, owned once for every front end.

A call is begun (``reset_async``, ``step_async``, ``call_async``), then
collected by its ``*_wait``. Until then no other call may begin, and a
``*_wait`` without its begin is an error: the same exceptions, with the same
messages, as ``gymnasium.vector.AsyncVectorEnv``. A wait that times out or is
interrupted leaves the call pending, so its results can still be collected.
"""

from __future__ import annotations

from enum import Enum

from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError

__all__ = ["CallState", "PendingCall"]


class CallState(Enum):
    """The values are AsyncVectorEnv's ``AsyncState`` values."""

    DEFAULT = "default"
    WAITING_RESET = "reset"
    WAITING_STEP = "step"
    WAITING_CALL = "call"


class PendingCall:
    """The state of one vector env's call cycle."""

    def __init__(self) -> None:
        self.state = CallState.DEFAULT

    @property
    def pending(self) -> bool:
        return self.state is not CallState.DEFAULT

    def check_idle(self, method: str) -> None:
        """Raises AlreadyPendingCallError if a call is pending (`method` is the
        name the user called, e.g. ``"step_async"`` or ``"set_attr"``)."""
        if self.state is not CallState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{method}` while waiting for a pending call to `{self.state.value}` to complete.",
                self.state.value,
            )

    def begin(self, state: CallState) -> None:
        self.check_idle(f"{state.value}_async")
        self.state = state

    def check_waiting(self, state: CallState) -> None:
        """Raises NoAsyncCallError unless `state`'s call is the pending one."""
        if self.state is not state:
            raise NoAsyncCallError(
                f"Calling `{state.value}_wait` without any prior call to `{state.value}_async`.",
                state.value,
            )

    def end(self) -> None:
        self.state = CallState.DEFAULT
