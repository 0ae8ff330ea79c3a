"""Which CPUs pinned workers take. A reservation is an exclusive flock on a
per-CPU lock file, held by the front end for the engine's life: vector envs
of this program *and of other programs* then avoid each other's CPUs, and a
crash cannot leave a reservation behind (the kernel drops the lock).

The lock files live in a directory private to this user:
``$XDG_RUNTIME_DIR/shmvec-cpus`` when that is usable, else
``$TMPDIR/shmvec-cpus-$UID``; either must be a real directory (not a
symlink), owned by us, mode 0700. If anything is wrong with it, workers run
unpinned (one RuntimeWarning): the lock directory never fails a vector env.

And where lock-step workers run while other programs keep every CPU busy:
on the caller's CPU, for as long as that lasts (WorkerPlacement)."""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
import time
import warnings
from collections.abc import Sequence

from shmvec import _core
from shmvec._engine.system import PARENT_ONLY_FDS, Load, LoadMeter, allowed_cpu_ids

__all__ = ["choose_cpus", "follow_caller", "WorkerPlacement"]

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


def follow_caller(load: Load, following: bool) -> bool:
    """Whether lock-step workers should run on the caller's CPU, by the load
    of the last window (see WorkerPlacement). They start following where
    other programs' CPU time, with the time shmvec's processes waited to
    run, comes to three quarters of every CPU: as at construction
    (system.cpus_busy_elsewhere), but counting the waits, since while
    shmvec steps it holds much of the CPUs the others would take. They stop
    when half a CPU is left idle: spread again, each has a CPU of its own."""
    if following:
        return load.cpus - load.busy < 0.5
    return (load.busy - load.ours) + load.waits >= 0.75 * load.cpus


class WorkerPlacement:
    """Keeps lock-step workers on the CPU the caller runs on while other
    programs keep every CPU busy (plan.workers_follow_caller says where and
    why), and watches for that to start or stop while stepping.

    Following, the caller is left where the kernel puts it: before each
    command, if it runs on another CPU than last time, its workers are moved
    there. Every `WINDOW_S` of stepping it reads the CPUs' load
    (system.LoadMeter) and decides again (follow_caller); workers that stop
    following go back to the CPUs they were started with (`pool.cpus`, their
    reservations held meanwhile) or to every CPU this process may use."""

    WINDOW_S = 0.2

    def __init__(self, pool, following: bool):
        self._pool = pool  # its processes list shows a restarted worker's new process
        self.following = following
        self.cpu = -1  # where the workers were moved last; -1: not yet
        self._meter = LoadMeter(lambda: [p.pid for p in pool.processes])
        self._everywhere = allowed_cpu_ids()  # (tests move the caller)
        self._due = time.monotonic() + self.WINDOW_S

    def before_command(self) -> None:
        if self.following:
            self._follow()
        if time.monotonic() >= self._due:  # one clock read a command: the window's reading is rare
            # Ctrl-C held: one inside would leave a /proc file open, to the garbage.
            _core.run_holding_interrupt(self._look)

    def forget(self) -> None:
        """A worker was restarted: move them all at the next command."""
        self.cpu = -1

    def _look(self) -> None:
        load = self._meter.read()
        self._due = time.monotonic() + self.WINDOW_S
        if load is None or follow_caller(load, self.following) == self.following:
            return
        self.following = not self.following
        if self.following:
            self._follow()
        else:
            self._spread()

    def _follow(self) -> None:
        cpu = _core.current_cpu()  # no system call: one per command costs nothing
        if cpu == self.cpu or cpu < 0:
            return
        self._move([(cpu,)] * len(self._pool.processes))
        self.cpu = cpu

    def _spread(self) -> None:
        self._move([self._everywhere if cpu is None else (cpu,) for cpu in self._pool.cpus])
        self.cpu = -1

    def _move(self, cpus: list) -> None:
        for process, where in zip(self._pool.processes, cpus):
            try:
                os.sched_setaffinity(process.pid, where)
            except OSError:  # it died: the wait for it says so
                pass
