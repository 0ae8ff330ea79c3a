"""Torch's intra-op threads beside shmvec's workers.

Torch starts one intra-op thread per core. In a learner whose envs step in
shmvec's workers, those cores are taken: torch's OpenMP threads then wait at
barriers for threads that the scheduler has parked behind a worker, and a
small policy's forward pass slows down by up to 30x (measured with a 64-64
MLP on 2 CPUs; `OMP_WAIT_POLICY=PASSIVE` or one thread removes it). So while
a vector env is open, shmvec lowers torch's threads to the CPUs its workers
and other programs' busy threads leave free, says so once, and restores them
when the last env closes. Torch rounds some ops differently at another
count, so a seeded policy's numbers change with it (``torch_threads=None``
keeps those of torch's own count, an int the same ones in every run).

Only a torch already imported is touched: shmvec never imports it. One
imported after the env was made (a script that builds its policy between
making its envs and resetting them) is seen at the next reset.

A policy that keeps the caller away longer than the workers' spin cap
between lock-step steps (a CNN's forward pass, its update) gets its threads
back: the workers sleep through such gaps, so torch's threads no longer wait
on them, and the policy's work needs them (SB3's PPO with its CnnPolicy on 8
Pongs, 2 vCPUs: 0.67x DummyVecEnv with torch held at 1 thread, 1.07x at 2).
``GapJudge`` times the first `GapJudge.STEPS` gaps to tell.

A loop whose policy is quick between steps but that stops for a long
update after each rollout (PPO's shape) keeps torch held while it steps,
and gets the threads back for each update that `GapJudge` foresees, if
timing both ways showed the update and the rollout after it faster so.
The workers sleep through an update, and a large one needs the threads
(SB3's PPO on 8 HalfCheetahs, 256-256 MLPs, batch_size=2048, 2 vCPUs:
0.84x DummyVecEnv with torch held throughout, its update 1.6x slower;
1.09x given back for the updates). A small policy's update does not (SB3's
PPO on 8 CartPoles and CleanRL's ppo.py ran 0.83x and 0.80x as fast with
torch's threads given back for every update). Async mode does the same for
an update after a rollout's last send(), or between its last recv() and
the send() after it; other gaps keep torch held (the workers step while
the policy runs), as do foreseen ones whose trial found no gain.

Timings and other programs' load differ between runs, so a seeded policy
trained under those choices can differ from one run to the next. Where the
user has asked torch for reproducible numbers (`determinism_asked`: CleanRL's
scripts do by default), "auto" counts the workers an idle machine gets, not
the load, and makes one timed choice only: `GapJudge`'s first median, whose
loops lie far from its 2 ms bound (a small MLP's 60 us, a CNN's 5 ms; held
at one thread, CleanRL's ppo_atari.py on the CPU ran 0.70x SyncVectorEnv).
The foreseen gaps' trials, whose margin is a few percent, are left out.
"""

from __future__ import annotations

import collections
import functools
import statistics
import sys
import time

from shmvec import _core
from shmvec._engine.system import usable_cpus
from shmvec._engine.thread_pools import end_idle_openmp_helpers
from shmvec.errors import warn_performance

__all__ = ["GapJudge", "HelperTrial", "TorchThreads", "check_setting", "determinism_asked"]

_told = False  # one warning a process
_told_gaps = False  # and one when foreseen gaps get torch's threads


class _Lowered:
    """What shmvec changed in this process's torch, shared by every open env:
    the threads torch had before, the number held, the number shmvec last
    set (more than the held number during a foreseen update), and how many
    envs hold it."""

    original: int | None = None
    set_to: int | None = None
    shown: int | None = None
    holders = 0
    timed = False  # one env's engine times the gaps between steps (a GapJudge): the others do not


class _Trial:
    """Times a choice both ways: `trials` cycles (from one choice to the
    next) run the new way and as many the old, alternately. The new way
    then holds for the next `again` cycles only if its cycles' median was
    under `GAIN` times the others'; after them the trial runs again (a
    choice made in a noisy stretch does not last). `chosen` hears the two
    medians."""

    GAIN = 0.97

    __slots__ = ("_trials", "_again", "_chosen", "_cycles", "_cycle", "_choice", "_since")

    def __init__(self, trials: int, again: int, chosen=lambda new_ns, old_ns: None):
        self._trials, self._again, self._chosen = trials, again, chosen
        self._start()

    def _start(self) -> None:
        self._cycles: dict[bool, list[int]] = {True: [], False: []}  # ns, by the way each ran (new: True)
        self._cycle: tuple[int, bool] | None = None  # the one under way: its start, its way
        self._choice: bool | None = None  # None while timing
        self._since = 0  # cycles since the choice

    def new_way(self, now: int) -> bool:
        """A cycle ends and the next begins at `now`: whether it runs the new way."""
        if self._choice is not None:
            self._since += 1
            if self._since < self._again:
                return self._choice
            self._start()
        cycle, self._cycle = self._cycle, None
        if cycle is not None:
            self._cycles[cycle[1]].append(now - cycle[0])
        new, old = self._cycles[True], self._cycles[False]
        if len(new) == len(old) == self._trials:
            new_ns, old_ns = statistics.median(new), statistics.median(old)
            self._choice = new_ns < self.GAIN * old_ns
            self._chosen(new_ns, old_ns)
            return self._choice
        way = len(new) <= len(old)
        self._cycle = (now, way)
        return way

    def runs(self, new: bool) -> None:
        """The cycle begun runs the new way or not, whatever `new_way` said
        (torch set by the user since, or another series gave its threads):
        one that runs the other way is not timed."""
        if self._cycle is not None and self._cycle[1] != new:
            self._cycle = None


class _Series:
    """Long gaps foreseen every `period` steps, and the trial of torch's
    threads for them (the new way: given back)."""

    __slots__ = ("period", "missed", "trial")

    def __init__(self, period: int, trial: _Trial):
        self.period = period
        self.missed = 0  # foreseen gaps in a row that were not long
        self.trial = trial


class GapJudge:
    """Times the caller's time away from its envs between lock-step steps:
    from a step's return to the next command, the policy's time (or its
    update's). In async mode a send() and a recv() each count as a step,
    and the time away runs to the next of them (or other command): an
    update after a rollout's last send(), or between its last recv() and
    the send() after it, where the workers finish the envs in flight and
    sleep. Two uses:

    - the median of the first `STEPS` gaps between two steps goes to
      `decide`;
    - long gaps (ones the workers sleep through) of like lengths at a
      steady period of steps are foreseen: long gaps after steps n - 2p,
      n - p and n foretell one after each step n + kp, until two of them in
      a row are not long. Steps count from the env's making, where a
      rollout often starts; several such series may run at once (the
      updates, and evaluations every so many steps), and gaps a series
      foresees are not looked at again (they would show its multiples),
      nor are long gaps at every batch, the policy's own (`batch_steps`).
      Once `decide` has had its median, `TRIALS` gaps of a series get
      torch's threads back (`give`, which says whether it did; `hold` at the
      next command) and as many do not, alternately, each timed with the
      steps after it up to the series' next gap (a cycle). Torch gets them
      for the series' next `AGAIN` gaps only if that was faster (`chosen`
      hears the medians), and then the trial runs again: a small policy's
      update runs no faster with more threads, and torch's idle OpenMP
      threads then spin into the rollout.
    """

    STEPS = 32
    # A worker whose waits are longer than this on average sleeps almost at
    # once instead of spinning (csrc/signal.hpp, AdaptiveSpin::kSpinCapNs).
    LONG_NS = _core.SPIN_CAP_NS
    KEPT = 8  # the last long gaps looked at for a period
    SERIES = 4  # at most this many foreseen at once
    TRIALS = 3  # cycles timed with torch's threads back, and as many without
    AGAIN = 100  # gaps of a series after which its trial runs again (a choice made in a noisy stretch does not last)

    def __init__(self, decide, give=lambda: False, hold=lambda: None, chosen=lambda period, given, held: None,
                 batch_steps: int = 1):
        self._decide, self._give, self._hold, self._chosen = decide, give, hold, chosen
        # A long gap within a batch's steps (2 in async mode: a recv() and a
        # send()) of an alike one is the policy's own time at every batch, not
        # an update's: the workers step meanwhile in async mode, and such gaps
        # would crowd the updates out of the KEPT.
        self._batch_steps = batch_steps
        self._left_ns: int | None = None
        self._gaps: list[int] | None = []  # None once decided
        self._steps = 0  # steps returned
        # The last long gaps: (the step after which each came, its ns); the making's is like any.
        self._long_after: collections.deque[tuple[int, int | None]] = collections.deque([(0, None)], maxlen=self.KEPT)
        self._last_long: tuple[int, int] | None = None  # the last long gap not foreseen, the policy's own included
        self._due: dict[int, list[_Series]] = {}  # the step after which a series' next gap is foreseen
        self._foreseen: list[_Series] = []  # the series whose gap is under way
        self._given = False  # torch's threads, for the gap under way

    def command_begins(self, step: bool) -> None:
        """A gap between steps counts for `decide` only with no other command
        (a reset, a call) in between; for the series, any command ends it."""
        if self._given:
            self._hold()  # (first: a Ctrl-C between the two leaves a second hold to come, which does nothing)
            self._given = False
        left, self._left_ns = self._left_ns, None
        foreseen, self._foreseen = self._foreseen, []
        if left is None:
            return
        gap = time.perf_counter_ns() - left
        long = gap >= self.LONG_NS
        for series in foreseen:
            series.missed = 0 if long else series.missed + 1
            if series.missed < 2:
                self._due.setdefault(self._steps + series.period, []).append(series)
        if long and not foreseen:
            self._look_for_series(self._steps, gap)
        if step and self._gaps is not None:
            self._gaps.append(gap)
            if len(self._gaps) == self.STEPS:
                gaps, self._gaps = self._gaps, None
                self._decide(statistics.median(gaps))

    def _look_for_series(self, n: int, gap: int) -> None:
        def alike(other: int | None) -> bool:
            return other is None or (gap <= 4 * other and other <= 4 * gap)

        last, self._last_long = self._last_long, (n, gap)
        if last is not None and n - last[0] <= self._batch_steps and alike(last[1]):
            return  # the policy's own
        seen = self._long_after
        earlier = {m for m, other in seen if alike(other)}
        seen.append((n, gap))
        periods = {series.period for due in self._due.values() for series in due}
        for m in sorted(earlier, reverse=True):  # the shortest period first
            period = n - m
            if m - period in earlier and period not in periods and len(periods) < self.SERIES:
                trial = _Trial(self.TRIALS, self.AGAIN, functools.partial(self._chosen, period))
                self._due.setdefault(n + period, []).append(_Series(period, trial))
                return

    def step_returns(self) -> None:
        self._steps += 1
        due = self._due.pop(self._steps, None)
        if due is not None:
            self._foreseen = due
            if self._gaps is None:  # `decide` has had its median: a loop whose every gap is long got them for good
                now = time.perf_counter_ns()
                self._given = any([series.trial.new_way(now) for series in due]) and self._give()
                for series in due:
                    series.trial.runs(self._given)
        self._left_ns = time.perf_counter_ns()


class HelperTrial:
    """Whether ending torch's idle OpenMP helpers as each command begins
    pays, where torch runs more threads than the CPUs the workers leave at
    every gap (given back for good, or set so). It pays where the workers'
    share of a step is long (a CNN policy beside 8 Pongs on 2 vCPUs: the
    loop 1.09-1.62x SyncVectorEnv, 0.87-1.19x before), and may not where it
    is short: the next parallel op starts the helpers again (a 256-256
    MLP's update at 2 threads took 2-5% longer after each pause). So it is
    timed both ways: `TRIALS` cycles (a command and the caller's time until
    the next) with the helpers ended and as many without, alternately; the
    faster way holds for the next `AGAIN` commands, and then the trial runs
    again. Ending them changes no numbers."""

    TRIALS = 8
    AGAIN = 200

    def __init__(self):
        self._trial = _Trial(self.TRIALS, self.AGAIN)

    def end_now(self) -> bool:
        """A command begins: whether to end the helpers for it."""
        return self._trial.new_way(time.perf_counter_ns())


def determinism_asked(torch) -> bool:
    """Whether the user asked torch for reproducible numbers:
    ``torch.use_deterministic_algorithms(True)``, or cuDNN's deterministic
    flag, which CleanRL's scripts set by default (``--torch-deterministic``)
    and SB3's ``set_random_seed`` sets on CUDA."""
    try:
        return bool(torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic)
    except AttributeError:  # a torch without them
        return False


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
    with the workers. Where torch's determinism is asked for, "auto" counts
    the `idle_workers` an idle machine gets instead, and no busy CPUs."""

    def __init__(self, setting, worker_processes: int, busy_cpus: int = 0, lock_step: bool = True,
                 idle_workers: int | None = None):
        check_setting(setting)
        self._setting = setting
        self._worker_processes = worker_processes
        self._busy_cpus = busy_cpus
        self._idle_workers = worker_processes if idle_workers is None else idle_workers
        self._lock_step = lock_step
        self._holding = False
        # The CPUs the workers leave torch while this env is open, if it has
        # workers and torch_threads is not None.
        self._free: int | None = None
        self._helper_trial = HelperTrial()
        self._seen_torch = False
        self._fixed = False  # "auto" with torch's determinism asked for when it looked
        # Set while "auto" holds torch below its own count because of the
        # workers: the engine times the gaps between steps (recv() and send() in async mode).
        self.judge: GapJudge | None = None
        self.look()

    def look(self) -> None:
        """Lowers torch's threads (or warns), once: at the first call that
        finds torch imported."""
        torch = sys.modules.get("torch")
        if torch is None or self._seen_torch:
            return
        self._seen_torch = True
        setting, worker_processes, busy_cpus = self._setting, self._worker_processes, self._busy_cpus
        # Reproducible numbers asked for: not the load now, which the default
        # worker count follows too (and later no trial for updates).
        fixed = self._fixed = setting == "auto" and determinism_asked(torch)
        if fixed:
            worker_processes, busy_cpus = self._idle_workers, 0
        threads, cpus = torch.get_num_threads(), usable_cpus()
        free = max(1, cpus - worker_processes - busy_cpus)
        parts = []  # who leaves torch `free` CPUs
        if worker_processes:
            parts.append(f"shmvec's {worker_processes} worker processes"
                         + (" (as many as an idle machine gets)" if fixed and self._busy_cpus else ""))
        if busy_cpus:
            parts.append(f"other programs' threads (keeping {busy_cpus} CPUs busy)")
        takers = " and ".join(parts)
        if setting is None:
            if threads > free:
                _warn_once(f"torch runs {threads} intra-op threads in this process, and {takers} leave "
                           f"it {free} of the {cpus} CPUs: they compete for the cores. Call "
                           f"torch.set_num_threads({free}) while stepping, "
                           'or leave torch_threads="auto" (the default) to let shmvec do it.')
            return
        if worker_processes:
            self._free = free
        target = free if setting == "auto" else setting
        if _Lowered.holders == 0:
            # "auto" only lowers: fewer threads than the free CPUs are the user's choice.
            if threads == target or (setting == "auto" and threads < target):
                return
            _Lowered.original = threads
            _Lowered.set_to = _Lowered.shown = target
            torch.set_num_threads(target)
            held = (" Torch's deterministic mode is on, so this count does not depend on other programs' load, "
                    "and no timed trial changes it for updates (a policy more than 2 ms between steps gets "
                    "torch's threads back after 32 steps)." if fixed else "")
            _warn_once(f"shmvec set torch.set_num_threads({target}) (it was {threads}) while this vector env "
                       f"is open: {takers} leave it {free} of the {cpus} CPUs, and torch's threads "
                       "would wait on cores they hold. close() restores it; pass "
                       "torch_threads=None to keep torch's setting (torch rounds some ops differently at "
                       "another count: a seeded policy's numbers are then those it gets beside SyncVectorEnv)."
                       + held)
        _Lowered.holders += 1
        self._holding = True
        if (setting == "auto" and worker_processes and not _Lowered.timed
                and _Lowered.set_to is not None and _Lowered.set_to < _Lowered.original):
            _Lowered.timed = True
            # Async mode's workers step while the caller is away: no threads
            # for good for long gaps, only for foreseen ones that a trial found faster so.
            decide = self._judged if self._lock_step else (lambda gap_ns: None)
            self.judge = GapJudge(decide, self._give_for_gap, self._hold_after_gap, self._chose,
                                  batch_steps=1 if self._lock_step else 2)

    def end_idle_helpers(self) -> None:
        """As a command begins, before the workers get it: where torch runs
        more threads than the CPUs the workers leave, ends the OpenMP helpers
        that the policy's last op left spinning, which would otherwise take
        the workers' CPUs through the step. After a foreseen gap (an update)
        always: once a rollout, and the helpers would spin into its first
        steps. Where torch runs more threads at every gap, as `HelperTrial`
        finds faster. A CNN policy (CleanRL's Atari agent) at torch's 2
        threads beside 8 Pongs on 2 vCPUs: the step took 5.6-9.6 ms with
        them, 3.4-5.7 ms without (docs/performance.md)."""
        if self._free is None or sys.modules["torch"].get_num_threads() <= self._free:
            return
        if (_Lowered.shown or 0) > (_Lowered.set_to or 0) or self._helper_trial.end_now():
            end_idle_openmp_helpers()

    def _unheld(self) -> int:
        """Torch's own count, up to the CPUs other programs leave (all, where
        reproducible numbers were asked for: not the load)."""
        return min(_Lowered.original, max(1, usable_cpus() - (0 if self._fixed else self._busy_cpus)))

    def _held_by_us(self, torch) -> bool:
        """Whether torch runs the count shmvec set (not one the user set since)."""
        return torch is not None and torch.get_num_threads() == _Lowered.shown

    def _judged(self, gap_ns: float) -> None:
        """Gives torch its threads back for good (up to the CPUs other
        programs leave) if the policy's time between steps is long: see the
        module's docstring."""
        torch = sys.modules.get("torch")
        if gap_ns < GapJudge.LONG_NS or not self._held_by_us(torch):
            return  # short gaps (foreseen long ones may still come), or the user has set torch's threads since
        self.judge = None
        target = self._unheld()
        if target <= _Lowered.set_to:
            return
        torch.set_num_threads(target)
        warn_performance(f"shmvec gave torch {target} intra-op threads back (it had set {_Lowered.set_to}): "
                         f"this loop spends {gap_ns / 1e6:.1f} ms between steps (median of {GapJudge.STEPS}), "
                         "long enough that shmvec's workers sleep meanwhile instead of holding the cores.")
        _Lowered.set_to = _Lowered.shown = target

    def _give_for_gap(self) -> bool:
        """Gives torch its threads back for a long gap foreseen (an update
        after a rollout); returns whether it did."""
        torch = sys.modules.get("torch")
        target = self._unheld()
        # Reproducible numbers asked for (maybe since the env was made): no trial.
        if target <= _Lowered.set_to or not self._held_by_us(torch) or determinism_asked(torch):
            return False
        torch.set_num_threads(target)
        _Lowered.shown = target
        return True

    def _hold_after_gap(self) -> None:
        torch = sys.modules.get("torch")
        if self._held_by_us(torch):
            torch.set_num_threads(_Lowered.set_to)
        _Lowered.shown = _Lowered.set_to  # a count the user set meanwhile is theirs: left as it is

    def _chose(self, period: int, given_ns: float, held_ns: float) -> None:
        global _told_gaps
        if given_ns < _Trial.GAIN * held_ns and not _told_gaps:
            _told_gaps = True
            steps, next_step = (("steps", "the next step") if self._lock_step
                                else ("recv() and send() calls", "the next of them"))
            warn_performance(f"shmvec gives torch its {self._unheld()} intra-op threads back for the long gap "
                             f"this loop makes every {period} {steps} (its update, say), while shmvec's workers "
                             f"sleep, and holds it at {_Lowered.set_to} again at {next_step}: timed both ways, "
                             f"such a gap and the steps after it took {given_ns / 1e6:.1f} ms with them and "
                             f"{held_ns / 1e6:.1f} ms without (medians of {GapJudge.TRIALS}).")

    def release(self) -> None:
        """Gives torch its threads back when the last env holding them goes,
        unless the user has set them since."""
        self._free = None
        if not self._holding:
            return
        self._holding = False
        if self.judge is not None or _Lowered.holders == 1:
            _Lowered.timed = False
        self.judge = None
        _Lowered.holders -= 1
        if _Lowered.holders:
            return
        torch = sys.modules.get("torch")
        if self._held_by_us(torch):
            torch.set_num_threads(_Lowered.original)
        _Lowered.original = _Lowered.set_to = _Lowered.shown = None
