"""Ctrl-C at the edges of a call, made to land exactly there: right after
the workers got a command, in the wait of the SB3 front end, in set_attr,
in close(); and a fork child of the learner that uses or leaves the
learner's vector env. Each ends with the env usable (or closed) and no
step lost or made twice. (Ctrl-C in the middle of a wait or of the
caller's own slice: tests/test_faults.py.)"""

from __future__ import annotations

import functools
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from fault_envs import GATE, FaultEnv, actions_for, ctrl_c, later, wait_gone, worker_pids
from gymnasium.error import AlreadyPendingCallError

import shmvec

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


class _InterruptAfterPost:
    """Stands in for an engine's channel: the workers get the step, then
    Ctrl-C lands before the caller has noted it."""

    def __init__(self, channel):
        self._channel = channel

    def post_step_all(self):
        self._channel.post_step_all()
        raise KeyboardInterrupt

    def __getattr__(self, name):
        return getattr(self._channel, name)


def _interrupt_next_wait(pool) -> None:
    """Ctrl-C lands in the pool's next wait for the workers, before they are done."""
    wait = pool.wait

    def interrupted(*args, **kwargs):
        pool.wait = wait
        raise KeyboardInterrupt

    pool.wait = interrupted


def _steps(obs) -> list[int]:
    return np.asarray(obs)[:, 0].astype(int).tolist()


@pytest.mark.parametrize("num_workers, caller_steps", [(2, False), (1, True)])
def test_ctrl_c_right_after_the_workers_got_a_step_leaves_it_pending(num_workers, caller_steps, closing):
    envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=num_workers, caller_steps=caller_steps, start_method="fork")
    closing(envs)
    envs.reset(seed=0)
    engine = envs._engine
    engine._channel = _InterruptAfterPost(engine._channel)
    with pytest.raises(KeyboardInterrupt):
        envs.step(actions_for(4))
    engine._channel = engine._channel._channel
    with pytest.raises(AlreadyPendingCallError, match="pending call to `step`"):
        envs.step(actions_for(4))
    assert _steps(envs.step_wait()[0]) == [1, 1, 1, 1]  # each env stepped once
    assert _steps(envs.step(actions_for(4))[0]) == [2, 2, 2, 2]


class Watchdog(Exception):
    """What a program's own signal handler raises (a SIGALRM watchdog's)."""


@pytest.mark.parametrize("num_workers, caller_steps", [(2, False), (1, True)])
def test_a_signal_handlers_exception_in_the_wait_leaves_the_step_pending(num_workers, caller_steps, tmp_path,
                                                                         closing):
    """Any exception a signal handler raises while the caller waits for
    its workers leaves the step in flight, as KeyboardInterrupt does (and as
    AsyncVectorEnv's step_wait() does): it used to end the step as if an env
    had raised, losing the batch and asking for a reset."""
    gate = str(tmp_path / "gate")
    envs = shmvec.ShmVecEnv([functools.partial(FaultEnv, gate=gate)] * 4, num_workers=num_workers,
                            caller_steps=caller_steps, start_method="fork")
    closing(envs)
    envs.reset(seed=0)

    def watchdog(signum, frame):
        raise Watchdog("step took too long")

    previous = signal.signal(signal.SIGALRM, watchdog)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Watchdog):
            envs.step(actions_for(4, 3, GATE))  # env 3, a worker's, waits for the gate
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    open(gate, "w").close()
    assert _steps(envs.step_wait()[0]) == [1, 1, 1, 1]  # each env stepped once
    assert _steps(envs.step(actions_for(4))[0]) == [2, 2, 2, 2]


def _ctrl_c_as_the_batch_is_made(venv) -> None:
    """A real Ctrl-C lands as the front end makes the batch step_wait()
    returns (after the envs stepped and the workers were collected)."""
    build = venv._step_results

    def ctrl_c_first(records):
        del venv._step_results
        ctrl_c()
        return build(records)

    venv._step_results = ctrl_c_first


@pytest.mark.parametrize("num_workers, caller_steps", [(2, False), (1, True)])
def test_ctrl_c_right_after_the_wait_leaves_the_step_pending(num_workers, caller_steps, closing):
    """Ctrl-C once the workers are done, before their replies are read: the
    next step_wait() waits again (at once) and reads them."""
    envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=num_workers, caller_steps=caller_steps, start_method="fork")
    closing(envs)
    envs.reset(seed=0)
    _interrupt_next_call(envs._engine, "_complete", after=True)
    with pytest.raises(KeyboardInterrupt):
        envs.step(actions_for(4))
    assert _steps(envs.step_wait()[0]) == [1, 1, 1, 1]
    assert _steps(envs.step(actions_for(4))[0]) == [2, 2, 2, 2]


@pytest.mark.parametrize("num_workers, caller_steps", [(2, False), (1, True), (0, True)])
def test_ctrl_c_as_the_batch_is_made_leaves_it_to_step_wait(num_workers, caller_steps, closing):
    envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=num_workers, caller_steps=caller_steps, start_method="fork")
    closing(envs)
    envs.reset(seed=0)
    _ctrl_c_as_the_batch_is_made(envs)
    with pytest.raises(KeyboardInterrupt):
        envs.step(actions_for(4))
    with pytest.raises(AlreadyPendingCallError, match="pending call to `step`"):
        envs.step(actions_for(4))
    obs, rewards, *_ = envs.step_wait()
    assert _steps(obs) == [1, 1, 1, 1] and rewards.tolist() == [1.0] * 4
    assert _steps(envs.step(actions_for(4))[0]) == [2, 2, 2, 2]


def _sb3_vec_env(*args, **kwargs):
    # The core test environment (.ci/py-versions-check) has no SB3.
    pytest.importorskip("stable_baselines3")
    import shmvec.sb3

    return shmvec.sb3.ShmVecEnv(*args, **kwargs)


@pytest.mark.parametrize("then", ["step_wait", "step", "reset", "get_attr"])
def test_sb3_front_end_goes_on_after_ctrl_c_in_a_step(then, closing):
    """SB3's loop calls step() again (or reset(), or reads attributes) after
    a Ctrl-C, e.g. model.learn() run again in a notebook: the interrupted
    step is finished first; step_wait() returns its results."""
    venv = _sb3_vec_env([FaultEnv] * 4, num_workers=2, caller_steps=False, start_method="fork")
    closing(venv)
    venv.reset()
    _interrupt_next_wait(venv._engine.pool)
    with pytest.raises(KeyboardInterrupt):
        venv.step(actions_for(4))
    if then == "step_wait":
        assert _steps(venv.step_wait()[0]) == [1, 1, 1, 1]
    elif then == "step":
        assert _steps(venv.step(actions_for(4))[0]) == [2, 2, 2, 2]
    elif then == "reset":
        assert _steps(venv.reset()) == [0, 0, 0, 0]
    else:
        assert venv.get_attr("t") == [1, 1, 1, 1]
    assert _steps(venv.step(actions_for(4))[0]) == ([2] * 4 if then == "step_wait" else [3] * 4 if then == "step"
                                                    else [1] * 4 if then == "reset" else [2] * 4)


def test_sb3_front_end_keeps_a_step_ctrl_c_cut_short_in_the_callers_own_slice(tmp_path, closing):
    """A real Ctrl-C while the caller steps its own envs waits for them;
    step_wait() then returns the whole step."""
    gate = tmp_path / "gate"
    venv = _sb3_vec_env([functools.partial(FaultEnv, gate=str(gate))] * 4, num_workers=1, caller_steps=True,
                        start_method="fork")
    closing(venv)
    venv.reset()
    with later((0.1, ctrl_c), (0.5, gate.touch)), pytest.raises(KeyboardInterrupt):
        venv.step(actions_for(4, 0, GATE))  # env 0, the caller's, waits for the gate
    assert _steps(venv.step_wait()[0]) == [1, 1, 1, 1]
    assert _steps(venv.step(actions_for(4))[0]) == [2, 2, 2, 2]


def test_sb3_front_end_keeps_a_step_ctrl_c_cut_short_as_its_batch_was_made(closing):
    venv = _sb3_vec_env([FaultEnv] * 4, num_workers=1, caller_steps=True, start_method="fork")
    closing(venv)
    venv.reset()
    _ctrl_c_as_the_batch_is_made(venv)
    with pytest.raises(KeyboardInterrupt):
        venv.step(actions_for(4))
    obs, rewards, dones, infos = venv.step_wait()
    assert _steps(obs) == [1, 1, 1, 1] and rewards.tolist() == [1.0] * 4 and len(infos) == 4
    assert _steps(venv.step(actions_for(4))[0]) == [2, 2, 2, 2]


def test_sb3_front_end_goes_on_after_ctrl_c_in_a_reset(closing):
    venv = _sb3_vec_env([FaultEnv] * 4, num_workers=2, caller_steps=False, start_method="fork")
    closing(venv)
    venv.reset()
    venv.step(actions_for(4))
    _interrupt_next_wait(venv._engine.pool)
    with pytest.raises(KeyboardInterrupt):
        venv.reset()
    assert _steps(venv.reset()) == [0, 0, 0, 0]
    assert _steps(venv.step(actions_for(4))[0]) == [1, 1, 1, 1]


def test_ctrl_c_in_set_attr_is_collected_by_call_wait(closing):
    envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=2, caller_steps=False, start_method="fork")
    closing(envs)
    envs.reset(seed=0)
    _interrupt_next_wait(envs._engine.pool)
    with pytest.raises(KeyboardInterrupt):
        envs.set_attr("hang_s", 7.0)
    with pytest.raises(AlreadyPendingCallError, match="pending call to `call`"):
        envs.set_attr("hang_s", 8.0)
    assert envs.call_wait() == (None,) * 4  # a set_attr's results: nothing
    assert envs.get_attr("hang_s") == (7.0,) * 4
    assert _steps(envs.step(actions_for(4))[0]) == [1, 1, 1, 1]


class SlowToExitEnv(FaultEnv):
    """Its worker process outlives the envs' close by a minute: a thread
    that is not a daemon keeps it (close() waits, then kills it)."""

    def __init__(self):
        super().__init__()
        threading.Thread(target=time.sleep, args=(60,)).start()


def test_ctrl_c_in_close_still_ends_the_workers(closing):
    envs = shmvec.ShmVecEnv([SlowToExitEnv] * 4, num_workers=2, caller_steps=False, start_method="fork")
    pids = worker_pids(envs)
    first = envs._engine.pool.processes[0]

    def interrupted_join(timeout=None):
        raise KeyboardInterrupt

    first.join = interrupted_join
    with pytest.raises(KeyboardInterrupt):
        envs.close()
    del first.join
    envs.close()  # already closed: nothing to do
    del envs, first
    gc.collect()
    assert wait_gone(pids) == []


@pytest.mark.parametrize("mode", ["lock-step", "async"])
def test_a_fork_child_cannot_use_the_parents_env(mode, closing):
    """Its workers serve the process that made it: a fork child that steps
    it gets a clear error, its close() leaves them alone, and the parent
    steps on."""
    batch_size = 2 if mode == "async" else None
    envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=2, caller_steps=False, start_method="fork",
                            batch_size=batch_size)
    closing(envs)
    if mode == "async":
        envs.async_reset(seed=0)
        envs.recv()
    else:
        envs.reset(seed=0)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what step() did, then leave at once
        try:
            if mode == "async":
                envs.send(actions_for(2), [0, 1])
            else:
                envs.step(actions_for(4))
            message = "stepped"
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
        envs.close()  # as Gymnasium 0.29's __del__ does at the child's exit: the parent's workers stay
        os.write(write_end, message.encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end) as reader:
        message = reader.read()
    assert message.startswith("ShmVecError: this vector env was made in process"), message
    if mode == "async":
        assert envs.recv()[4]["env_id"].tolist() == [2, 3]  # the resets left
        envs.send(actions_for(2), [0, 1])
        obs, _, _, _, infos = envs.recv()
        assert infos["env_id"].tolist() == [0, 1] and _steps(obs) == [1, 1]
    else:
        assert _steps(envs.step(actions_for(4))[0]) == [1, 1, 1, 1]


FORK_CHILD_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import shmvec
    from fault_envs import FaultEnv, actions_for

    if __name__ == "__main__":
        envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=2, caller_steps=False, start_method=sys.argv[1])
        envs.reset(seed=0)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # the interpreter's exit, with its exit hooks, in a child that never used the env
        os.waitpid(pid, 0)
        print(envs.step(actions_for(4))[0][:, 0].tolist(), flush=True)
        envs.close()
""")


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_fork_child_that_exits_leaves_the_parents_workers_alone(start_method, tmp_path):
    """multiprocessing's exit hook in a plain fork child terminates the
    daemon processes it inherited the records of: not shmvec's workers."""
    script = tmp_path / "fork_child.py"
    script.write_text(FORK_CHILD_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), start_method], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[1.0, 1.0, 1.0, 1.0]"
    assert "Traceback" not in done.stderr, done.stderr


# -- async mode (send/recv) ------------------------------------------------------


def _interrupt_next_call(obj, name: str, after: bool = False) -> None:
    """Ctrl-C lands in `obj`'s next call of method `name`: before it runs,
    or (`after`) once it has run."""
    original = getattr(obj, name)

    def interrupted(*args, **kwargs):
        delattr(obj, name)
        if after:
            original(*args, **kwargs)
        raise KeyboardInterrupt

    setattr(obj, name, interrupted)


def _async_envs(closing, num_workers: int = 2):
    envs = shmvec.ShmVecEnv([FaultEnv] * 6, batch_size=4, num_workers=num_workers, start_method="fork")
    closing(envs)
    return envs


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("where", ["waiting", "as the engine took the envs", "after the envs came back"])
def test_ctrl_c_in_recv_loses_no_env(num_workers, where, closing):
    """recv() gathers reset results and finished envs: a Ctrl-C before it
    returns keeps them all for the next recv()."""
    envs = _async_envs(closing, num_workers)
    envs.async_reset(seed=0)
    first = envs.recv()[4]["env_id"].tolist()
    assert first == [0, 1, 2, 3]
    envs.send(actions_for(4), first)
    steps = envs._engine.async_steps
    if where == "waiting":
        _interrupt_next_call(steps, "recv")
    elif where == "as the engine took the envs":
        _interrupt_next_call(steps, "recv", after=True)
    else:
        _interrupt_next_call(steps, "records", after=True)
    with pytest.raises(KeyboardInterrupt):
        envs.recv()
    obs, _, _, _, infos = envs.recv()
    ids = infos["env_id"].tolist()
    assert ids[:2] == [4, 5] and set(ids[2:]) < {0, 1, 2, 3}  # the resets first, then two that stepped
    assert _steps(obs) == [0, 0, 1, 1]
    _assert_each_env_steps_once_per_send(envs, ids, rounds=3)


def _assert_each_env_steps_once_per_send(envs, ids: list[int], rounds: int) -> None:
    """From a recv() that returned `ids` (envs 4 and 5 reset, two of envs
    0-3 stepped once, the other two of them in flight): every env comes back
    once per send, having stepped once per send."""
    sent = {env: 1 if env < 4 else 0 for env in range(6)}
    out = set(range(4)) - set(ids)
    for _ in range(rounds):
        envs.send(actions_for(4), ids)
        out.update(ids)
        for env in ids:
            sent[env] += 1
        obs, _, _, _, infos = envs.recv()
        ids = infos["env_id"].tolist()
        assert set(ids) <= out and len(set(ids)) == 4
        assert _steps(obs) == [sent[env] for env in ids]
        out -= set(ids)


class _CtrlCOnPop(dict):
    """Reset records whose first pop() (recv() handing the envs out) brings a real Ctrl-C."""

    def pop(self, *args):
        if not getattr(self, "fired", False):
            self.fired = True
            ctrl_c()
        return super().pop(*args)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ctrl_c_as_recv_hands_the_envs_out_leaves_them_to_the_next(num_workers, closing):
    envs = _async_envs(closing, num_workers)
    envs.async_reset(seed=0)
    envs._reset_records = _CtrlCOnPop(envs._reset_records)
    with pytest.raises(KeyboardInterrupt):
        envs.recv()
    with pytest.raises(ValueError, match="an interrupted recv"):  # not received yet: not to be sent
        envs.send(actions_for(4), [0, 1, 2, 3])
    obs, _, _, _, infos = envs.recv()  # the batch the Ctrl-C kept from the caller
    assert infos["env_id"].tolist() == [0, 1, 2, 3] and _steps(obs) == [0, 0, 0, 0]
    envs.send(actions_for(4), [0, 1, 2, 3])
    obs, _, _, _, infos = envs.recv()  # the two reset envs left, then two stepped once
    ids = infos["env_id"].tolist()
    assert ids[:2] == [4, 5] and set(ids[2:]) < {0, 1, 2, 3} and _steps(obs) == [0, 0, 1, 1]


@pytest.mark.parametrize("then", ["recv", "async_reset", "send"])
def test_ctrl_c_in_async_reset_is_finished_by_the_next_async_call(then, closing):
    """An async_reset() cut short by Ctrl-C while the workers reset is
    finished by the next async call, as if it had returned: recv() hands out
    its results, send() asks for them to be received first, and
    async_reset() resets again."""
    envs = _async_envs(closing)
    _interrupt_next_wait(envs._engine.pool)
    with pytest.raises(KeyboardInterrupt):
        envs.async_reset(seed=0)
    if then == "recv":
        obs, _, _, _, infos = envs.recv()
        assert infos["env_id"].tolist() == [0, 1, 2, 3] and _steps(obs) == [0, 0, 0, 0]
    elif then == "send":
        with pytest.raises(ValueError, match="reset results not yet received"):
            envs.send(actions_for(4), [0, 1, 2, 3])
        envs.recv()
    else:
        envs.async_reset(seed=0)
        envs.recv()
    envs.send(actions_for(4), [0, 1, 2, 3])
    obs, _, _, _, infos = envs.recv()
    assert infos["env_id"].tolist()[:2] == [4, 5] and _steps(obs)[:2] == [0, 0]


class _InterruptSend:
    """Stands in for an async engine's channel: Ctrl-C lands as send()'s
    native call begins (nothing went) or as it returns (the envs went)."""

    def __init__(self, channel, after: bool):
        self._channel, self._after = channel, after

    def send_actions(self, *args):
        if self._after:
            self._channel.send_actions(*args)
        raise KeyboardInterrupt

    def __getattr__(self, name):
        return getattr(self._channel, name)


@pytest.mark.parametrize("after", [False, True], ids=["before the envs went", "once they went"])
def test_ctrl_c_in_send_steps_each_env_once(after, closing):
    envs = _async_envs(closing)
    envs.async_reset(seed=0)
    envs.recv()
    steps = envs._engine.async_steps
    steps._channel = _InterruptSend(steps._channel, after)
    with pytest.raises(KeyboardInterrupt):
        envs.send(actions_for(4), [0, 1, 2, 3])
    steps._channel = steps._channel._channel
    if after:
        with pytest.raises(ValueError, match="already in flight"):
            envs.send(actions_for(4), [0, 1, 2, 3])
    else:
        envs.send(actions_for(4), [0, 1, 2, 3])
    obs, _, _, _, infos = envs.recv()
    ids = infos["env_id"].tolist()
    assert ids[:2] == [4, 5] and len(set(ids)) == 4 and _steps(obs) == [0, 0, 1, 1]  # stepped once
    envs.send(actions_for(4), ids)
    obs, _, _, _, infos = envs.recv()
    again = infos["env_id"].tolist()
    stepped = {env: 2 if env in ids[2:] else 1 for env in range(6)}
    assert len(set(again)) == 4 and _steps(obs) == [stepped[env] for env in again]


def test_ctrl_c_while_the_caller_steps_envs_in_recv_loses_none(tmp_path, closing):
    """Without workers recv() steps the envs itself: a Ctrl-C meanwhile
    lands once they are done, and the next recv() returns them."""
    gate = tmp_path / "gate"
    envs = shmvec.ShmVecEnv([functools.partial(FaultEnv, gate=str(gate))] * 6, batch_size=4, num_workers=0)
    closing(envs)
    envs.async_reset(seed=0)
    envs.recv()
    envs.send(actions_for(4, 0, GATE), [0, 1, 2, 3])  # env 0 waits for the gate
    start = time.monotonic()
    with later((0.1, ctrl_c), (0.6, gate.touch)), pytest.raises(KeyboardInterrupt):
        envs.recv()  # the two reset envs, then 0 and 1 stepped
    assert time.monotonic() - start >= 0.55  # it waited for env 0
    obs, _, _, _, infos = envs.recv()
    assert infos["env_id"].tolist() == [4, 5, 0, 1] and _steps(obs) == [0, 0, 1, 1]
    envs.send(actions_for(4), [4, 5, 0, 1])
    obs, _, _, _, infos = envs.recv()
    assert infos["env_id"].tolist() == [2, 3, 4, 5] and _steps(obs) == [1, 1, 1, 1]


def _slice_envs(gate, closing):
    """Async mode with one worker and the caller's own slice: envs 0-2 are
    the caller's, 3-5 the worker's."""
    envs = shmvec.ShmVecEnv([functools.partial(FaultEnv, gate=str(gate))] * 6, batch_size=4, num_workers=1,
                            caller_steps=True, start_method="fork")
    closing(envs)
    assert envs._engine._caller.rows == range(0, 3)
    envs.async_reset(seed=0)
    assert envs.recv()[4]["env_id"].tolist() == [0, 1, 2, 3]
    return envs


def test_ctrl_c_while_recv_steps_the_callers_own_slice_loses_none(tmp_path, closing):
    """recv() steps the caller's own envs while too few have finished: a
    Ctrl-C meanwhile lands once the env it steps is done, and every env
    comes back, stepped once per send."""
    gate = tmp_path / "gate"
    envs = _slice_envs(gate, closing)
    envs.send(actions_for(4, 0, GATE), [0, 1, 2, 3])  # env 0, the caller's, waits for the gate
    start = time.monotonic()
    with later((0.1, ctrl_c), (0.6, gate.touch)), pytest.raises(KeyboardInterrupt):
        envs.recv()
    assert time.monotonic() - start >= 0.55  # it finished env 0 first
    obs, _, _, _, infos = envs.recv()
    ids = infos["env_id"].tolist()
    assert ids[:2] == [4, 5] and set(ids[2:]) <= {0, 1, 2, 3} and 0 in ids and _steps(obs) == [0, 0, 1, 1]
    _assert_each_env_steps_once_per_send(envs, ids, rounds=5)


def test_a_second_ctrl_c_while_recv_steps_the_callers_own_slice_asks_for_async_reset(tmp_path, closing):
    """A second Ctrl-C stops the env the caller steps for its own slice
    inside its step: the batch is half done, send() says so until
    async_reset(), which brings every env back."""
    gate = tmp_path / "gate"
    envs = _slice_envs(gate, closing)
    envs.send(actions_for(4, 0, GATE), [0, 1, 2, 3])
    start = time.monotonic()
    with later((0.1, ctrl_c), (0.3, ctrl_c)), pytest.raises(KeyboardInterrupt):
        envs.recv()
    assert time.monotonic() - start < 2  # stopped inside env 0's step, not after it
    with pytest.raises(RuntimeError, match=r"interrupted mid-batch; .*async_reset\(\) in async mode"):
        envs.send(actions_for(2), [4, 5])
    gate.touch()
    envs.async_reset(seed=1)
    obs, _, _, _, infos = envs.recv()
    assert infos["env_id"].tolist() == [0, 1, 2, 3] and _steps(obs) == [0, 0, 0, 0]
    envs.send(actions_for(4), [0, 1, 2, 3])
    obs, _, _, _, infos = envs.recv()
    assert infos["env_id"].tolist()[:2] == [4, 5] and _steps(obs) == [0, 0, 1, 1]


def test_a_second_ctrl_c_in_the_callers_own_resets_asks_for_async_reset(closing):
    """Without workers the caller resets every env itself: a second Ctrl-C
    among them (the first waits for them) leaves some reset and some not,
    and send()/recv() say so."""
    envs = _async_envs(closing, num_workers=0)
    envs.async_reset(seed=0)
    _interrupt_next_call(envs._engine._caller, "reset")
    with pytest.raises(KeyboardInterrupt):
        envs.async_reset(seed=1)
    with pytest.raises(RuntimeError, match=r"interrupted mid-batch; .*async_reset\(\) in async mode"):
        envs.recv()
    with pytest.raises(RuntimeError, match=r"interrupted mid-batch; .*async_reset\(\) in async mode"):
        envs.send(actions_for(4), [0, 1, 2, 3])
    envs.async_reset(seed=1)
    obs, _, _, _, infos = envs.recv()
    assert infos["env_id"].tolist() == [0, 1, 2, 3] and _steps(obs) == [0, 0, 0, 0]
