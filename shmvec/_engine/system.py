"""What the operating system tells us about CPUs, and pinning. Linux-only
calls of the Python side live here, so another platform needs one new file."""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Collection
from typing import NamedTuple

__all__ = ["IS_LINUX", "usable_cpus", "allowed_cpu_ids", "pin_to_cpu", "runnable_threads", "cpus_busy_elsewhere",
           "busy_threads_share_our_group", "Load", "LoadMeter", "PARENT_ONLY_FDS", "close_arena_fds"]

# Fds that only the front end may hold (parent-pipe write ends, CPU
# reservations) of every live engine in this process. All are close-on-exec
# (os.pipe, O_CLOEXEC). A child made by fork inherits them all, whoever forks
# (our fork-started workers, a torch DataLoader worker, os.fork): it would
# keep a dead front end "alive" for its workers, or CPUs reserved after their
# engine closed. So every fork child closes them at once (below).
PARENT_ONLY_FDS: set[int] = set()

# The name of an arena's memfd (csrc/platform_linux.cpp).
ARENA_NAME = "shmvec-arena"


def _close_parent_only_fds() -> None:
    for fd in PARENT_ONLY_FDS:
        try:
            os.close(fd)
        except OSError:
            pass
    PARENT_ONLY_FDS.clear()


if hasattr(os, "register_at_fork"):  # once, at import
    os.register_at_fork(after_in_child=_close_parent_only_fds)


def close_arena_fds(keep: int) -> None:
    """Closes every arena memfd of this process but `keep` (a fork child
    inherits those of every engine of its parent)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd != keep and os.readlink(f"/proc/self/fd/{name}").startswith(f"/memfd:{ARENA_NAME}"):
                os.close(fd)
        except OSError:  # the fd of the listing itself, gone by now
            pass

IS_LINUX = sys.platform.startswith("linux")


def allowed_cpu_ids() -> list[int]:
    """CPU ids this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _cgroup_cpu_limit() -> float | None:
    """The CPU quota of this process's cgroup in CPUs, if it has one."""
    try:  # cgroup v2: "max 100000" or "200000 100000"
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
        if quota_us > 0 and period_us > 0:
            return quota_us / period_us
    except (OSError, ValueError):
        pass
    return None


def usable_cpus() -> int:
    """CPUs this process can really use: its affinity mask, capped by any
    cgroup CPU quota (a 2-CPU container on a 96-core host gives 2)."""
    n = len(allowed_cpu_ids())
    limit = _cgroup_cpu_limit()
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return max(1, n)


def runnable_threads() -> int | None:
    """Threads of the whole machine that are running or ready to run now
    (``procs_running`` in /proc/stat, this one included); None if unknown."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _cpu_times(cpus: set[int]) -> dict[int, tuple[int, int]]:
    """(idle, total) clock ticks of each CPU in `cpus` so far, from /proc/stat."""
    times = {}
    with open("/proc/stat", "rb") as f:
        for line in f:
            if not line.startswith(b"cpu") or line[3:4] == b" ":
                continue
            name, *fields = line.split()
            cpu = int(name[3:])
            if cpu in cpus:
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                times[cpu] = (ticks[3] + ticks[4], sum(ticks))
    return times


def cpus_busy_elsewhere(window_s: float = 0.04, windows: int = 2, own_pids: Collection[int] = ()) -> int:
    """How many of this process's CPUs other programs keep busy now.

    Stepping processes beyond the idle CPUs only slow each other down: they
    wait for each other at every step, and each wait for one that another
    program holds off its CPU costs a whole scheduler slice. First a free
    look: if no other thread is running or ready (``procs_running``, three
    samples), none. Otherwise each CPU's idle time over `windows` windows of
    `window_s`, this thread asleep meanwhile: CPUs busy for three quarters
    of every window count (a process that is starting or exiting is not a
    steady load). The CPU time of `own_pids` (shmvec's workers) in each
    window is taken off the CPU each thread ran on last: they are not
    another program (a worker that has just started spins an OpenBLAS
    thread for about 100 ms; an env made right after another would
    otherwise count that CPU busy). Nor are this process's other threads:
    torch's OpenMP threads spin for up to 200 ms after each parallel op
    (Stable-Baselines3's import runs one), and torch_threads holds them.
    Under a CPU quota smaller than the affinity mask (a container's share
    of a larger host) the other CPUs' load says nothing about ours: 0, as
    when /proc is unreadable."""
    cpus = set(allowed_cpu_ids())
    if not IS_LINUX or usable_cpus() < len(cpus):
        return 0
    try:
        for _ in range(3):
            running = runnable_threads()
            if running is None or running <= 1:
                return 0
            time.sleep(0.001)
        busy = set(cpus)
        own_pids = {os.getpid(), *own_pids}
        # Not this thread: it runs for microseconds a window, but a clock tick
        # (10 ms) charged to it would take a quarter off a busy CPU's window.
        me = threading.get_native_id()

        def own_ticks():
            ticks = _thread_ticks(own_pids)
            ticks.pop(me, None)
            return ticks

        before, own_before = _cpu_times(cpus), own_ticks()
        for _ in range(windows):
            time.sleep(window_s)
            after, own_after = _cpu_times(cpus), own_ticks()
            own = _ticks_by_cpu(own_before, own_after)
            busy = {cpu for cpu in busy if cpu in before and cpu in after
                    and _busy_share(before[cpu], after[cpu], own.get(cpu, 0)) > 0.75}
            before, own_before = after, own_after
    except (OSError, ValueError):
        return 0
    return len(busy)


def busy_threads_share_our_group(own_pids: Collection[int] = (), samples: int = 3, gap_s: float = 0.005) -> bool:
    """Whether most of the other programs' threads that are running now
    share this process's CPU scheduling group, so that each more process of
    ours gets a share of the CPUs of its own beside them: the same cgroup
    and, where the kernel groups processes by session
    (/proc/sys/kernel/sched_autogroup_enabled), the same session. A job
    started from another terminal is in a session of its own: there all of
    shmvec's processes together get one session's share, and a worker more
    only adds handoffs (CartPole x64 beside two CPU hogs in sessions of their
    own on 2 CPUs: 0.69x SyncVectorEnv with one worker, 1.17x with none).
    False when nothing is found or /proc is unreadable. Reads the state of
    every thread in /proc `samples` times, `gap_s` apart."""
    mine = {os.getpid(), *own_pids}
    try:
        with open("/proc/self/cgroup", "rb") as f:
            my_cgroup = f.read()
        try:
            with open("/proc/sys/kernel/sched_autogroup_enabled", "rb") as f:
                by_session = f.read().strip() == b"1"
        except OSError:
            by_session = False
        my_session = os.getsid(0)
        ours = theirs = 0
        for k in range(samples):
            if k:
                time.sleep(gap_s)
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) in mine:
                    continue
                try:
                    running = sum(_thread_running(entry, tid) for tid in os.listdir(f"/proc/{entry}/task"))
                    if not running:
                        continue
                    with open(f"/proc/{entry}/cgroup", "rb") as f:
                        same = f.read() == my_cgroup and (not by_session or os.getsid(int(entry)) == my_session)
                except OSError:  # it ended meanwhile
                    continue
                ours, theirs = (ours + running, theirs) if same else (ours, theirs + running)
    except OSError:
        return False
    return ours > theirs


def _thread_running(pid: str, tid: str) -> bool:
    try:
        return _stat_fields(f"/proc/{pid}/task/{tid}/stat")[0] == b"R"
    except OSError:
        return False


def _stat_fields(path: str) -> list[bytes]:
    """The fields of a /proc stat file after the name, from the state on
    (the name may hold spaces and ")")."""
    with open(path, "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def _busy_share(before: tuple[int, int], after: tuple[int, int], own_ticks: int = 0) -> float:
    idle, total = after[0] - before[0], after[1] - before[1]
    return 1.0 - (idle + own_ticks) / total if total > 0 else 0.0


def _thread_ticks(pids: Collection[int]) -> dict[int, tuple[int, int]]:
    """Clock ticks of CPU time (user + system) so far and the CPU it last
    ran on, of each thread of `pids`, by thread id; processes gone are left out."""
    ticks = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            except OSError:
                continue
            ticks[int(tid)] = (int(fields[11]) + int(fields[12]), int(fields[36]))  # utime, stime; processor
    return ticks


def _ticks_by_cpu(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]) -> dict[int, int]:
    """The ticks each thread ran between two _thread_ticks(), summed by the
    CPU it ran on last (a thread only in `after` began in between)."""
    by_cpu: dict[int, int] = {}
    for tid, (ticks, cpu) in after.items():
        by_cpu[cpu] = by_cpu.get(cpu, 0) + ticks - before.get(tid, (0, cpu))[0]
    return by_cpu


class Load(NamedTuple):
    """The CPUs' load over a window, in CPUs (1.0: one CPU's whole time)."""
    cpus: int  # this process may use
    busy: float  # of those CPUs, all programs together
    ours: float  # of that, this process and its workers
    waits: float  # time the caller's thread and the workers' waited, ready to run, for a CPU


class LoadMeter:
    """Reads the CPUs' load while shmvec steps, each read() over the window
    since the one before: for cpus.WorkerPlacement, which moves lock-step
    workers to the caller's CPU when other programs come to keep every CPU
    busy, and back when one is left idle. A read takes a few /proc files
    (about 50 µs with one worker). `pids` gives the workers' pids now (a
    restarted worker has a new one)."""

    def __init__(self, pids: Callable[[], list[int]]):
        self._pids = pids
        self._cpus = set(allowed_cpu_ids())
        self._last = self._sample()

    def read(self) -> Load | None:
        """The load since the last read; None if /proc said nothing usable."""
        now = self._sample()
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        wall_ns = now[0] - last[0]
        spans = [(now[1][c][0] - last[1][c][0], now[1][c][1] - last[1][c][1]) for c in now[1] if c in last[1]]
        if wall_ns <= 0 or not spans or any(total <= 0 for _, total in spans):
            return None
        busy = sum(1.0 - idle / total for idle, total in spans)
        ticks_per_cpu = sum(total for _, total in spans) / len(spans)
        ours = sum(now[2][pid][0] - last[2][pid][0] for pid in now[2] if pid in last[2]) / ticks_per_cpu
        waits = sum(now[2][pid][1] - last[2][pid][1] for pid in now[2] if pid in last[2]) / wall_ns
        return Load(len(spans), busy, ours, waits)

    def _sample(self):
        """(time in ns, each CPU's (idle, total) ticks, and each of our
        processes' (CPU ticks of all its threads, ns its stepping thread
        waited to run)); None if /proc is unreadable."""
        try:
            own = {0: _own_times("self", "thread-self")}
            for pid in self._pids():
                try:
                    own[pid] = _own_times(str(pid), str(pid))
                except OSError:  # it died: the wait for it says so
                    pass
            return time.monotonic_ns(), _cpu_times(self._cpus), own
        except (OSError, ValueError, IndexError):
            return None


def _own_times(process: str, thread: str) -> tuple[int, int]:
    """(CPU ticks of `process`, all threads, user + system; ns `thread` has
    waited, ready to run, for a CPU)."""
    fields = _stat_fields(f"/proc/{process}/stat")
    with open(f"/proc/{thread}/schedstat", "rb") as f:
        waited = int(f.read().split()[1])
    return int(fields[11]) + int(fields[12]), waited


def pin_to_cpu(cpu: int) -> None:
    """Pins the calling process to one CPU."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
