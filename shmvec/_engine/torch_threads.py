"""Torch's intra-op threads beside shmvec's workers.

Torch starts one intra-op thread per core. In a learner whose envs step in
shmvec's workers, those cores are taken: torch's OpenMP threads then wait at
barriers for threads that the scheduler has parked behind a worker, and a
small policy's forward pass slows down by up to 30x (measured with a 64-64
MLP on 2 CPUs; `OMP_WAIT_POLICY=PASSIVE` or one thread removes it). So while
a vector env is open, shmvec lowers torch's threads to the CPUs its workers
and other programs' busy threads leave free, says so once, and restores them
when the last env closes.

Only a torch already imported is touched: shmvec never imports it. One
imported after the env was made (a script that builds its policy between
making its envs and resetting them) is seen at the next reset.

A policy that keeps the caller away longer than the workers' spin cap
between lock-step steps (a CNN's forward pass, its update) gets its threads
back: the workers sleep through such gaps, so torch's threads no longer wait
on them, and the policy's work needs them (SB3's PPO with its CnnPolicy on 8
Pongs, 2 vCPUs: 0.67x DummyVecEnv with torch held at 1 thread, 1.07x at 2).
``GapJudge`` times the first `GapJudge.STEPS` gaps to tell.
"""

from __future__ import annotations

import statistics
import sys
import time

from shmvec import _core
from shmvec._engine.system import usable_cpus
from shmvec.errors import warn_performance

__all__ = ["GapJudge", "TorchThreads", "check_setting"]

_told = False  # one warning a process


class _Lowered:
    """What shmvec changed in this process's torch, shared by every open env:
    the threads torch had before, the number set, and how many envs hold it."""

    original: int | None = None
    set_to: int | None = None
    holders = 0
    judged = False  # a GapJudge decided: the others stop timing


class GapJudge:
    """Times the caller's time away from its envs between lock-step steps
    (from one step's return to the next one's start: the policy's time),
    and after `STEPS` of them hands their median to `decide`."""

    STEPS = 32
    # A worker whose waits are longer than this on average sleeps almost at
    # once instead of spinning (csrc/signal.hpp, AdaptiveSpin::kSpinCapNs).
    LONG_NS = _core.SPIN_CAP_NS

    def __init__(self, decide):
        self._decide = decide
        self._left_ns: int | None = None
        self._gaps: list[int] = []

    def command_begins(self, step: bool) -> None:
        """A gap counts from a step's return to the next step, with no other
        command (a reset, a call) in between."""
        left, self._left_ns = self._left_ns, None
        if left is None or not step:
            return
        self._gaps.append(time.perf_counter_ns() - left)
        if len(self._gaps) == self.STEPS:
            self._decide(statistics.median(self._gaps))

    def step_returns(self) -> None:
        self._left_ns = time.perf_counter_ns()


def check_setting(torch_threads) -> None:
    if torch_threads in ("auto", None):
        return
    if isinstance(torch_threads, bool) or not isinstance(torch_threads, int) or torch_threads < 1:
        raise ValueError(f'torch_threads must be "auto", None or an int >= 1, got {torch_threads!r}')


def _warn_once(message: str) -> None:
    global _told
    if not _told:
        _told = True
        warn_performance(message)


class TorchThreads:
    """Holds torch's intra-op threads at a number while one env is open.

    ``"auto"``: the CPUs left beside `worker_processes` and the `busy_cpus`
    that other programs keep busy (at least one), if torch runs more (beside
    two CPU hogs on 2 CPUs, SyncVectorEnv over 64 CartPoles with a 64-64 MLP
    at torch's 2 threads ran 1.6k steps/s in most passes). An int: exactly
    that many. None: leave torch alone, but warn once if its threads compete
    with the workers."""

    def __init__(self, setting, worker_processes: int, busy_cpus: int = 0, lock_step: bool = True):
        check_setting(setting)
        self._setting = setting
        self._worker_processes = worker_processes
        self._busy_cpus = busy_cpus
        self._lock_step = lock_step
        self._holding = False
        self._seen_torch = False
        # Set while "auto" holds torch below its own count because of the
        # workers, in lock-step: the engine times the gaps between steps.
        self.judge: GapJudge | None = None
        self.look()

    def look(self) -> None:
        """Lowers torch's threads (or warns), once: at the first call that
        finds torch imported."""
        torch = sys.modules.get("torch")
        if torch is None or self._seen_torch:
            return
        self._seen_torch = True
        setting, worker_processes = self._setting, self._worker_processes
        threads, cpus = torch.get_num_threads(), usable_cpus()
        free = max(1, cpus - worker_processes - self._busy_cpus)
        parts = []  # who leaves torch `free` CPUs
        if worker_processes:
            parts.append(f"shmvec's {worker_processes} worker processes")
        if self._busy_cpus:
            parts.append(f"other programs' threads (keeping {self._busy_cpus} CPUs busy)")
        takers = " and ".join(parts)
        if setting is None:
            if threads > free:
                _warn_once(f"torch runs {threads} intra-op threads in this process, and {takers} leave "
                           f"it {free} of the {cpus} CPUs: they compete for the cores. Call "
                           f"torch.set_num_threads({free}) while stepping, "
                           'or leave torch_threads="auto" (the default) to let shmvec do it.')
            return
        target = free if setting == "auto" else setting
        if _Lowered.holders == 0:
            # "auto" only lowers: fewer threads than the free CPUs are the user's choice.
            if threads == target or (setting == "auto" and threads < target):
                return
            _Lowered.original = threads
            _Lowered.set_to = target
            torch.set_num_threads(target)
            _warn_once(f"shmvec set torch.set_num_threads({target}) (it was {threads}) while this vector env "
                       f"is open: {takers} leave it {free} of the {cpus} CPUs, and torch's threads "
                       "would wait on cores they hold. close() restores it; pass "
                       "torch_threads=None to keep torch's setting.")
        _Lowered.holders += 1
        self._holding = True
        if (setting == "auto" and self._lock_step and worker_processes and not _Lowered.judged
                and _Lowered.set_to is not None and _Lowered.set_to < _Lowered.original):
            self.judge = GapJudge(self._judged)

    def _judged(self, gap_ns: float) -> None:
        """Gives torch its threads back (up to the CPUs other programs
        leave) if the policy's time between steps is long: see the module's
        docstring. Once a process, by the first env to decide."""
        self.judge = None
        if _Lowered.judged or not self._holding:
            return
        _Lowered.judged = True
        torch = sys.modules.get("torch")
        if gap_ns < GapJudge.LONG_NS or torch is None or torch.get_num_threads() != _Lowered.set_to:
            return  # short gaps, or the user has set torch's threads since: theirs
        target = min(_Lowered.original, max(1, usable_cpus() - self._busy_cpus))
        if target <= _Lowered.set_to:
            return
        torch.set_num_threads(target)
        warn_performance(f"shmvec gave torch {target} intra-op threads back (it had set {_Lowered.set_to}): "
                         f"this loop spends {gap_ns / 1e6:.1f} ms between steps (median of {GapJudge.STEPS}), "
                         "long enough that shmvec's workers sleep meanwhile instead of holding the cores.")
        _Lowered.set_to = target

    def release(self) -> None:
        """Gives torch its threads back when the last env holding them goes,
        unless the user has set them since."""
        if not self._holding:
            return
        self._holding = False
        self.judge = None
        _Lowered.holders -= 1
        if _Lowered.holders:
            return
        torch = sys.modules.get("torch")
        if torch is not None and torch.get_num_threads() == _Lowered.set_to:
            torch.set_num_threads(_Lowered.original)
        _Lowered.original = _Lowered.set_to = None
        _Lowered.judged = False
