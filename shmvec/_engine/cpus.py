"""Which CPUs pinned workers take. A reservation is an exclusive flock on a
per-CPU lock file, held by the front end for the engine's life: vector envs
of this program *and of other programs* then avoid each other's CPUs, and a
crash cannot leave a reservation behind (the kernel drops the lock).

The lock files live in a directory private to this user:
``$XDG_RUNTIME_DIR/shmvec-cpus`` when that is usable, else
``$TMPDIR/shmvec-cpus-$UID``; either must be a real directory (not a
symlink), owned by us, mode 0700. If anything is wrong with it, workers run
unpinned (one RuntimeWarning): the lock directory never fails a vector env."""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
import warnings
from collections.abc import Sequence

from shmvec import _core
from shmvec._engine.system import PARENT_ONLY_FDS, allowed_cpu_ids

__all__ = ["choose_cpus", "CallerCpu"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_private_dir(path: str) -> int:
    """An fd of the directory `path`, made if missing. Raises OSError unless
    it is a real directory, owned by us, mode 0700."""
    try:
        os.mkdir(path, 0o700)  # a umask can only take bits away
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise OSError(f"{path} belongs to uid {st.st_uid}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise OSError(f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not 700")
    fd = os.open(path, _DIR_FLAGS)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):  # replaced meanwhile
            raise OSError(f"{path} changed while it was checked")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _runtime_dir() -> str | None:
    """$XDG_RUNTIME_DIR if it is usable: absolute, a directory of ours, mode 0700."""
    path = os.environ.get("XDG_RUNTIME_DIR")
    if not path or not os.path.isabs(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    ok = stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
    return path if ok else None


def _open_lock_dir() -> int:
    runtime = _runtime_dir()
    if runtime is not None:
        try:
            return _open_private_dir(os.path.join(runtime, "shmvec-cpus"))
        except OSError:
            pass  # then the per-user directory in TMPDIR
    return _open_private_dir(os.path.join(tempfile.gettempdir(), f"shmvec-cpus-{os.getuid()}"))


def _try_reserve(dir_fd: int, cpu: int) -> int | None:
    """An fd holding CPU `cpu`'s lock, or None if someone holds it. Raises
    OSError if the lock file cannot be opened or locked."""
    fd = os.open(f"cpu{cpu}.lock", _LOCK_FLAGS, 0o600, dir_fd=dir_fd)
    PARENT_ONLY_FDS.add(fd)  # at once: no fork child may keep the CPU reserved
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BaseException as exc:
        _release([fd])
        if isinstance(exc, BlockingIOError):
            return None
        raise


def _release(fds: list[int]) -> None:
    for fd in fds:
        PARENT_ONLY_FDS.discard(fd)
        os.close(fd)


def choose_cpus(count: int, pin: bool | str | Sequence[int], leave_free: int,
                busy_cpus: int = 0) -> tuple[list[int | None], list[int]]:
    """CPUs for `count` workers, and the lock fds that reserve them.

    - ``False``: no pinning.
    - a list: those CPUs, as given (no reservation).
    - ``"auto"``: pin only if every worker gets a CPU that no other shmvec
      vector env holds, with `leave_free` CPUs left for the caller, and no
      CPU is kept busy by other programs (`busy_cpus`, from
      system.cpus_busy_elsewhere): a pinned worker cannot move away from a
      core that another program takes.
      Otherwise leave scheduling to the kernel.
    - ``True``: pin; free CPUs first, then shared ones if there are too few.

    Without a usable lock directory (see above), ``"auto"`` and ``True`` give
    unpinned workers and one RuntimeWarning.
    """
    if pin is False or count == 0:
        return [None] * count, []
    if not isinstance(pin, (bool, str)):
        if len(pin) < count:
            raise ValueError(f"pin_workers lists {len(pin)} CPUs for {count} workers")
        return list(pin)[:count], []
    allowed = sorted(allowed_cpu_ids(), reverse=True)  # from the top: CPU 0 takes most interrupts
    if pin == "auto" and busy_cpus:
        return [None] * count, []
    chosen, fds = [], []
    try:
        dir_fd = _open_lock_dir()
        try:
            for cpu in allowed:
                if len(chosen) == count:
                    break
                fd = _try_reserve(dir_fd, cpu)
                if fd is not None:
                    fds.append(fd)
                    chosen.append(cpu)
        finally:
            os.close(dir_fd)
    except BaseException as exc:
        _release(fds)
        if not isinstance(exc, OSError):
            raise
        warnings.warn(f"shmvec cannot reserve CPUs ({exc}); its workers run unpinned",
                      RuntimeWarning, stacklevel=3)
        return [None] * count, []
    if pin == "auto" and (len(chosen) < count or len(allowed) - count < leave_free):
        _release(fds)
        return [None] * count, []
    shared = [cpu for cpu in allowed if cpu not in chosen] or allowed
    while len(chosen) < count:  # pin=True with too few free CPUs: share
        chosen.append(shared[len(chosen) % len(shared)])
    return chosen, fds


class CallerCpu:
    """Keeps lock-step workers on the CPU the caller runs on, where other
    programs keep every CPU busy (plan.workers_follow_caller says when and
    why). The caller is left where the kernel puts it: before each command,
    if it runs on another CPU than last time, its workers are moved there."""

    def __init__(self, processes: list):
        self._processes = processes  # the pool's list: a restarted worker's new process shows in it
        self.cpu = -1  # where the workers were moved last; -1: not yet

    def follow(self) -> None:
        cpu = _core.current_cpu()  # no system call: one per command costs nothing
        if cpu == self.cpu or cpu < 0:
            return
        for process in self._processes:
            try:
                os.sched_setaffinity(process.pid, (cpu,))
            except OSError:  # it died: the wait for it says so
                pass
        self.cpu = cpu

    def forget(self) -> None:
        """A worker was restarted: move them all at the next command."""
        self.cpu = -1
