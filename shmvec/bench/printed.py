"""What the measuring processes print, kept out of the bench's own output.

Envs' libraries print from C as they load (MuJoCo warns of a deprecated
attribute once per env made), which in every measurement would bury the
bench's table. A measuring process and every process under it that makes an
env print into a file of their own in a folder the bench reads when the
measurement ends: one file per process, because processes that print at once
would interleave their writes in a shared one (MuJoCo writes "WARNING" and
the rest of its line apart). The bench shows each distinct line once.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["PrintedFolder", "print_apart", "made_printing_apart", "take_printed"]

# Names the folder to processes started under a measuring process, which inherit it.
_FOLDER_VARIABLE = "SHMVEC_BENCH_PRINTED_INTO"
_FOLDER_PREFIX = "shmvec-bench-printed-"
_MAX_BYTES_PER_PROCESS = 1 << 20

_apart_in_pid: int | None = None  # the process that redirected (a forked child inherits this)


def print_apart() -> None:
    """Sends what this process prints, Python's and C libraries' alike, into a
    file of its own in the folder of the measuring process above it. Does
    nothing outside a measurement, or a second time in one process."""
    global _apart_in_pid
    folder = os.environ.get(_FOLDER_VARIABLE)
    if folder is None or _apart_in_pid == os.getpid():
        return
    try:
        fd = os.open(os.path.join(folder, f"{os.getpid()}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:  # the measurement ended (its folder went): print where the process did
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _apart_in_pid = os.getpid()


def _made_printing_apart(factory: Callable[[], Any]) -> Any:
    print_apart()
    return factory()


def made_printing_apart(factory: Callable[[], Any]) -> Callable[[], Any]:
    """`factory`, made to call `print_apart` first in the process that makes the env."""
    return functools.partial(_made_printing_apart, factory)


# Each distinct line the measuring processes printed, in order; `take_printed`
# hands out those not handed out yet.
_PRINTED: dict[str, None] = {}
_printed_taken = 0


def _remove_folders_of_ended_benches() -> None:
    """A bench killed (SIGKILL) could not remove its folders; the next one does."""
    pattern = os.path.join(tempfile.gettempdir(), f"{_FOLDER_PREFIX}*-*")
    for path in glob.glob(pattern):
        pid = os.path.basename(path)[len(_FOLDER_PREFIX):].partition("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, someone else's
            pass


class PrintedFolder:
    """The folder one measuring process and those under it print into:
    `enter_in_child` (in the measuring process) makes it theirs; `collect`
    (in the bench, once they ended) keeps each new line and removes it.
    Its name holds the bench's pid, for `_remove_folders_of_ended_benches`."""

    def __init__(self):
        _remove_folders_of_ended_benches()
        self._folder = tempfile.TemporaryDirectory(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")
        self.path = self._folder.name

    @staticmethod
    def enter_in_child(path: str) -> None:
        os.environ[_FOLDER_VARIABLE] = path
        print_apart()

    def collect(self) -> None:
        if not os.path.isdir(self.path):
            return
        for name in sorted(os.listdir(self.path), key=lambda name: int(name.partition(".")[0])):  # by pid
            with open(os.path.join(self.path, name), "rb") as f:
                text = f.read(_MAX_BYTES_PER_PROCESS).decode(errors="replace")
            for line in text.splitlines():
                if line.strip():
                    _PRINTED.setdefault(line.rstrip())
        self._folder.cleanup()


def take_printed() -> list[str]:
    """The lines measuring processes printed since the last call, each
    distinct one once in the whole run."""
    global _printed_taken
    lines = list(_PRINTED)[_printed_taken:]
    _printed_taken = len(_PRINTED)
    return lines
