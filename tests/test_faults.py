"""Faults: envs that raise, workers that exit or get killed, envs that hang,
a front end that gets SIGKILLed or interrupted, and nothing left behind
after close() (processes, fds, mappings, /dev/shm)."""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import warnings

import numpy as np
import pytest
from fault_envs import (
    EXIT,
    GATE,
    HANG,
    KILL,
    OK,
    RAISE,
    Boom,
    CloseRecorder,
    FaultEnv,
    actions_for,
    arena_mappings,
    children,
    cmdline,
    ctrl_c,
    descendants,
    dev_shm,
    failing_factory,
    is_mp_helper,
    later,
    open_fds,
    running,
    then_ctrl_c,
    wait_gone,
    worker_pids,
)
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError
from helpers import needs_autoreset_modes, quick_by_default

import shmvec
import shmvec._engine.engine
from shmvec._engine.worker import CLOSE_GRACE_S
from shmvec.errors import RemoteTraceback

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# (num_workers, caller_steps) for 4 envs: worker slices 0..1 and 2..3, or the
# caller steps envs 0..1 and one worker envs 2..3.
LAYOUTS = [(2, False), (1, True)]
LAYOUT_IDS = ["2workers", "caller+1worker"]


def make_envs(num_envs=4, num_workers=2, caller_steps=False, gate=None, **kwargs):
    kwargs.setdefault("start_method", "fork")
    fns = [functools.partial(FaultEnv, gate=gate)] * num_envs
    return shmvec.ShmVecEnv(fns, num_workers=num_workers, caller_steps=caller_steps, **kwargs)


@pytest.fixture
def closing():
    made = []
    yield made.append
    for envs in made:
        envs.close(terminate=True)


def caller_rows(envs) -> range:
    """The rows the calling process steps itself (none without caller_steps)."""
    pids = envs.call("pid")
    return range(sum(1 for p in pids if p == os.getpid()))


def check_remote_traceback(exc: BaseException, row: int, frame: str) -> None:
    """A worker's exception: its traceback text is the __cause__, names the env."""
    cause = exc.__cause__
    assert isinstance(cause, RemoteTraceback), f"__cause__ is {cause!r}, not a RemoteTraceback"
    text = str(cause)
    assert f"shmvec env {row})" in text, f"the worker traceback does not name env {row}:\n{text}"
    assert "fault_envs.py" in text and frame in text, f"the env's own frame is missing:\n{text}"
    assert "Boom" in text


def check_local_traceback(exc: BaseException, frame: str) -> None:
    """The caller's own slice: the exception carries its real traceback."""
    frames = traceback.extract_tb(exc.__traceback__)
    assert any(f.filename.endswith("fault_envs.py") and f.name == frame for f in frames), (
        f"the env's frame {frame} is missing from the traceback: {frames}")


def check_usable_after_error(envs) -> None:
    """After an env error: stepping needs a reset first; a reset brings every env back."""
    n = envs.num_envs
    with pytest.raises(RuntimeError, match="reset"):
        envs.step(actions_for(n))
    obs, _ = envs.reset()
    assert np.array_equal(obs, np.zeros((n, 2), np.float32))
    obs, rewards, *_ = envs.step(actions_for(n))
    assert np.array_equal(obs, np.ones((n, 2), np.float32))
    assert np.array_equal(rewards, np.ones(n))


# -- exceptions raised by envs ----------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("row", [0, 1, 2, 3])
def test_env_raises_in_step(layout, row, closing):
    envs = make_envs(num_workers=layout[0], caller_steps=layout[1])
    closing(envs)
    in_caller = row in caller_rows(envs)
    envs.reset(seed=0)
    envs.step(actions_for(4))
    with pytest.raises(Boom, match="^step failed$") as info:
        envs.step(actions_for(4, row, RAISE))
    assert type(info.value) is Boom
    if in_caller:
        check_local_traceback(info.value, "step")
    else:
        check_remote_traceback(info.value, row, "in step")
    check_usable_after_error(envs)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_env_raises_in_reset(layout, closing):
    envs = make_envs(num_workers=layout[0], caller_steps=layout[1])
    closing(envs)
    envs.reset()
    with pytest.raises(Boom, match="^reset failed$") as info:
        envs.reset(options={"fail": True})
    if layout[1]:  # env 0, the first to fail, is the caller's
        check_local_traceback(info.value, "reset")
    else:
        check_remote_traceback(info.value, 0, "in reset")
    check_usable_after_error(envs)


@needs_autoreset_modes("options['reset_mask']")
def test_env_raises_in_masked_reset_of_a_worker_env(closing):
    envs = make_envs(num_workers=1, caller_steps=True)
    closing(envs)
    envs.reset()
    mask = np.array([False, False, False, True])
    with pytest.raises(Boom, match="^reset failed$") as info:
        envs.reset(options={"fail": True, "reset_mask": mask})
    check_remote_traceback(info.value, 3, "in reset")
    check_usable_after_error(envs)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_env_raises_in_call(layout, closing):
    envs = make_envs(num_workers=layout[0], caller_steps=layout[1])
    closing(envs)
    envs.reset()
    with pytest.raises(Boom, match="^call failed$") as info:
        envs.call("explode")
    if layout[1]:
        check_local_traceback(info.value, "explode")
    else:
        check_remote_traceback(info.value, 0, "in explode")
    # A call that failed changed no env state: stepping goes on.
    obs, *_ = envs.step(actions_for(4))
    assert np.array_equal(obs, np.ones((4, 2), np.float32))
    with pytest.raises(AttributeError):
        envs.call("no_such_method")
    assert envs.get_attr("hang_s") == (60.0,) * 4


@pytest.mark.parametrize(
    "layout, bad_row",
    [((2, False), 0), ((2, False), 3), ((1, True), 1), ((1, True), 3), ((0, True), 2)],
    ids=["worker0-env0", "worker1-env3", "caller-env1", "worker-env3", "caller-only-env2"],
)
def test_env_raises_in_factory(layout, bad_row):
    gc.collect()  # first: a previous test's garbage must not close its fds during this one
    before = set(descendants())
    fds = open_fds()
    maps = set(arena_mappings())
    fns = [functools.partial(FaultEnv, fail_factory=(i == bad_row)) for i in range(4)]
    with pytest.raises(Boom, match="^factory failed$") as info:
        shmvec.ShmVecEnv(fns, num_workers=layout[0], caller_steps=layout[1], start_method="fork")
    exc = info.value
    if isinstance(exc.__cause__, RemoteTraceback):  # raised in a worker
        text = str(exc.__cause__)
        assert "in __init__" in text and "fault_envs.py" in text
        assert f"shmvec env {bad_row})" in text, (
            f"the factory of env {bad_row} failed, but the error names another env:\n{text[:200]}")
    else:
        check_local_traceback(exc, "__init__")
    assert wait_gone(set(descendants()) - before) == []
    assert open_fds() == fds
    assert set(arena_mappings()) <= maps


def test_factory_that_is_a_plain_function_raises(closing):
    fns = [functools.partial(FaultEnv)] * 3 + [failing_factory]
    with pytest.raises(Boom, match="^factory failed$") as info:
        shmvec.ShmVecEnv(fns, num_workers=1, caller_steps=False, start_method="fork")
    assert "failing_factory" in str(info.value.__cause__)


# -- workers that die ---------------------------------------------------------------


def check_died(exc: shmvec.WorkerDiedError, worker: int, rows: range, how: str) -> None:
    assert isinstance(exc, RuntimeError)
    assert exc.worker == worker
    assert list(exc.env_indices) == list(rows)
    message = str(exc)
    assert f"worker {worker}" in message
    assert f"{rows.start}..{rows.stop - 1}" in message
    if how == "exit":
        assert exc.exitcode == 3 and "exit code 3" in message
    else:
        assert exc.exitcode == -signal.SIGKILL and "SIGKILL" in message


def check_broken_then_close(envs, pids) -> None:
    """Every later operation raises at once (no hang); close() cleans up."""
    for op in (lambda: envs.step(actions_for(4)), envs.reset, lambda: envs.call("pid")):
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="died"):
            op()
        assert time.monotonic() - start < 5
    start = time.monotonic()
    envs.close()
    assert time.monotonic() - start < 10
    assert wait_gone(pids) == []
    envs.close()  # idempotent


@pytest.mark.parametrize("how", ["exit", "kill"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_worker_dies_in_step(how, layout, closing):
    envs = make_envs(num_workers=layout[0], caller_steps=layout[1])
    closing(envs)
    pids = worker_pids(envs)
    envs.reset()
    worker = layout[0] - 1  # the last worker steps envs 2..3
    start = time.monotonic()
    with pytest.raises(shmvec.WorkerDiedError) as info:
        envs.step(actions_for(4, 3, EXIT if how == "exit" else KILL))
    assert time.monotonic() - start < 5
    check_died(info.value, worker, range(2, 4), how)
    check_broken_then_close(envs, pids)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_worker_sigkilled_from_outside_while_stepping(layout, tmp_path, closing):
    gate = str(tmp_path / "gate")
    envs = make_envs(num_workers=layout[0], caller_steps=layout[1], gate=gate)
    closing(envs)
    pids = worker_pids(envs)
    victim = envs.call("pid")[3]
    envs.reset()
    killer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(shmvec.WorkerDiedError) as info:
            envs.step(actions_for(4, 3, GATE))  # waits for a gate that never opens
    finally:
        killer.join()
    assert time.monotonic() - start < 5
    check_died(info.value, layout[0] - 1, range(2, 4), "kill")
    check_broken_then_close(envs, pids)


def test_worker_sigkilled_while_idle(closing):
    envs = make_envs()
    closing(envs)
    pids = worker_pids(envs)
    victim, other = envs.call("pid")[0], envs.call("pid")[2]
    envs.reset()
    os.kill(victim, signal.SIGKILL)
    assert wait_gone([victim]) == []
    assert running(other)
    start = time.monotonic()
    with pytest.raises(shmvec.WorkerDiedError) as info:
        envs.step(actions_for(4))
    assert time.monotonic() - start < 5
    check_died(info.value, 0, range(2), "kill")
    check_broken_then_close(envs, pids)


def test_worker_exits_in_call(closing):
    envs = make_envs()
    closing(envs)
    pids = worker_pids(envs)
    with pytest.raises(shmvec.WorkerDiedError) as info:
        envs.call("exit_now")
    assert info.value.exitcode == 3
    check_broken_then_close(envs, pids)


# -- hung envs and timeouts ------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_hung_env_times_out_and_close_terminate_is_prompt(layout, closing):
    envs = make_envs(num_workers=layout[0], caller_steps=layout[1], timeout=0.5)
    closing(envs)
    pids = worker_pids(envs)
    envs.reset()
    envs.step(actions_for(4))  # a normal step is well within the timeout
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        envs.step(actions_for(4, 3, HANG))  # time.sleep(60)
    elapsed = time.monotonic() - start
    assert isinstance(info.value, multiprocessing.TimeoutError)  # what AsyncVectorEnv raises, too
    assert "envs 2..3" in str(info.value)  # the hung worker, by its envs
    assert 0.4 < elapsed < 5, elapsed
    # The vector env is broken, and says so at once, without waiting again.
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        envs.step(actions_for(4))
    with pytest.raises(RuntimeError, match="timed out"):  # (a *_wait said NoAsyncCallError)
        envs.step_wait()
    assert time.monotonic() - start < 1
    start = time.monotonic()
    envs.close(terminate=True)
    elapsed = time.monotonic() - start
    assert wait_gone(pids) == []
    assert elapsed < 3, f"close(terminate=True) took {elapsed:.1f} s to kill a hung worker"


def test_hung_env_in_async_mode_times_out_naming_its_worker(closing):
    envs = make_envs(num_workers=2, caller_steps=False, timeout=0.5, batch_size=2)
    closing(envs)
    envs.async_reset(seed=0)
    envs.recv(), envs.recv()
    envs.send(np.array([OK, HANG]), np.array([2, 3]))  # env 3 sleeps 60 s
    with pytest.raises(TimeoutError, match=r"worker 1 \(envs 2\.\.3\)"):
        envs.recv()


def test_hung_call_times_out(closing):
    envs = make_envs(num_workers=1, caller_steps=False, timeout=0.5)
    closing(envs)
    pids = worker_pids(envs)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        envs.call("hang")
    assert 0.4 < time.monotonic() - start < 5
    with pytest.raises(RuntimeError, match="timed out"):
        envs.reset()
    start = time.monotonic()
    envs.close(terminate=True)
    assert time.monotonic() - start < 3
    assert wait_gone(pids) == []


def test_hung_env_plain_close_does_not_hang(closing):
    envs = make_envs(timeout=0.5)
    closing(envs)
    pids = worker_pids(envs)
    envs.reset()
    with pytest.raises(TimeoutError):
        envs.step(actions_for(4, 0, HANG))
    # Plain close() gives workers a grace period to finish, then kills them.
    start = time.monotonic()
    envs.close()
    elapsed = time.monotonic() - start
    assert elapsed < 15, f"close() took {elapsed:.1f} s"
    assert wait_gone(pids) == []


def test_async_close_with_a_hung_env_in_flight_returns(closing):
    """Async mode: a plain close() with an env hung in flight waits out the
    grace (CLOSE_GRACE_S), then kills the workers and returns, as lock-step's
    does; it raised ClosedEnvironmentError before."""
    envs = make_envs(num_workers=1, batch_size=2)
    closing(envs)
    pids = worker_pids(envs)
    envs.async_reset(seed=0)
    ids = envs.recv()[4]["env_id"]
    actions = np.full(2, OK, dtype=np.int64)
    actions[0] = HANG
    envs.send(actions, ids)
    start = time.monotonic()
    envs.close()
    elapsed = time.monotonic() - start
    assert envs.closed and elapsed < 15, f"close() took {elapsed:.1f} s"
    assert wait_gone(pids) == []


def test_hung_factory_times_out():
    before = set(descendants())
    fns = [functools.partial(FaultEnv)] * 2 + [lambda: time.sleep(60)]
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        shmvec.ShmVecEnv(fns, num_workers=1, caller_steps=True, start_method="fork", timeout=0.5)
    elapsed = time.monotonic() - start
    assert wait_gone(set(descendants()) - before) == []
    assert elapsed < 3, f"a hung factory with timeout=0.5 took {elapsed:.1f} s to fail"


SLOW_IMPORT_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    import shmvec
    from shmvec._engine import pool
    from fault_envs import FaultEnv

    if __name__ == "__mp_main__":  # a worker imports the script again: as slow as a script that imports torch
        time.sleep(float(sys.argv[2]))

    if __name__ == "__main__":
        pool.START_TIMEOUT_S = float(sys.argv[3])
        envs = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1, caller_steps=False, start_method=sys.argv[1],
                                timeout=0.5)
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        envs.close()
        print("stepped", flush=True)
""")


@pytest.mark.heavy
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_timeout_does_not_count_a_workers_start(start_method, tmp_path):
    """`timeout` is for envs that hang. A worker started by forkserver or
    spawn imports the main module again, and a training script's imports
    (torch) take seconds: at least START_TIMEOUT_S for that, then
    `timeout` for the factories and every command."""
    script = tmp_path / "slow_import.py"
    script.write_text(SLOW_IMPORT_SCRIPT)
    done = subprocess.run([sys.executable, str(script), start_method, "1.5", "60"], cwd=tmp_path,
                          capture_output=True, text=True, env=script_env(), timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "stepped", done.stderr

    start = time.monotonic()  # a start that never ends: bounded all the same
    done = subprocess.run([sys.executable, str(script), start_method, "60", "2"], cwd=tmp_path,
                          capture_output=True, text=True, env=script_env(), timeout=120)
    elapsed = time.monotonic() - start
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and "stepped" not in done.stdout
    assert last.startswith("shmvec.errors.ShmVecTimeoutError: shmvec worker 0 (envs 0..1) did not start within "
                           "2 s"), last
    assert elapsed < 30, f"took {elapsed:.1f} s"


# -- a worker that dies while it starts ----------------------------------------------

UNGUARDED_SCRIPT = textwrap.dedent("""
    import sys
    import shmvec
    from fault_envs import FaultEnv

    envs = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1, start_method=sys.argv[1])  # no main guard
    envs.close()
    print("made", flush=True)
""")


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_main_module_without_its_guard_is_told_what_to_do(start_method, tmp_path):
    """Under forkserver (the default) and spawn each worker imports the main
    module again; made at its top level, the vector env starts workers from
    a worker, which multiprocessing stops before shmvec's code runs. The
    error says so, not only that a worker died."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script), start_method], cwd=tmp_path, capture_output=True,
                          text=True, env=script_env(), timeout=120)
    assert done.returncode != 0 and "made" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("shmvec.errors.WorkerDiedError: shmvec worker 0 (envs 1..1) died while starting"), last
    assert 'if __name__ == "__main__":' in last and 'start_method="fork"' in last, last


def test_the_same_script_runs_under_fork(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script), "fork"], cwd=tmp_path, capture_output=True,
                          text=True, env=script_env(), timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "made", done.stderr


# -- the front end killed or interrupted --------------------------------------------

PARENT_SCRIPT = textwrap.dedent("""
    import functools, sys, time
    import numpy as np
    import shmvec
    from fault_envs import HANG, FaultEnv

    if __name__ == "__main__":
        envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=2, caller_steps=False,
                                start_method=sys.argv[1])
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        pids = sorted(set(envs.call("pid")))
        if sys.argv[2] == "mid-step":
            envs.step_async(np.full(4, HANG, dtype=np.int64))  # a step of a minute
            time.sleep(0.5)  # the workers are in it
        print(*pids, flush=True)
        time.sleep(120)
""")


def script_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = TESTS_DIR + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("start_method, when", [("fork", "idle"),
                                               pytest.param("forkserver", "idle", marks=pytest.mark.heavy),
                                               pytest.param("spawn", "idle", marks=pytest.mark.heavy),
                                               ("forkserver", "mid-step")])
def test_workers_exit_when_front_end_is_sigkilled(start_method, when, tmp_path):
    """Idle workers see it at once; a worker inside an env's step that takes
    a minute ends itself CLOSE_GRACE_S later."""
    script = tmp_path / "front.py"
    script.write_text(PARENT_SCRIPT)
    # A SIGKILLed process cannot remove multiprocessing's temp dir (the fork
    # server's socket): let it land in this test's own.
    env = dict(script_env(), TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, str(script), start_method, when], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip(), f"the script failed: {proc.stderr.read() if proc.poll() is not None else ''}"
        workers = [int(p) for p in line.split()]
        assert len(workers) == 2 and proc.pid not in workers
        # Everything the front end started: workers, and under forkserver/spawn
        # multiprocessing's fork server and resource tracker.
        family = descendants(proc.pid)
        assert set(workers) <= set(family)
        proc.kill()
        proc.wait(timeout=10)
        limit = 5 if when == "idle" else CLOSE_GRACE_S + 5
        left = wait_gone(family, timeout=limit)
        assert left == [], f"still running {limit} s after the front end died: {[(p, cmdline(p)) for p in left]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_sigint_interrupts_a_slow_step_promptly(layout, tmp_path, closing):
    gate = tmp_path / "gate"
    envs = make_envs(num_workers=layout[0], caller_steps=layout[1], gate=str(gate))
    closing(envs)
    pids = worker_pids(envs)
    envs.reset()
    for pid in pids:  # workers ignore SIGINT (a terminal's Ctrl-C reaches the whole group)
        os.kill(pid, signal.SIGINT)
    start = time.monotonic()
    with later((0.3, ctrl_c)), pytest.raises(KeyboardInterrupt):
        envs.step(actions_for(4, 3, GATE))  # env 3 (a worker's) waits for the gate
    assert time.monotonic() - start < 3
    assert all(running(p) for p in pids)
    # The interrupted step stays pending, as in AsyncVectorEnv: a new step is
    # refused, and step_wait() returns the interrupted step's results.
    with pytest.raises(AlreadyPendingCallError, match="pending call to `step`"):
        envs.step(actions_for(4))
    gate.touch()
    obs, rewards, *_ = envs.step_wait()
    assert np.array_equal(obs, np.full((4, 2), 1, np.float32))
    assert np.array_equal(rewards, np.ones(4))
    obs, rewards, *_ = envs.step(actions_for(4))
    assert np.array_equal(obs, np.full((4, 2), 2, np.float32))
    assert np.array_equal(rewards, np.ones(4))
    envs.reset()
    assert all(running(p) for p in pids)
    envs.close()
    assert wait_gone(pids) == []


@pytest.mark.parametrize("opening", ["the workers' pipe", "the arena"])
def test_ctrl_c_as_construction_opens_an_fd_leaks_none(monkeypatch, opening):
    """A Ctrl-C that lands between the opening of an fd and its store (where
    close() finds it) would leave the fd open for the life of the process."""
    from shmvec import _core
    gc.collect()
    before = open_fds()
    if opening == "the arena":
        monkeypatch.setattr(_core, "create_shared_file", then_ctrl_c(_core.create_shared_file))
    else:
        monkeypatch.setattr(os, "pipe", then_ctrl_c(os.pipe))
    with pytest.raises(KeyboardInterrupt):
        make_envs(num_workers=1, caller_steps=True)
    monkeypatch.undo()
    gc.collect()
    assert open_fds() == before


def test_sigint_then_close_does_not_hang(tmp_path, closing):
    """Ctrl-C because an env hangs, then close() (a `finally:` or `with`
    block): close must not wait for the hung env forever."""
    envs = make_envs(gate=str(tmp_path / "never"))
    closing(envs)
    pids = worker_pids(envs)
    envs.reset()
    with later((0.3, ctrl_c)), pytest.raises(KeyboardInterrupt):
        envs.step(actions_for(4, 3, GATE))  # waits up to 60 s for a gate that never opens
    # close() may give the hung worker a grace period, but must not wait 60 s.
    result = {}

    def close():
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            envs.close()
        result["elapsed"] = time.monotonic() - start
        result["warnings"] = [str(w.message) for w in caught]

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(timeout=12)
    hung = closer.is_alive()
    if hung:  # let the worker finish so that the thread and the test end
        (tmp_path / "never").touch()
        closer.join(timeout=30)
    assert not hung, "close() after a KeyboardInterrupt waited for the hung env"
    assert any("Calling `close` while waiting for a pending call to `step`" in w for w in result["warnings"])
    assert wait_gone(pids) == []


@pytest.mark.parametrize("num_workers", [1, 0], ids=["caller+1worker", "caller only"])
def test_ctrl_c_during_the_callers_own_slice_waits_for_it(num_workers, tmp_path, closing, capfd):
    """Ctrl-C while the caller steps its own envs lands once they are done:
    no env is cut off mid-step, and the step stays pending with every env's
    results, as after a Ctrl-C in the wait."""
    gate = tmp_path / "gate"
    envs = make_envs(num_workers=num_workers, caller_steps=True, gate=str(gate))
    closing(envs)
    assert 0 in caller_rows(envs)
    envs.reset()
    start = time.monotonic()
    with later((0.1, ctrl_c), (0.7, gate.touch)), pytest.raises(KeyboardInterrupt):
        envs.step(actions_for(4, 0, GATE))  # env 0, the caller's, waits for the gate
    assert time.monotonic() - start >= 0.65  # it waited for env 0
    assert "Ctrl-C again" not in capfd.readouterr().err  # the step had not run long: no notice
    with pytest.raises(AlreadyPendingCallError, match="pending call to `step`"):
        envs.step(actions_for(4))
    obs, rewards, *_ = envs.step_wait()
    assert np.array_equal(obs, np.full((4, 2), 1, np.float32))  # each env stepped once
    assert np.array_equal(rewards, np.ones(4))
    assert np.array_equal(envs.step(actions_for(4))[0], np.full((4, 2), 2, np.float32))


@pytest.mark.parametrize("num_workers", [1, 0], ids=["caller+1worker", "caller only"])
def test_a_second_ctrl_c_stops_the_callers_own_slice(num_workers, tmp_path, closing, capfd):
    """An env of the caller's that hangs: the first Ctrl-C says how to stop
    it, the second stops it at once. The batch is then half done, so the
    next step asks for a reset instead of returning it as if nothing
    happened."""
    gate = tmp_path / "gate"
    envs = make_envs(num_workers=num_workers, caller_steps=True, gate=str(gate))
    closing(envs)
    envs.reset()
    start = time.monotonic()
    with later((0.7, ctrl_c), (1.0, ctrl_c)), pytest.raises(KeyboardInterrupt):
        envs.step(actions_for(4, 0, GATE))  # env 0, the caller's, waits for a gate that stays shut
    assert time.monotonic() - start < 3
    assert "press Ctrl-C again to stop them now" in capfd.readouterr().err
    gate.touch()
    with pytest.raises(RuntimeError, match="interrupted mid-batch; reset all envs"):
        envs.step(actions_for(4))
    obs, _ = envs.reset()
    assert np.array_equal(obs, np.zeros((4, 2), np.float32))
    obs = envs.step(actions_for(4))[0]
    assert np.array_equal(obs, np.ones((4, 2), np.float32))
    # The hold ended with the step: a Ctrl-C now is raised at once.
    with pytest.raises(KeyboardInterrupt):
        ctrl_c()
        time.sleep(1)


CTRL_C_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import shmvec
    from fault_envs import GATE, FaultEnv, actions_for
    import functools

    if __name__ == "__main__":
        gate = sys.argv[2]
        envs = shmvec.ShmVecEnv([functools.partial(FaultEnv, gate=gate)] * 4, num_workers=2,
                                caller_steps=False, start_method=sys.argv[1])
        envs.reset()
        pids = sorted(set(envs.call("pid")))
        print("stepping", *pids, flush=True)
        start = time.monotonic()
        try:
            envs.step(actions_for(4, 1, GATE))
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print("interrupted", time.monotonic() - start, flush=True)
        for p in pids:
            os.kill(p, 0)  # raises if a worker is gone
        open(gate, "w").close()
        envs.step_wait()  # the interrupted step, still pending
        obs = envs.step(actions_for(4))[0]
        print("stepped", *obs[:, 0].tolist(), flush=True)
        envs.close()
        print("closed", flush=True)
""")


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_ctrl_c_to_the_process_group(start_method, tmp_path):
    """As a terminal's Ctrl-C: SIGINT to the front end, its workers and
    multiprocessing's helpers at once."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), start_method, str(tmp_path / "gate")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=script_env(), start_new_session=True)
    try:
        first = proc.stdout.readline().split()
        assert first and first[0] == "stepping", proc.stderr.read() if proc.poll() is not None else first
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = out.splitlines()
    assert proc.returncode == 0, (out, err)
    assert lines[0].startswith("interrupted"), (out, err)
    assert float(lines[0].split()[1]) < 3
    assert lines[1] == "stepped 2.0 2.0 2.0 2.0"
    assert lines[2] == "closed"


# -- close() and what it leaves behind -----------------------------------------------


def test_closed_env_refuses_everything(closing):
    envs = make_envs(num_workers=1, caller_steps=True)
    envs.reset()
    envs.close()
    envs.close()  # idempotent
    assert envs.closed
    for op in (lambda: envs.step(actions_for(4)), envs.reset, lambda: envs.call("pid"),
               lambda: envs.get_attr("t"), lambda: envs.set_attr("t", 1), envs.render):
        with pytest.raises(ClosedEnvironmentError):
            op()
    envs.close(terminate=True)


@pytest.mark.parametrize("slow_worker", [0, 1])
def test_close_waits_for_every_worker_to_close_its_envs(tmp_path, slow_worker):
    """A worker that closed its envs and exited is not a worker that died:
    close() gives the others their time to close theirs."""
    markers = [str(tmp_path / f"closed-{row}") for row in range(4)]
    fns = [functools.partial(CloseRecorder, markers[row], close_s=0.5 if row // 2 == slow_worker else 0.0)
           for row in range(4)]
    envs = shmvec.ShmVecEnv(fns, num_workers=2, caller_steps=False, start_method="fork")
    envs.reset(seed=0)
    envs.step(actions_for(4))
    envs.close()
    assert [os.path.exists(m) for m in markers] == [True] * 4


@pytest.mark.parametrize("failing_row", [0, 3])
def test_close_raises_an_env_close_error_from_any_worker(tmp_path, failing_row):
    """An env whose close() raises: close() raises its error, naming that
    env, after every other env has closed and every worker is gone."""
    markers = [str(tmp_path / f"closed-{row}") for row in range(4)]
    fns = [functools.partial(CloseRecorder, markers[row], fail_close=row == failing_row) for row in range(4)]
    envs = shmvec.ShmVecEnv(fns, num_workers=2, caller_steps=False, start_method="fork")
    pids = worker_pids(envs)
    envs.reset(seed=0)
    with pytest.raises(Boom, match="close failed") as info:
        envs.close()
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert f"(in shmvec env {failing_row})" in str(info.value.__cause__)
    assert [os.path.exists(m) for m in markers] == [row != failing_row for row in range(4)]
    assert envs.closed
    assert not wait_gone(pids)


def test_close_raises_the_first_envs_close_error_the_callers_own_included(tmp_path):
    """Envs of the caller's own slice and of a worker raise in close():
    close() raises the first env's error, as errors go elsewhere (the
    caller's envs come first), naming it; the worker's was raised, and the
    caller's, named nowhere, dropped."""
    markers = [str(tmp_path / f"closed-{row}") for row in range(4)]
    fns = [functools.partial(CloseRecorder, markers[row], fail_close=row in (0, 3)) for row in range(4)]
    envs = shmvec.ShmVecEnv(fns, num_workers=1, caller_steps=True, start_method="fork")
    assert list(envs._engine._caller.rows) == [0, 1]
    pids = worker_pids(envs)
    envs.reset(seed=0)
    with pytest.raises(Boom, match="close failed") as info:
        envs.close()
    assert not isinstance(info.value.__cause__, RemoteTraceback)  # the caller's own, with its traceback
    if sys.version_info >= (3, 11):
        assert "(in shmvec env 0)" in "".join(traceback.format_exception(info.value))
    assert [os.path.exists(m) for m in markers] == [False, True, True, False]
    assert envs.closed
    assert not wait_gone(pids)


@pytest.mark.parametrize("mode", ["lock-step", "async"])
def test_close_in_a_signal_handler_during_a_step_makes_the_step_raise_closed(mode):
    """close() from a signal handler (a SIGTERM handler's graceful shutdown)
    while a step waits for its workers: the step raises the closed error,
    not an internal one, and nothing is left behind."""
    fns = [functools.partial(FaultEnv, hang_s=0.6)] * 4
    envs = shmvec.ShmVecEnv(fns, num_workers=2, caller_steps=False, start_method="fork",
                            batch_size=2 if mode == "async" else None)
    pids = worker_pids(envs)
    if mode == "async":
        envs.async_reset(seed=0)
        envs.recv(), envs.recv()
        actions = np.full(4, HANG)  # every env sleeps 0.6 s in its step
    else:
        envs.reset(seed=0)
        actions = actions_for(4, 3, HANG)  # env 3 sleeps 0.6 s in its step
    previous = signal.signal(signal.SIGUSR1, lambda *_: envs.close())
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        with pytest.raises(ClosedEnvironmentError):
            if mode == "async":
                envs.send(actions, np.arange(4))
                envs.recv()
            else:
                envs.step(actions)
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
    assert envs.closed
    assert not wait_gone(pids)


class StepThenClose(FaultEnv):
    """Records, in the process that steps it, whether its close() came while
    its step() ran (a worker runs them one after the other; the caller's own
    slice may be closed from another thread or a signal handler)."""

    closed: dict[int, bool] = {}  # row -> closed mid-step

    def __init__(self, row: int, hang_s: float):
        super().__init__(hang_s=hang_s)
        self.row = row
        self.stepping = False

    def step(self, action):
        self.stepping = True
        try:
            return super().step(action)
        finally:
            self.stepping = False

    def close(self):
        StepThenClose.closed[self.row] = self.stepping


def _step_env_0_hanging(envs, mode: str) -> None:
    """One step (lock-step) or send/recv (async) in which env 0, the
    caller's, sleeps `hang_s` in its step."""
    actions = actions_for(4, 0, HANG)
    if mode == "async":
        envs.send(actions, np.arange(4))
        envs.recv()
    else:
        envs.step(actions)


def _step_in_a_thread(envs, mode: str) -> tuple[threading.Thread, list]:
    """_step_env_0_hanging in a thread of its own, started; the list gets
    what it raises."""
    raised = []

    def rollout():
        try:
            _step_env_0_hanging(envs, mode)
        except BaseException as exc:
            raised.append(exc)

    stepping = threading.Thread(target=rollout)
    stepping.start()
    return stepping, raised


def _callers_slice_envs(mode: str, num_workers: int, hang_s: float):
    StepThenClose.closed.clear()
    envs = shmvec.ShmVecEnv([functools.partial(StepThenClose, row, hang_s) for row in range(4)],
                            num_workers=num_workers, caller_steps=True, start_method="fork",
                            batch_size=2 if mode == "async" else None)
    assert 0 in caller_rows(envs)
    if mode == "async":
        envs.async_reset(seed=0)
        envs.recv(), envs.recv()
    else:
        envs.reset(seed=0)
    return envs, worker_pids(envs)


@pytest.mark.parametrize("mode", ["lock-step", "async"])
@pytest.mark.parametrize("num_workers", [1, 0], ids=["caller+1worker", "caller only"])
def test_close_from_another_thread_closes_the_callers_env_after_its_step(mode, num_workers):
    """close() while another thread is inside a step of an env of the
    caller's own slice: as a worker process does (AsyncVectorEnv's too), it
    closes that env once the step returns, never under it; the step raises
    the closed error."""
    envs, pids = _callers_slice_envs(mode, num_workers, hang_s=0.6)
    stepping, raised = _step_in_a_thread(envs, mode)
    time.sleep(0.2)  # env 0 is asleep in its step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Calling `close` while waiting for a pending call to `step`"
        envs.close()
    assert StepThenClose.closed.get(0) is False  # closed by close(), after its step
    stepping.join(10)
    assert len(raised) == 1 and isinstance(raised[0], ClosedEnvironmentError), raised
    assert all(not mid_step for mid_step in StepThenClose.closed.values())
    assert wait_gone(pids) == []


def test_close_from_another_thread_waits_for_the_callers_env_at_most_the_grace(monkeypatch):
    """An env of the caller's that stays in its step past the grace: close()
    returns (bounded in time), and the thread stepping it closes it once its
    step returns."""
    monkeypatch.setattr(shmvec._engine.engine, "CLOSE_GRACE_S", 0.3)
    envs, pids = _callers_slice_envs("lock-step", 1, hang_s=2.0)
    stepping, raised = _step_in_a_thread(envs, "lock-step")
    time.sleep(0.2)
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs.close()
    assert time.monotonic() - start < 1.5
    assert 0 not in StepThenClose.closed  # still in its step
    assert wait_gone(pids) == []  # the workers are gone all the same
    stepping.join(10)
    assert len(raised) == 1 and isinstance(raised[0], ClosedEnvironmentError), raised
    assert StepThenClose.closed == {0: False, 1: False}  # the caller's two, each after its step


@pytest.mark.parametrize("mode", ["lock-step", "async"])
@pytest.mark.parametrize("num_workers", [1, 0], ids=["caller+1worker", "caller only"])
def test_close_in_a_signal_handler_inside_the_callers_env_closes_it_after_its_step(mode, num_workers):
    """A SIGTERM handler's close() that lands inside a step of the caller's
    own env: that env is closed as its step returns, not under it, and the
    step raises the closed error."""
    envs, pids = _callers_slice_envs(mode, num_workers, hang_s=0.6)
    previous = signal.signal(signal.SIGUSR1, lambda *_: envs.close())
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(ClosedEnvironmentError):
                _step_env_0_hanging(envs, mode)
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, previous)
    assert envs.closed
    assert StepThenClose.closed.get(0) is False
    assert all(not mid_step for mid_step in StepThenClose.closed.values())
    assert wait_gone(pids) == []


def _reap_children(signum, frame):
    """A program's own SIGCHLD handler that reaps whatever child exited."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("handler", [signal.SIG_IGN, _reap_children], ids=["SIG_IGN", "reaper"])
def test_close_where_the_program_reaps_its_children_itself(start_method, handler):
    """With SIGCHLD ignored (the kernel reaps children) or a handler of the
    program's reaping them, waitpid() cannot tell that a worker has ended:
    close() raised multiprocessing's "Cannot close a process while it is
    still running", and again at exit, where AsyncVectorEnv closes."""
    previous = signal.signal(signal.SIGCHLD, handler)
    try:
        envs = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=2, caller_steps=False, start_method=start_method)
        envs.reset(seed=0)
        envs.step(actions_for(2))
        pids = worker_pids(envs)
        envs.close()
        assert envs.closed
        assert wait_gone(pids) == []
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_close_releases_the_arena_while_the_object_lives():
    """close() unmaps the arena, even if the (closed) vector env object is
    still referenced, e.g. by a trainer that keeps it as an attribute."""
    gc.collect()
    maps = set(arena_mappings())
    envs = make_envs(num_workers=1, caller_steps=True)
    obs, _ = envs.reset()  # a copy: it does not keep the arena mapped
    envs.step(actions_for(4))
    assert set(arena_mappings()) - maps
    envs.close()
    left = set(arena_mappings()) - maps
    assert not left, f"the arena is still mapped after close(): {left}"
    assert obs.shape == (4, 2)


def dev_shm_in_use(pid: int) -> set[str]:
    """The /dev/shm files process `pid` maps or holds open."""
    with open(f"/proc/{pid}/maps") as f:
        used = {line.split(maxsplit=5)[-1].strip() for line in f if "/dev/shm/" in line}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("/dev/shm/"):
            used.add(target)
    return used


def check_dev_shm_unused(before: set[str], pids=(), ours_before: set[str] = frozenset()) -> None:
    """/dev/shm is shared with every process on the machine, so new entries
    there may be anyone's: ours would carry shmvec's name or be open or
    mapped by this process or by `pids` (beyond `ours_before`, what this
    process used before: an earlier test's libraries, such as the POSIX
    semaphore moviepy's video writer leaves mapped, which forked workers
    inherit)."""
    assert not {name for name in dev_shm() - before if "shmvec" in name}
    for pid in (os.getpid(), *pids):
        assert dev_shm_in_use(pid) <= ours_before, pid


def test_arena_is_a_memfd_not_a_dev_shm_file(closing):
    before, ours_before = dev_shm(), dev_shm_in_use(os.getpid())
    envs = make_envs(num_workers=1, caller_steps=True)
    closing(envs)
    pids = worker_pids(envs)
    envs.reset()
    for pid in (os.getpid(), *pids):
        with open(f"/proc/{pid}/maps") as f:
            assert any("memfd:shmvec-arena" in line for line in f), f"no arena mapped in {pid}"
    check_dev_shm_unused(before, pids, ours_before)


def _cycle(k: int, start_method: str) -> None:
    """One create/use/close cycle; odd cycles also break something first."""
    configs = [(2, False), (1, True), (0, True), (1, False)]
    num_workers, caller_steps = configs[k % len(configs)]
    envs = make_envs(num_workers=num_workers, caller_steps=caller_steps, start_method=start_method)
    envs.reset(seed=k)
    envs.step(actions_for(4))
    if k % 5 == 1:
        with pytest.raises(Boom):
            envs.step(actions_for(4, 3, RAISE))
    elif k % 5 == 3 and num_workers:
        with pytest.raises(shmvec.WorkerDiedError):
            envs.step(actions_for(4, 3, KILL))
    envs.close()


def check_no_leaks(cycles: int, start_method: str) -> None:
    _cycle(0, start_method)  # warm up: the fork server and resource tracker start once
    gc.collect()  # first: garbage must not close its fds during the cycles
    before_procs = set(descendants())
    before_fds = open_fds()
    before_shm, ours_before = dev_shm(), dev_shm_in_use(os.getpid())
    before_maps = arena_mappings()
    for k in range(cycles):
        _cycle(k, start_method)
    # No worker left: only what was there before, plus multiprocessing's own
    # fork server / resource tracker (children of ours, never their children).
    extra = set(descendants()) - before_procs
    extra = {p for p in extra if not (is_mp_helper(p) and p in children())}
    assert wait_gone(extra, 5) == [], [(p, cmdline(p)) for p in extra if running(p)]
    assert all(is_mp_helper(p) for p in children() if running(p) and p not in before_procs)
    assert open_fds() == before_fds
    check_dev_shm_unused(before_shm, ours_before=ours_before)
    # Closed envs that pytest.raises tracebacks still reference go with the
    # garbage; whether close() itself unmaps is test_close_releases_the_arena...
    gc.collect()
    assert set(arena_mappings()) <= set(before_maps)


def test_create_close_cycles_leak_nothing_fork():
    check_no_leaks(20, "fork")


@pytest.mark.heavy
def test_create_close_cycles_leak_nothing_forkserver():
    check_no_leaks(20, "forkserver")
    # The fork server's own children (our workers) are all gone.
    for helper in children():
        if "multiprocessing.forkserver" in cmdline(helper):
            assert wait_gone(children(helper), 5) == []


@pytest.mark.slow
def test_create_close_cycles_leak_nothing_spawn():
    check_no_leaks(20, "spawn")


# -- vector envs nobody closed ----------------------------------------------------------


def test_unclosed_env_dropped_releases_workers_and_fds():
    """A vector env that is garbage-collected without close() lets its
    workers go at once and leaves no fd behind."""
    gc.collect()
    fds = open_fds()
    envs = make_envs(num_workers=1, caller_steps=True)
    pids = worker_pids(envs)
    envs.reset()
    start = time.monotonic()
    del envs
    gc.collect()
    elapsed = time.monotonic() - start
    assert wait_gone(pids) == []
    assert elapsed < 3, f"dropping an unclosed vector env blocked for {elapsed:.1f} s"
    assert open_fds() == fds


FD_LIMIT_SCRIPT = textwrap.dedent("""
    import multiprocessing, os, resource, sys, warnings
    import shmvec
    from fault_envs import FaultEnv, open_fds

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # CPUs not reserved: runs unpinned
    warnings.filterwarnings("ignore", category=shmvec.PerformanceWarning)

    def make():
        return shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=2, caller_steps=False, start_method=sys.argv[1])

    if __name__ == "__main__":
        make().close()  # the fork server (if any) started with room to spare
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        for room in range(0, 40):  # fds open below the limit: too few for a start, then enough
            before = open_fds()
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(before) + 1 + room, hard))
            try:
                make().close()
            except OSError as exc:
                error = exc
            else:
                assert room > 0, "started with no room to spare: the limit was never reached"
                print("started with room", room)
                break
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            left = {fd: what for fd, what in open_fds().items() if fd not in before}
            assert not left, f"room {room}: {error!r} left {left} open"
            assert not multiprocessing.active_children(), f"room {room}: workers left running"
            assert "ulimit -n" in str(error), f"room {room}: {error!r}"
        else:
            raise AssertionError("never started")
""")


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_running_out_of_fds_while_starting_leaves_nothing_open(start_method, tmp_path):
    """Below the fd limit a start needs, construction fails with an error that
    says which limit, and leaves no fd and no worker behind: a worker started
    before the next one failed used to be left out of the pool, and
    multiprocessing leaks a pipe when the second of its pipes cannot open."""
    assert "started with room" in run_fd_limit_script(FD_LIMIT_SCRIPT, start_method, tmp_path)


def run_fd_limit_script(text: str, start_method: str, tmp_path) -> str:
    """Runs `text` as a program of its own (it lowers its own fd limit); its stdout."""
    script = tmp_path / "fd_limit.py"
    script.write_text(text)
    proc = subprocess.run([sys.executable, str(script), start_method], check=False, cwd=tmp_path,
                          capture_output=True, text=True, env=script_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


RESTART_FD_LIMIT_SCRIPT = textwrap.dedent("""
    import multiprocessing, resource, sys, warnings
    import numpy as np
    import shmvec
    from fault_envs import EXIT, OK, FaultEnv, open_fds

    warnings.filterwarnings("ignore", category=shmvec.PerformanceWarning)

    if __name__ == "__main__":
        envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=2, caller_steps=False, start_method=sys.argv[1],
                                restart_failed_workers=True)
        envs.reset(seed=0)
        before = open_fds()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(before) + 1, hard))  # no fd to spare
        try:
            envs.step(np.array([EXIT, OK, OK, OK]))
        except shmvec.WorkerDiedError as exc:
            assert "could not be restarted" in str(exc) and "ulimit -n" in str(exc), exc
        else:
            raise AssertionError("the step went on without its worker")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        try:
            envs.step(np.array([OK] * 4))
        except shmvec.ShmVecError as exc:
            assert "close this vector env" in str(exc), exc
        else:
            raise AssertionError("a step ran without worker 0")
        envs.close()
        assert not multiprocessing.active_children(), "workers left running"
        print("closed")
""")


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_restart_that_runs_out_of_fds_breaks_the_env_cleanly(start_method, tmp_path):
    """A worker that cannot be restarted (no fd left for its start) makes
    the step raise WorkerDiedError naming why; the env can then only be
    closed, and closes cleanly."""
    assert "closed" in run_fd_limit_script(RESTART_FD_LIMIT_SCRIPT, start_method, tmp_path)


EXIT_SCRIPT = textwrap.dedent("""
    import weakref
    weakref.finalize(weakref, int)  # weakref's exit hook first: it runs after multiprocessing's
    import sys
    import warnings
    import numpy as np
    import shmvec
    from fault_envs import FaultEnv

    # On a busy machine two workers get a PerformanceWarning: not the point here.
    warnings.filterwarnings("ignore", "shmvec found", shmvec.PerformanceWarning)

    if __name__ == "__main__":
        envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=2, caller_steps=False,
                                start_method=sys.argv[1], daemon=sys.argv[2] == "daemon")
        envs.reset()
        envs.step(np.zeros(4, dtype=np.int64))
        print(*sorted(set(envs.call("pid"))), flush=True)
        # exits without close()
""")


@pytest.mark.parametrize("start_method, daemon", quick_by_default([["fork", "forkserver"], ["daemon", "not-daemon"]],
                                                                   ("fork", "daemon"), ("forkserver", "not-daemon")))
def test_interpreter_exit_without_close_is_prompt(start_method, daemon, tmp_path):
    """Also with daemon=False, whose workers multiprocessing waits for at
    exit: shmvec ends them first."""
    script = tmp_path / "no_close.py"
    script.write_text(EXIT_SCRIPT)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), start_method, daemon], check=False, cwd=tmp_path,
                          capture_output=True, text=True, env=script_env(), timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # quietly
    workers = [int(p) for p in proc.stdout.split()]
    assert len(workers) == 2
    assert wait_gone(workers) == []
    assert elapsed < 5, f"the interpreter took {elapsed:.1f} s to exit with an unclosed vector env"


class ChildProcessEnv(FaultEnv):
    """Starts a multiprocessing child of its own in reset(), as an env that
    runs a simulator or a data loader in another process does."""

    def reset(self, *, seed=None, options=None):
        child = multiprocessing.get_context("fork").Process(target=int)
        child.start()
        child.join()
        return super().reset(seed=seed, options=options)


def test_daemon_false_lets_envs_start_processes_of_their_own(closing):
    """As AsyncVectorEnv's daemon=False; the default (daemon workers) is
    refused by multiprocessing, as under AsyncVectorEnv."""
    envs = shmvec.ShmVecEnv([ChildProcessEnv] * 2, num_workers=2, caller_steps=False, start_method="fork",
                            daemon=False)
    closing(envs)
    assert envs.reset(seed=0)[0].tolist() == [[0, 0], [0, 0]]
    pids = envs.call("pid")
    envs.close()
    assert wait_gone(list(pids)) == []
    daemonic = shmvec.ShmVecEnv([ChildProcessEnv] * 2, num_workers=2, caller_steps=False, start_method="fork")
    closing(daemonic)
    with pytest.raises(AssertionError, match="daemonic processes are not allowed to have children"):
        daemonic.reset(seed=0)


def test_pinned_workers_of_two_envs_take_distinct_cpus_and_free_them(tmp_path, monkeypatch):
    """pin_workers=True reserves CPUs across vector envs (and programs):
    a second env avoids the first one's CPUs while any is free, and closing
    releases them."""
    import os as _os
    import tempfile

    # A lock directory of this test's own: other shmvec programs on the machine hold theirs.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)

    cpus = sorted(_os.sched_getaffinity(0))
    first = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1, caller_steps=True, pin_workers=True,
                             start_method="fork")
    second = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1, caller_steps=True, pin_workers=True,
                              start_method="fork")
    try:
        a = _os.sched_getaffinity(first._engine.pool.processes[0].pid)
        b = _os.sched_getaffinity(second._engine.pool.processes[0].pid)
        assert len(a) == len(b) == 1
        if len(cpus) >= 2:
            assert a != b
    finally:
        first.close()
        second.close()
    third = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1, caller_steps=True, pin_workers=True,
                             start_method="fork")
    try:  # the first env's CPU is free again: the highest one is taken first
        assert _os.sched_getaffinity(third._engine.pool.processes[0].pid) == {cpus[-1]}
    finally:
        third.close()
