"""Which CPUs pinned workers take. A reservation is an exclusive flock on a
per-CPU lock file, held by the front end for the engine's life: vector envs
of this program *and of other programs* then avoid each other's CPUs, and a
crash cannot leave a reservation behind (the kernel drops the lock)."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Sequence

from shmvec._system import allowed_cpu_ids

__all__ = ["choose_cpus"]


def _lock_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"shmvec-cpus-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _try_reserve(cpu: int) -> int | None:
    """An fd holding CPU `cpu`'s lock, or None if someone holds it."""
    fd = os.open(os.path.join(_lock_dir(), f"cpu{cpu}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def choose_cpus(count: int, pin: bool | str | Sequence[int], leave_free: int) -> tuple[list[int | None], list[int]]:
    """CPUs for `count` workers, and the lock fds that reserve them.

    - ``False``: no pinning.
    - a list: those CPUs, as given (no reservation).
    - ``"auto"``: pin only if every worker gets a CPU that no other shmvec
      vector env holds, with `leave_free` CPUs left for the caller;
      otherwise leave scheduling to the kernel.
    - ``True``: pin; free CPUs first, then shared ones if there are too few.
    """
    if pin is False or count == 0:
        return [None] * count, []
    if not isinstance(pin, (bool, str)):
        if len(pin) < count:
            raise ValueError(f"pin_workers lists {len(pin)} CPUs for {count} workers")
        return list(pin)[:count], []
    allowed = sorted(allowed_cpu_ids(), reverse=True)  # from the top: CPU 0 takes most interrupts
    chosen, fds = [], []
    for cpu in allowed:
        if len(chosen) == count:
            break
        fd = _try_reserve(cpu)
        if fd is not None:
            chosen.append(cpu)
            fds.append(fd)
    if pin == "auto" and (len(chosen) < count or len(allowed) - count < leave_free):
        for fd in fds:
            os.close(fd)
        return [None] * count, []
    shared = [cpu for cpu in allowed if cpu not in chosen] or allowed
    while len(chosen) < count:  # pin=True with too few free CPUs: share
        chosen.append(shared[len(chosen) % len(shared)])
    return chosen, fds
