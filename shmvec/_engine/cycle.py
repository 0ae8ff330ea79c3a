"""The command cycle of a vector env: the one state machine that every front
end (Gymnasium, SB3, Ray) runs its calls through, so that none can get the
order of calls, a failed call or a dead worker wrong on its own.

::

                      begin(WAITING_STEP | WAITING_RESET | WAITING_CALL)
        ┌──────────┐ ───────────────────────────────────────────────▶ ┌─────────┐
        │   IDLE   │                                                  │ WAITING │ a timeout or Ctrl-C in the
        └──────────┘ ◀─────────────────────────────────────────────── └─────────┘ wait: still WAITING (the
           ▲    │      finish(): the results were collected, or a call      │      results can be collected)
           │    │      failed without touching the envs' state              │
    a full │    │ half_done(why) (strict front ends): an env raised         │
     reset │    ▼ mid-batch, or a 2nd Ctrl-C stopped the caller's slice     │
        ┌─────────────┐ ◀───────────────────────────────────────────────────┘
        │ NEEDS_RESET │ calls and resets may begin (and return here); steps may not
        └─────────────┘
        BROKEN (break_(why): a worker died or hung beyond the restart budget): only close()
        CLOSED (close()): every call raises the front end's closed error

The WAITING phases' values are those of Gymnasium's ``AsyncState``, and the
errors for calls in the wrong phase are ``AsyncVectorEnv``'s, with its
messages. Checking that a step may begin is one comparison (``phase is
IDLE``): the step path pays nothing for the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError

from shmvec.errors import ShmVecError

__all__ = ["Phase", "IDLE", "WAITING_RESET", "WAITING_STEP", "WAITING_CALL", "NEEDS_RESET", "BROKEN", "CLOSED",
           "CommandCycle", "ENV_RAISED", "INTERRUPTED"]

ENV_RAISED = ("an env raised during the last call; reset all envs (reset(), or async_reset() in async mode) "
              "before stepping again")
INTERRUPTED = ("a step or reset was interrupted mid-batch; reset all envs (reset(), or async_reset() in async mode) "
               "before stepping again")


class Phase(Enum):
    IDLE = "default"
    WAITING_RESET = "reset"
    WAITING_STEP = "step"
    WAITING_CALL = "call"
    NEEDS_RESET = "needs reset"
    BROKEN = "broken"
    CLOSED = "closed"


# The members as module constants, which the front ends compare the phase
# with at every step: on Python 3.10 and 3.11 each `Phase.IDLE` goes through
# EnumMeta.__getattr__ (about 90 ns, against 20 ns on 3.12).
IDLE, WAITING_RESET, WAITING_STEP = Phase.IDLE, Phase.WAITING_RESET, Phase.WAITING_STEP
WAITING_CALL, NEEDS_RESET, BROKEN, CLOSED = Phase.WAITING_CALL, Phase.NEEDS_RESET, Phase.BROKEN, Phase.CLOSED

_WAITING = (WAITING_RESET, WAITING_STEP, WAITING_CALL)


class CommandCycle:
    """The phase of one vector env's command cycle (see the module docstring).

    `closed_error` makes the front end's error for a call on a closed env.
    `strict`: a batch left half done (an env raised during a step or reset,
    or a second Ctrl-C stopped the caller's own slice) requires a full reset before
    the next step (Gymnasium, Ray); SB3's front end is not strict, as
    ``DummyVecEnv`` is not."""

    def __init__(self, closed_error: Callable[[], Exception], strict: bool = True):
        self.phase = IDLE
        self.why: str | None = None  # of NEEDS_RESET or BROKEN
        self.strict = strict
        self._closed_error = closed_error
        self._resume = IDLE  # where a call returns to: IDLE or NEEDS_RESET

    @property
    def waiting(self) -> bool:
        """A call was begun and its results are still to be collected."""
        return self.phase in _WAITING

    # -- checks -----------------------------------------------------------------

    def closed_error(self) -> Exception:
        """The front end's error for a call on a closed env."""
        return self._closed_error()

    def check_usable(self) -> None:
        """Raises if the env is closed or broken."""
        if self.phase is CLOSED:
            raise self._closed_error()
        if self.phase is BROKEN:
            raise ShmVecError(self.why)

    def check_idle(self, method: str) -> None:
        """Raises unless a call may begin (`method`: the name the user called,
        e.g. ``"reset_async"``, for AsyncVectorEnv's message)."""
        if self.phase is IDLE or self.phase is NEEDS_RESET:
            return
        self.check_usable()
        raise AlreadyPendingCallError(
            f"Calling `{method}` while waiting for a pending call to `{self.phase.value}` to complete.",
            self.phase.value,
        )

    def check_steppable(self, method: str = "step_async") -> None:
        """Raises unless a step may begin."""
        if self.phase is IDLE:
            return
        self.check_idle(method)
        raise RuntimeError(self.why)  # NEEDS_RESET

    def check_waiting(self, phase: Phase) -> None:
        """Raises unless `phase`'s call is the one waiting: the closed or
        broken error if the env is so, else NoAsyncCallError (as for a
        *_wait without its *_async)."""
        if self.phase is phase:
            return
        self.check_usable()  # closed or broken: that, not a missing *_async
        raise NoAsyncCallError(
            f"Calling `{phase.value}_wait` without any prior call to `{phase.value}_async`.", phase.value)

    # -- transitions ------------------------------------------------------------

    def begin(self, phase: Phase) -> None:
        """A call begins (its command is being posted)."""
        if self.phase is not IDLE and self.phase is not NEEDS_RESET:
            self.check_idle(f"{phase.value}_async")
        self._resume, self.phase = self.phase, phase

    def finish(self) -> None:
        """The waiting call ended (its results were collected, or it failed
        leaving the envs as they were)."""
        if self.phase in _WAITING:
            self.phase = self._resume

    def half_done(self, why: str) -> None:
        """The waiting call (or async step) ended with its batch half done."""
        self.finish()
        if self.strict and self.phase is IDLE:
            self.phase, self.why = NEEDS_RESET, why

    def reset_done(self) -> None:
        """Every env was reset: they are in a known state again."""
        if self.phase is NEEDS_RESET:
            self.phase, self.why = IDLE, None

    def break_(self, why: str) -> None:
        """The env can no longer step (a worker failed beyond repair)."""
        if self.phase is not CLOSED:
            self.phase, self.why = BROKEN, why

    def close(self) -> Phase:
        """Closes the cycle; returns the phase it was in."""
        was, self.phase = self.phase, CLOSED
        return was
