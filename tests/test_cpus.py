"""CPU reservations (shmvec/_engine/cpus.py): lock files in a directory private to
this user. Whatever is planted at its path, or wherever opening a lock
fails, vector envs still start (unpinned, with one RuntimeWarning) and no
lock stays taken. And where workers run when other programs keep every CPU
busy: on the caller's CPU, in lock-step."""

from __future__ import annotations

import os
import signal
import stat
import tempfile
import time
import warnings

import numpy as np
import pytest
from fault_envs import FaultEnv, lock_is_free, open_fds, then_ctrl_c

import shmvec
from shmvec._engine import cpus

CPUS = [0, 1, 2, 3]  # what choose_cpus believes it may use, whatever this machine has


@pytest.fixture
def tmpdir_only(tmp_path, monkeypatch):
    """TMPDIR (and tempfile's cached copy) point into tmp_path; no XDG_RUNTIME_DIR;
    a machine of CPUS (choose_cpus is told how many are busy: none by default)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(cpus, "allowed_cpu_ids", lambda: list(CPUS))
    return tmp


def release(fds: list[int]) -> None:
    """Gives reservations back as the engine does (os.close alone would leave
    their numbers in PARENT_ONLY_FDS, and every later fork child would close
    whatever fd has that number by then)."""
    cpus._release(fds)


def lock_dir(tmp) -> str:
    return os.path.join(str(tmp), f"shmvec-cpus-{os.getuid()}")


def choose_expecting_one_warning(count=2, pin=True):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen, fds = cpus.choose_cpus(count, pin, leave_free=0)
    assert [w.category for w in caught] == [RuntimeWarning], [str(w.message) for w in caught]
    assert "unpinned" in str(caught[0].message)
    assert chosen == [None] * count and fds == []


def test_reserves_in_a_private_per_user_directory(tmpdir_only):
    chosen, fds = cpus.choose_cpus(2, True, leave_free=0)
    try:
        assert chosen == [3, 2] and len(fds) == 2
        st = os.lstat(lock_dir(tmpdir_only))
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.geteuid()
        assert not lock_is_free(os.path.join(lock_dir(tmpdir_only), "cpu3.lock"))
        for fd in fds:
            assert not os.get_inheritable(fd)
    finally:
        release(fds)
    assert lock_is_free(os.path.join(lock_dir(tmpdir_only), "cpu3.lock"))


def test_ctrl_c_as_a_cpu_is_reserved_keeps_no_reservation(tmpdir_only, monkeypatch):
    """A Ctrl-C right after a lock is taken, before its fd is kept where
    close() finds it, would keep that CPU reserved for the life of the
    process (and its fd open)."""
    before = open_fds()
    monkeypatch.setattr(cpus, "_try_reserve", then_ctrl_c(cpus._try_reserve))
    with pytest.raises(KeyboardInterrupt):
        shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1, caller_steps=False, pin_workers=True, start_method="fork")
    monkeypatch.undo()
    assert lock_is_free(os.path.join(lock_dir(tmpdir_only), "cpu3.lock"))
    assert open_fds() == before


def test_uses_xdg_runtime_dir_when_usable(tmpdir_only, tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    chosen, fds = cpus.choose_cpus(1, True, leave_free=0)
    release(fds)
    assert chosen == [3]
    assert os.listdir(run / "shmvec-cpus") == ["cpu3.lock"]
    assert os.listdir(tmpdir_only) == []


@pytest.mark.parametrize("problem", ["missing", "not absolute", "loose mode"])
def test_unusable_xdg_runtime_dir_falls_back_to_tmpdir(problem, tmpdir_only, tmp_path, monkeypatch):
    run = tmp_path / "run"
    if problem == "loose mode":
        run.mkdir(mode=0o755)
        run.chmod(0o755)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "run" if problem == "not absolute" else str(run))
    chosen, fds = cpus.choose_cpus(1, True, leave_free=0)  # no warning: the fallback is fine
    release(fds)
    assert chosen == [3]
    assert os.listdir(lock_dir(tmpdir_only)) == ["cpu3.lock"]


def test_planted_file_falls_back_to_unpinned(tmpdir_only):
    with open(lock_dir(tmpdir_only), "w") as f:
        f.write("not a directory")
    choose_expecting_one_warning()


def test_planted_symlink_is_not_followed(tmpdir_only, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, lock_dir(tmpdir_only))
    choose_expecting_one_warning()
    assert os.listdir(elsewhere) == []


def test_directory_with_loose_mode_is_refused(tmpdir_only):
    os.mkdir(lock_dir(tmpdir_only))
    os.chmod(lock_dir(tmpdir_only), 0o777)
    choose_expecting_one_warning()
    assert os.listdir(lock_dir(tmpdir_only)) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can make a directory owned by someone else")
def test_directory_of_another_user_is_refused(tmpdir_only):
    os.mkdir(lock_dir(tmpdir_only), 0o700)
    os.chown(lock_dir(tmpdir_only), 65534, 65534)
    choose_expecting_one_warning()
    assert os.listdir(lock_dir(tmpdir_only)) == []


@pytest.mark.parametrize("planted", ["symlink", "directory"])
def test_lock_that_cannot_be_opened_releases_those_taken(planted, tmpdir_only, tmp_path):
    """CPU 3's lock is taken first, CPU 2's cannot be opened: nothing stays
    locked, no fd leaks, and a planted symlink is not followed."""
    d = lock_dir(tmpdir_only)
    os.mkdir(d, 0o700)
    target = tmp_path / "target"
    if planted == "symlink":
        os.symlink(target, os.path.join(d, "cpu2.lock"))
    else:
        os.mkdir(os.path.join(d, "cpu2.lock"))
    fds_before = set(os.listdir("/proc/self/fd"))
    choose_expecting_one_warning(count=3)
    assert set(os.listdir("/proc/self/fd")) <= fds_before
    assert lock_is_free(os.path.join(d, "cpu3.lock"))
    assert not target.exists()


def test_a_cpu_held_elsewhere_is_skipped(tmpdir_only):
    chosen, held = cpus.choose_cpus(1, True, leave_free=0)
    try:
        chosen2, fds = cpus.choose_cpus(1, "auto", leave_free=0)
        release(fds)
        assert chosen == [3] and chosen2 == [2]
    finally:
        release(held)


def test_default_env_starts_unpinned_despite_a_planted_file(tmpdir_only, idle_cpus, closing):
    """The reported failure: a file at the lock directory's path made every
    default ShmVecEnv raise FileExistsError."""
    with open(lock_dir(tmpdir_only), "w") as f:
        f.write("x")
    with pytest.warns(RuntimeWarning, match="unpinned"):
        envs = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1, caller_steps=False, start_method="fork")
    closing(envs)
    envs.reset()
    obs, rewards, *_ = envs.step(np.zeros(2, dtype=np.int64))
    assert np.array_equal(rewards, np.ones(2))
    pid = envs._engine.pool.processes[0].pid
    assert os.sched_getaffinity(pid) == os.sched_getaffinity(0)


def test_auto_does_not_pin_on_a_busy_machine(monkeypatch, tmp_path):
    """A pinned worker cannot leave a core another program takes: with a CPU
    kept busy by another program, "auto" leaves scheduling to the kernel."""
    from shmvec._engine import cpus

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(cpus, "allowed_cpu_ids", lambda: [0, 1])
    assert cpus.choose_cpus(1, "auto", leave_free=1, busy_cpus=1) == ([None], [])
    chosen, fds = cpus.choose_cpus(1, "auto", leave_free=1, busy_cpus=0)
    try:
        assert chosen == [1]
    finally:
        release(fds)


def test_cpus_kept_busy_by_other_programs_are_counted():
    """Default worker counts leave out CPUs that other programs keep busy:
    with a spinning process pinned to each of our CPUs, all of them count."""
    import multiprocessing as mp

    from shmvec._engine.system import cpus_busy_elsewhere, usable_cpus

    allowed = sorted(os.sched_getaffinity(0))
    if usable_cpus() < len(allowed):
        pytest.skip("a CPU quota below the affinity mask: busy CPUs are not counted (see cpus_busy_elsewhere)")
    ctx = mp.get_context("fork")
    spinning = [ctx.Event() for _ in allowed]
    hogs = [ctx.Process(target=_spin_on, args=(cpu, event), daemon=True) for cpu, event in zip(allowed, spinning)]
    for hog in hogs:
        hog.start()
    try:
        assert all(event.wait(10) for event in spinning), [hog.exitcode for hog in hogs]
        assert cpus_busy_elsewhere() == len(allowed)
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()


_HOG = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    pass\n"


@pytest.mark.parametrize("own_session", [False, True], ids=["our session", "a session of its own"])
def test_busy_threads_share_our_group_unless_the_kernel_groups_them_by_session(own_session, idle_machine):
    """Beside threads of our scheduling group each more process of ours
    gets a share of its own; beside a job in another session, where the
    kernel groups processes by session (autogroup), ours share one."""
    import subprocess
    import sys

    from shmvec._engine.system import busy_threads_share_our_group, cpus_busy_elsewhere

    with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
        by_session = f.read().strip() == "1"
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG], start_new_session=own_session) for _ in range(2)]
    try:
        time.sleep(0.2)
        shared = busy_threads_share_our_group()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    expected = not (own_session and by_session)
    if shared is not expected and cpus_busy_elsewhere():
        pytest.skip("another program got busy during the test (idle_machine looks only at its start)")
    assert shared is expected


def _spin_on(cpu: int, spinning) -> None:
    os.sched_setaffinity(0, {cpu})
    spinning.set()
    while True:
        pass


def test_shmvec_workers_are_not_counted_as_other_programs(idle_machine):
    """The busy-CPU check leaves out shmvec's own workers (`own_pids`): a
    spinning process named there is not another program's load."""
    import multiprocessing as mp

    from shmvec._engine.system import cpus_busy_elsewhere, usable_cpus

    allowed = sorted(os.sched_getaffinity(0))
    if usable_cpus() < len(allowed):
        pytest.skip("a CPU quota below the affinity mask: busy CPUs are not counted (see cpus_busy_elsewhere)")
    ctx = mp.get_context("fork")
    spinning = ctx.Event()
    hog = ctx.Process(target=_spin_on, args=(allowed[-1], spinning), daemon=True)
    hog.start()
    try:
        assert spinning.wait(10), hog.exitcode
        assert cpus_busy_elsewhere() == 1
        assert cpus_busy_elsewhere(own_pids=[hog.pid]) == 0
    finally:
        hog.kill()
        hog.join()


class _BusyThread:
    """A thread of this process keeping a CPU busy without the GIL (hashlib
    lets it go while it hashes), as torch's OpenMP threads do for up to
    200 ms after each parallel op (Stable-Baselines3's import runs one)."""

    def __init__(self):
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        import hashlib

        data = bytes(1 << 20)
        while not self._stop.is_set():
            hashlib.sha256(data).digest()

    def __enter__(self):
        self._thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_threads_of_this_process_are_not_other_programs(idle_machine):
    """The caller's own threads (torch's, spinning after an op) are not
    another program's load: counting them made an SB3 script that built its
    envs right after `import stable_baselines3` run no worker and torch at 1
    thread (PPO with its CnnPolicy on 8 Pongs: 0.66x DummyVecEnv)."""
    from shmvec._engine.system import cpus_busy_elsewhere, usable_cpus

    if usable_cpus() < len(os.sched_getaffinity(0)):
        pytest.skip("a CPU quota below the affinity mask: busy CPUs are not counted (see cpus_busy_elsewhere)")
    with _BusyThread():
        busy = cpus_busy_elsewhere()
    _skip_if_busy_elsewhere(busy)
    assert busy == 0


def _skip_if_busy_elsewhere(seen: int) -> None:
    """Skips a test that saw a busy CPU if another program keeps one busy
    now too (one that started after idle_machine looked): not ours."""
    from shmvec._engine.system import cpus_busy_elsewhere

    if seen and cpus_busy_elsewhere():
        pytest.skip("another program keeps a CPU busy now: this test needs them idle")


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_an_env_made_while_a_thread_of_ours_spins_gets_the_default_workers(start_method, idle_machine):
    envs = shmvec.ShmVecEnv([lambda: FaultEnv()] * 8, start_method=start_method)
    quiet = envs.num_workers
    envs.close()
    with _BusyThread(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        envs = shmvec.ShmVecEnv([lambda: FaultEnv()] * 8, start_method=start_method)
    try:
        told_busy = [w for w in caught if "kept busy by other programs" in str(w.message)]
        _skip_if_busy_elsewhere(envs.num_workers != quiet or len(told_busy))
        assert envs.num_workers == quiet
        assert not told_busy
    finally:
        envs.close()


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_second_env_made_at_once_gets_the_workers_of_the_first(start_method, idle_machine):
    """A train env and then an eval env, made one after the other, get the
    same default worker count: the first env's workers, which start with a
    burst of CPU (OpenBLAS starts a thread that spins for about 100 ms when
    a worker caps its threads), are not another program keeping a CPU busy."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = shmvec.ShmVecEnv([lambda: FaultEnv()] * 8, start_method=start_method)
        try:
            second = shmvec.ShmVecEnv([lambda: FaultEnv()] * 8, start_method=start_method)
            try:
                assert second.num_workers == first.num_workers
            finally:
                second.close()
        finally:
            first.close()
    assert not [w for w in caught if "kept busy" in str(w.message)]


# -- where workers run when no CPU is idle -------------------------------------------


@pytest.fixture
def every_cpu_busy(monkeypatch):
    """The busy-CPU check finds every usable CPU kept busy by other
    programs' threads, in this process's scheduling group. Yields the CPUs this process may use; a test that moves the
    caller (os.sched_setaffinity) gets them all back afterwards."""
    from shmvec._engine import engine
    from shmvec._engine.system import usable_cpus

    allowed = sorted(os.sched_getaffinity(0))
    if usable_cpus() < 2:
        pytest.skip("needs two usable CPUs")
    monkeypatch.setattr(engine, "cpus_busy_elsewhere", lambda own_pids=(): usable_cpus())
    monkeypatch.setattr(engine, "busy_threads_share_our_group", lambda own_pids=(): True)
    monkeypatch.setattr(cpus, "LoadMeter", _meter_reading(lambda: _every_cpu_taken(usable_cpus())))
    yield allowed
    os.sched_setaffinity(0, allowed)


def _every_cpu_taken(count: int) -> cpus.Load:
    """A window in which other programs took every CPU but what we ran."""
    return cpus.Load(cpus=count, busy=float(count), ours=0.5, waits=0.5)


def _one_cpu_idle(count: int) -> cpus.Load:
    return cpus.Load(cpus=count, busy=count - 1.0, ours=1.0, waits=0.0)


def _meter_reading(load):
    """A LoadMeter whose every window has the load `load()` gives then."""
    class Meter:
        def __init__(self, pids):
            self.pids = pids

        def read(self):
            return load()

    return Meter


def _worker_cpus(envs) -> list[set[int]]:
    return [os.sched_getaffinity(p.pid) for p in envs._engine.pool.processes]


def _make_quietly(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shmvec.PerformanceWarning)
        return shmvec.ShmVecEnv([lambda: FaultEnv()] * 4, **{"start_method": "fork", **kwargs})


def test_lock_step_workers_follow_the_caller_when_no_cpu_is_idle(every_cpu_busy, closing):
    """Spread over busy CPUs, every handoff of a step waits for another
    program's turn; on the caller's CPU the two take turns with each other.
    So the default keeps one worker there, and moves it when the caller moves."""
    from shmvec._engine.plan import FOLLOW_MIN_ENVS

    allowed = every_cpu_busy
    n = FOLLOW_MIN_ENVS
    with pytest.warns(shmvec.PerformanceWarning, match=r"kept busy .* its workers run on the CPU the caller runs on"):
        envs = shmvec.ShmVecEnv([lambda: FaultEnv()] * n, start_method="fork")
    closing(envs)
    assert (envs.num_workers, envs._engine._caller is not None) == (1, True)
    os.sched_setaffinity(0, allowed[:1])
    envs.reset(seed=0)
    assert _worker_cpus(envs) == [{allowed[0]}]
    os.sched_setaffinity(0, allowed[-1:])
    envs.step(np.zeros(n, dtype=np.int64))
    assert _worker_cpus(envs) == [{allowed[-1]}]


def test_with_few_envs_and_no_cpu_idle_the_caller_steps_them_all_by_default(every_cpu_busy, closing):
    """A batch of few envs is too short for two handoffs a step on a CPU
    that another program may share: the caller steps every env itself, as
    SyncVectorEnv does (and says why). An explicit worker still follows."""
    from shmvec._engine.plan import FOLLOW_MIN_ENVS

    with pytest.warns(shmvec.PerformanceWarning, match=r"runs 0 worker processes instead of 1"):
        envs = shmvec.ShmVecEnv([lambda: FaultEnv()] * (FOLLOW_MIN_ENVS - 1), start_method="fork")
    closing(envs)
    assert envs.num_workers == 0
    worker = _make_quietly(num_workers=1)
    closing(worker)
    assert worker._engine._placement.following


def test_explicit_workers_follow_the_caller_too_and_a_restarted_one_joins_them(every_cpu_busy, closing):
    # (a fork server's child does not inherit the caller's CPU, as a fork child would)
    allowed = every_cpu_busy
    envs = _make_quietly(num_workers=2, caller_steps=False, restart_failed_workers=True, start_method="forkserver")
    closing(envs)
    os.sched_setaffinity(0, allowed[:1])
    envs.reset(seed=0)
    assert _worker_cpus(envs) == [{allowed[0]}] * 2
    os.kill(envs._engine.pool.processes[1].pid, signal.SIGKILL)
    envs.step(np.zeros(4, dtype=np.int64))  # restarts it
    assert envs._engine.restarts == 1
    envs.step(np.zeros(4, dtype=np.int64))
    assert _worker_cpus(envs) == [{allowed[0]}] * 2


@pytest.mark.parametrize("options", [{"batch_size": 2}, {"pin_workers": False}, {"pin_workers": True}],
                         ids=["async mode", "pin_workers=False", "pin_workers=True"])
def test_workers_follow_the_caller_only_in_lock_step_with_pinning_left_to_shmvec(options, every_cpu_busy, closing):
    """Async mode's processes do not wait for each other at every step: its
    worker stays wherever the kernel puts it (and with no CPU idle it still
    gets one). An explicit pin_workers is the user's: False leaves workers
    to the kernel and True pins them to CPUs of their own, both of which
    make handoffs wait for other programs' turns: the caller steps every env
    itself, as it did before workers could follow it."""
    envs = _make_quietly(**options)
    closing(envs)
    assert envs.num_workers == (1 if "batch_size" in options else 0)
    before = _worker_cpus(envs)
    if "batch_size" in options:
        envs.async_reset(seed=0)
        for _ in range(3):
            envs.send(np.zeros(2, dtype=np.int64), envs.recv()[-1]["env_id"])
        envs.recv()
    else:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
    assert _worker_cpus(envs) == before
    assert envs._engine._placement is None


def test_more_than_two_stepping_processes_do_not_follow_the_caller(every_cpu_busy, closing):
    """On one CPU they would get that CPU at most, where spread they get a
    share of every CPU; following is measured for two (unmeasured beyond)."""
    envs = _make_quietly(num_workers=3, caller_steps=False)
    closing(envs)
    assert envs._engine._placement is None
    os.sched_setaffinity(0, every_cpu_busy[:1])
    envs.reset(seed=0)
    envs.step(np.zeros(4, dtype=np.int64))
    assert all(len(cpus_) > 1 for cpus_ in _worker_cpus(envs))


def test_beside_busy_threads_of_other_sessions_the_caller_steps_alone_by_default(every_cpu_busy, monkeypatch,
                                                                                   closing):
    """Where the kernel groups processes by session, shmvec's processes
    together get one session's share beside a job started elsewhere: a
    worker more only adds handoffs, so the default starts none (lock-step
    and async mode). An explicit worker still runs on the caller's CPU."""
    from shmvec._engine import engine

    monkeypatch.setattr(engine, "busy_threads_share_our_group", lambda own_pids=(): False)
    assert _make_quietly().num_workers == 0
    assert _make_quietly(batch_size=2).num_workers == 0
    envs = _make_quietly(num_workers=1)
    closing(envs)
    os.sched_setaffinity(0, every_cpu_busy[:1])
    envs.reset(seed=0)
    assert _worker_cpus(envs) == [{every_cpu_busy[0]}]


# -- where workers run when that changes while stepping ----------------------------


def _quiet_env_with_a_watched_worker(monkeypatch, closing):
    """A lock-step env made on a quiet machine: the caller steps a slice and
    one worker steps the rest, where shmvec places it (watched)."""
    from shmvec._engine import engine
    from shmvec._engine.system import usable_cpus

    if usable_cpus() < 2 or usable_cpus() < len(os.sched_getaffinity(0)):
        pytest.skip("needs two usable CPUs and no CPU quota below them")
    monkeypatch.setattr(engine, "cpus_busy_elsewhere", lambda own_pids=(): 0)
    envs = _make_quietly(num_workers=1)
    closing(envs)
    assert envs._engine._placement is not None and not envs._engine._placement.following
    return envs


def test_workers_move_to_the_callers_cpu_when_every_cpu_comes_to_be_busy_and_back_when_one_is_idle(monkeypatch,
                                                                                                    closing):
    """Other programs that start after the env was made meet the same
    placement as those already running when it was made; once a CPU is
    idle again, the workers go back to where they were started."""
    from shmvec._engine.system import usable_cpus

    allowed = sorted(os.sched_getaffinity(0))
    load = [_one_cpu_idle(usable_cpus())]
    monkeypatch.setattr(cpus, "LoadMeter", _meter_reading(lambda: load[0]))
    monkeypatch.setattr(cpus.WorkerPlacement, "WINDOW_S", 0.0)  # a reading at every command
    envs = _quiet_env_with_a_watched_worker(monkeypatch, closing)
    started = _worker_cpus(envs)
    try:
        os.sched_setaffinity(0, allowed[:1])
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        assert _worker_cpus(envs) == started
        load[0] = _every_cpu_taken(usable_cpus())
        envs.step(np.zeros(4, dtype=np.int64))
        assert _worker_cpus(envs) == [{allowed[0]}]
        os.sched_setaffinity(0, allowed[-1:])  # following, they move with the caller
        envs.step(np.zeros(4, dtype=np.int64))
        assert _worker_cpus(envs) == [{allowed[-1]}]
        load[0] = _one_cpu_idle(usable_cpus())
        envs.step(np.zeros(4, dtype=np.int64))
        assert _worker_cpus(envs) == started
    finally:
        os.sched_setaffinity(0, allowed)


def test_workers_follow_the_caller_while_real_busy_processes_keep_every_cpu_busy(idle_machine, monkeypatch,
                                                                                 closing):
    """The same with real CPU hogs, one per CPU, started after the env was
    made and stopped before it is closed: the load is read from /proc."""
    import subprocess
    import sys

    envs = _quiet_env_with_a_watched_worker(monkeypatch, closing)
    placement = envs._engine._placement
    started = _worker_cpus(envs)
    envs.reset(seed=0)
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG]) for _ in os.sched_getaffinity(0)]
    try:
        assert _step_until(envs, lambda: placement.following), "the workers never followed the caller"
        assert _worker_cpus(envs) == [{placement.cpu}]
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert _step_until(envs, lambda: not placement.following), "the workers never went back"
    assert _worker_cpus(envs) == started


def _step_until(envs, done, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        envs.step(np.zeros(4, dtype=np.int64))
        if done():
            return True
    return False


@pytest.mark.parametrize("load, following, follows", [
    # (CPUs, busy, ours, waits): the first seven as read on 2 vCPUs beside CartPole x64
    ((2, 2.0, 2.0, 0.0), False, False),  # a quiet machine: shmvec keeps both CPUs busy itself
    ((2, 2.0, 0.65, 0.67), False, True),  # two CPU hogs came: spread, each process waits for one
    ((2, 2.0, 2.0, 0.3), False, False),  # waits for this process's own threads (a policy's)
    ((2, 1.67, 1.3, 0.5), False, False),  # one hog: a CPU partly idle
    ((2, 2.0, 1.0, 0.5), True, True),  # following beside two hogs: no CPU idle
    ((2, 1.98, 0.99, 0.51), True, True),  # ... or beside one that has the other CPU to itself
    ((2, 1.0, 1.0, 0.5), True, False),  # the hogs stopped: the other CPU idle
    ((16, 16.0, 2.0, 1.0), False, True), ((16, 15.0, 2.0, 1.0), True, False),
])
def test_workers_follow_the_caller_while_no_cpu_is_idle_by_the_last_windows_load(load, following, follows):
    assert cpus.follow_caller(cpus.Load(*load), following) is follows
