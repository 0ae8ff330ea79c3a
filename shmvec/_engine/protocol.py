"""Command codes and statuses shared by the front end and the workers.

Steps go through the arena and the native loop; everything else (reset,
call, attributes, set-up, close) is a command whose arguments and results are
pickled into the worker's request and reply byte areas. A payload larger than
its area is sent in chunks, so nothing is ever truncated."""

from __future__ import annotations

import pickle
from typing import Any, NamedTuple

import cloudpickle

from shmvec import _core

STEP = _core.STEP_COMMAND  # served natively by the worker
DESCRIBE = 2  # -> spaces and metadata of the worker's envs
ATTACH = 3  # map the whole arena, build the stepper
RESET = 4
CALL = 5
SET_ATTR = 6
CLOSE = 7
REQUEST_CHUNK = 8  # one more piece of a request too large for its area
REPLY_CHUNK = 9  # send the next piece of a reply too large for its area
FETCH_RECORD = 10  # an async record too large for its slot
MARK_RESTARTED = 12  # every env of the worker is new: its next step reports the restart
STARTED = 13  # a worker's first command, answered as it begins to make its envs

# A flag on a command's code: the caller's warning filters, which it changed
# since the worker last took them, come ahead of the request (caller_state).
TAKE_FILTERS = 0x100

OK = 0
ERROR = 1
WARNED = 2  # a flag on a reply's status: warnings come ahead of its bytes (see warning_relay)

_LENGTH_BYTES = 8

PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


def dumps(obj: Any) -> bytes:
    """Pickles a worker's results (infos, objects, replies): by pickle, and
    where pickle cannot name a class (one defined in a function, or in the
    user's script, which a fork server's workers got from cloudpickle) by
    cloudpickle, which the caller's pickle.loads reads back as its own class."""
    try:
        return pickle.dumps(obj, protocol=PICKLE_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError):
        return cloudpickle.dumps(obj, protocol=PICKLE_PROTOCOL)


loads = pickle.loads


def prefixed(head: bytes, data: bytes) -> bytes:
    """`head` ahead of a request's or reply's bytes (see split_prefixed)."""
    return len(head).to_bytes(_LENGTH_BYTES, "little") + head + data


def split_prefixed(data: bytes) -> tuple[bytes, bytes]:
    """The head that prefixed() put ahead of `data`, and the rest."""
    n = int.from_bytes(data[:_LENGTH_BYTES], "little")
    return data[_LENGTH_BYTES:_LENGTH_BYTES + n], data[_LENGTH_BYTES + n:]


class RemoteError:
    """An exception raised in a worker, with its traceback text and the env."""

    def __init__(self, exc: BaseException, tb: str, row: int, warnings: list | None = None):
        self.exc = exc
        self.tb = tb
        self.row = row
        self.warnings = warnings or []  # an async step's, raised before the error (see warning_relay)

    @classmethod
    def capture(cls, exc: BaseException, row: int, warnings: list | None = None) -> "RemoteError":
        import traceback

        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        try:
            pickle.loads(dumps(exc))
        except Exception:  # unpicklable exceptions still reach the caller
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        exc.__traceback__ = None
        return cls(exc, tb, row, warnings)


def encode_error(exc: BaseException, row: int, warnings: list | None = None) -> bytes:
    """An async env's exception as its record (recv() raises it), with the
    warnings its step raised before it."""
    return dumps(RemoteError.capture(exc, row, warnings))


class StepRecord(NamedTuple):
    """What an env's step (or reset) sends back beside the arena's arrays,
    when it has any of it. Slices build them as plain tuples (the native
    stepper does); the engine names them."""

    row: int
    info: dict | None  # the step's info (for an ended SAME_STEP episode: the reset's)
    ended: bool  # a SAME_STEP episode ended (or was cut short by a restart) in this step
    final_info: dict | None  # the ended episode's last info
    objects: list | None  # per-env values of observation leaves without a fixed shape
    final_obs: Any  # the ended episode's last observation, as the env returned it
