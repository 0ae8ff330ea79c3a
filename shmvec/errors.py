"""Exceptions and warnings raised by shmvec."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import sys
import warnings

__all__ = ["WorkerDiedError", "RemoteTraceback", "ShmVecError", "ShmVecTimeoutError", "PerformanceWarning",
           "describe_exit", "warn_performance", "import_extra", "not_picklable"]


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, from multiprocessing's exitcode."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def import_extra(module: str, needed_by: str, what: str, extra: str) -> None:
    """Imports `module`, which an optional part of shmvec (`needed_by`)
    needs; if it or one of its own dependencies is missing, the error names
    the extra that installs them (the bare "No module named ..." does not)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f'{needed_by} needs {what}, which did not import ({exc}): '
                                  f'pip install "shmvec[{extra}]"', name=exc.name) from exc


def not_picklable(envs: object) -> TypeError:
    """The error for pickling or copying a vector env (``__reduce__``)."""
    return TypeError(
        f"a {type(envs).__module__}.{type(envs).__qualname__} cannot be pickled or copied: its worker processes "
        "and shared memory belong to the process that made it; pickle what makes it (its env_fns, or the "
        "envs.spec of shmvec.make) and make another there")


class ShmVecError(RuntimeError):
    """Raised by shmvec itself, never for an env: an env's own exception
    reaches the caller as itself, with the worker's traceback as its cause.

    Either the vector env is broken (a worker died or hung beyond the restart
    budget, ``WorkerDiedError``; from then on only ``close()`` works), or one
    call could not complete (workers were restarted during a ``call``: call
    again). The message says which, and what to do next."""


class PerformanceWarning(UserWarning):
    """shmvec runs, but a setting of the program makes it slower than it
    could be; the message gives the setting."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_performance(message: str) -> None:
    """A PerformanceWarning pointing at the user's line (the first caller
    outside shmvec, however deep the front end that made the env)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, PerformanceWarning, stacklevel=level)


class ShmVecTimeoutError(multiprocessing.TimeoutError, TimeoutError):
    """Workers did not answer in time. It is both the builtin ``TimeoutError``
    and ``multiprocessing.TimeoutError`` (what ``AsyncVectorEnv`` raises), so
    code written for either catches it."""


def describe_worker(worker: int, env_indices: range) -> str:
    """How errors name a worker: by its index and its envs."""
    return f"shmvec worker {worker} (envs {env_indices.start}..{env_indices.stop - 1})"


class WorkerDiedError(ShmVecError):
    """A worker process exited or was killed while the front end needed it."""

    def __init__(self, worker: int, env_indices: range, exitcode: int | None, message: str | None = None):
        self.worker = worker
        self.env_indices = env_indices
        self.exitcode = exitcode
        super().__init__(message or (
            f"{self._who()} died ({describe_exit(exitcode)}); close this vector env and create a new one"))

    def _who(self) -> str:
        return describe_worker(self.worker, self.env_indices)

    @classmethod
    def while_starting(cls, error: WorkerDiedError, start_method: str) -> WorkerDiedError:
        """`error` for a worker that died before its first reply. A worker
        reports its own errors and its env factories' through the arena; one
        that dies before it can has failed earlier, usually in Python starting
        the process, which says why on the worker's stderr."""
        message = (f"{error._who()} died while starting ({describe_exit(error.exitcode)}), "
                   "before it could report an error: its output above says why")
        if error.exitcode == 1 and start_method in ("forkserver", "spawn"):
            # The usual cause: multiprocessing refuses to start processes
            # while a worker imports the main module (RuntimeError, exit 1).
            message += (f". Under start_method=\"{start_method}\" each worker imports the main module again, "
                        "so a script must make its vector env under `if __name__ == \"__main__\":` "
                        "(or pass start_method=\"fork\")")
        return cls(error.worker, error.env_indices, error.exitcode, message)

    def __reduce__(self):
        return (type(self), (self.worker, self.env_indices, self.exitcode, str(self)))


class RemoteTraceback(Exception):
    """Carries the traceback of an exception raised in a worker process; it is
    attached as ``__cause__`` of the exception re-raised in the caller."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb
