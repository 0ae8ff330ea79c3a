"""Warnings that envs raise in a worker, shown by the caller.

Under SyncVectorEnv an env's warning is shown in the caller's process: its
filters decide, `warnings.catch_warnings(record=True)` and `pytest.warns`
around the call record it, and a message is shown once however many envs
raise it. A worker's filters are the caller's (caller_state.FilterSync
sends them again with the first command after the caller changes them),
and they decide there what is raised as an error, ignored or shown. What they would show is kept instead
(`WorkerRelay`) and goes back with the reply of the command that raised it:
framed ahead of a reply's bytes (`frame`/`unframe`, status bit
`protocol.WARNED`), or, for an async step, inside the env's record
(`Warned`) or its error. The caller then warns again with the same message,
category, file, line and module (`show`), so that its own filters and its
module registries have the last word, as if the env ran there.

Warnings are rare: nothing here runs on a step that raises none beyond one
list-length check in the worker's native loop.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any, NamedTuple

from shmvec._engine import protocol as P

__all__ = ["ForwardedWarning", "Warned", "WorkerRelay", "unframe", "unwrapped", "show"]


class ForwardedWarning(NamedTuple):
    message: Any  # the Warning instance, or its text where pickle refuses it
    category: type
    filename: str
    lineno: int
    module: str | None  # the name of the module that warned, where the worker knew it


class Warned(NamedTuple):
    """An async step's record (or None), or a Ray actor's result, and the
    warnings raised while it was made."""

    record: Any
    warnings: list


class WorkerRelay:
    """In a worker (or a Ray actor): keeps what its warning filters would
    show, of the warnings raised on `thread` (None: on any thread)."""

    def __init__(self, thread: int | None = None):
        self.pending: list[ForwardedWarning] = []  # the native serve loop checks its length
        self._show_here = warnings.showwarning
        self._modules: dict[str, str | None] = {}  # file name -> module name
        self._forwarding = False
        self._thread = thread

    def install(self) -> None:
        warnings.showwarning = self._keep  # the documented hook: called once the filters chose to show

    def _keep(self, message, category, filename, lineno, file=None, line=None) -> None:
        if (file is not None or self._forwarding  # written to a file on purpose, or raised while we pickle
                or self._thread is not None and threading.get_ident() != self._thread):
            self._show_here(message, category, filename, lineno, file, line)
            return
        self._forwarding = True
        try:
            self.pending.append(_forwardable(message, category, filename, lineno, self._module_of(filename)))
        finally:
            self._forwarding = False

    def _module_of(self, filename: str) -> str | None:
        if filename not in self._modules:
            self._modules[filename] = next(
                (name for name, module in list(sys.modules.items()) if getattr(module, "__file__", None) == filename),
                None)
        return self._modules[filename]

    def take(self) -> list[ForwardedWarning]:
        # In place (the native loop holds the list); one that another thread
        # appends meanwhile stays for the next take.
        n = len(self.pending)
        taken = self.pending[:n]
        del self.pending[:n]
        return taken

    def frame(self, status: int, data: bytes) -> tuple[int, bytes]:
        """A reply with the kept warnings ahead of its bytes (see unframe)."""
        if not self.pending:
            return status, data
        return status | P.WARNED, P.prefixed(P.dumps(self.take()), data)

    def wrap(self, record: Any) -> Warned:
        """An async step's record, with the warnings kept during the step."""
        return Warned(record, self.take())

    def encode_error(self, exc: BaseException, row: int) -> bytes:
        """An async step's error as its record, with the warnings kept during the step."""
        return P.encode_error(exc, row, self.take())

    def show_here(self) -> None:
        """Shows what is still kept in this process (a worker on its way out)."""
        for w in self.take():
            self._show_here(w.message, w.category, w.filename, w.lineno)


def _forwardable(message, category, filename, lineno, module) -> ForwardedWarning:
    try:
        P.dumps((message, category))
    except Exception:  # the warning's arguments (or its class) do not pickle: its text does
        try:
            P.dumps(category)
        except Exception:
            category = UserWarning
        message = str(message)
    return ForwardedWarning(message, category, filename, lineno, module)


def unwrapped(result: Any) -> Any:
    """A result that may carry warnings (`Warned`): shows them, and returns
    the result itself."""
    if type(result) is Warned:
        show(result.warnings)
        return result.record
    return result


def unframe(data: bytes) -> tuple[list[ForwardedWarning], bytes]:
    """The warnings ahead of a reply flagged WARNED, and the reply itself."""
    kept, data = P.split_prefixed(data)
    return P.loads(kept), data


# Registries of modules the caller has not imported, by module (or file) name:
# each message is shown once per location, as the module's own would.
_registries: dict[str, dict] = {}


def show(forwarded: list[ForwardedWarning]) -> None:
    """Warns again in the caller: its filters decide (an "error" one raises
    the warning here), and the module's registry remembers what was shown."""
    for w in forwarded:
        module = sys.modules.get(w.module) if w.module else None
        if module is not None:
            module_globals = module.__dict__
            registry = module_globals.setdefault("__warningregistry__", {})
        else:
            module_globals = None
            registry = _registries.setdefault(w.module or w.filename, {})
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, module=w.module, registry=registry,
                               module_globals=module_globals)
