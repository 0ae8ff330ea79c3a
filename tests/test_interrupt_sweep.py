"""A Ctrl-C at every point of a step where Python can raise one.

Python runs a SIGINT's handler only at certain points of its own: as a
function starts, after a C function returns, at a loop's backward jump and,
before 3.11 (or under a profiler or debugger), on every return from a
function into its caller. `sys.setprofile` sees each call and each return,
Python's and C's, so a SIGINT raised from the profiler at its k-th event
lands where a real one can, as Python 3.10 handles it (the strictest case).
For each k in turn, one call gets a SIGINT at its k-th event; the loop goes
on as the README says, and every env's trajectory must still be exactly
``SyncVectorEnv``'s: no step lost, none made twice, nothing wedged.

Not swept: the return from the user's call itself into the user's frame.
Before 3.11 Python raises a SIGINT there too, after shmvec returned the
result, which is then lost in the caller's frame as any function's result
would be (the README says so). tests/test_interrupt_storm.py sends real
SIGINTs at random moments."""

from __future__ import annotations

import gc
import signal
import sys

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import NoAsyncCallError
from helpers import AUTORESETTING_MODES, assert_same, autoreset_kwargs, mode_id

import shmvec


class _RaiseSignal:
    # Called by a subscript, not a call: the profiler adds no event of its
    # own. raise_signal() runs Python's handler at once, as Python would at
    # the event's point; while shmvec holds Ctrl-C its native handler keeps
    # the SIGINT, as it would a real one.
    __getitem__ = signal.raise_signal


_RAISE = _RaiseSignal()


class ProfiledCall:
    """fn(*args) with a SIGINT at the k-th profile event inside it."""

    def __init__(self):
        self.events = 0
        self.sigint_at = 0
        self._outer = None  # fn's own frame

    def _profile(self, frame, event, arg):
        if frame.f_code is _HARNESS:
            return
        if self._outer is None and event == "call":
            self._outer = frame
        elif event == "return" and frame is self._outer:
            return  # into the user's frame: not shmvec's to keep (see the module)
        self.events += 1
        if self.events == self.sigint_at:
            _RAISE[signal.SIGINT]

    def __call__(self, sigint_at: int, fn, *args) -> tuple:
        """(fn's result or None, whether a KeyboardInterrupt cut it short)."""
        self.events, self.sigint_at, self._outer = 0, sigint_at, None
        sys.setprofile(self._profile)
        try:
            return fn(*args), False
        except KeyboardInterrupt:
            return None, True
        finally:
            sys.setprofile(None)


_HARNESS = ProfiledCall.__call__.__code__


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt), whatever was set."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def cartpoles(num_envs: int) -> list:
    return [lambda: gym.make("CartPole-v1")] * num_envs


def action(t: int, i: int) -> int:
    """Env i's action at its step t."""
    return int(np.random.default_rng(t).integers(0, 2, size=16)[i])


def actions(t: int, num_envs: int) -> np.ndarray:
    return np.array([action(t, i) for i in range(num_envs)])


def sweep_lockstep(envs, num_envs: int, split: bool) -> tuple[list, int]:
    """Steps once without a SIGINT (step 0), counting its events, then once
    for each k up to twice that, with a SIGINT at the k-th event; (the
    results of steps 1, 2, ..., how many were interrupted). The loop goes
    on as the README says: step_wait(), or the same step() again when that
    raises NoAsyncCallError."""
    call = ProfiledCall()
    call(0, envs.step, actions(0, num_envs))
    out, interrupted = [], 0
    for k in range(1, 2 * call.events):
        acts = actions(len(out) + 1, num_envs)
        if split:
            result, hit = call(k, envs.step_async, acts)
            if not hit:
                result, hit = call(k - call.events, envs.step_wait)
        else:
            result, hit = call(k, envs.step, acts)
        if hit:
            interrupted += 1
            try:
                result = envs.step_wait()
            except NoAsyncCallError:  # it never went: the same step again
                result = envs.step(acts)
        out.append(result)
    return out, interrupted


@pytest.mark.parametrize("split", [False, True], ids=["step", "step_async+step_wait"])
@pytest.mark.parametrize("mode", AUTORESETTING_MODES, ids=mode_id)
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_ctrl_c_at_every_point_of_a_step_loses_no_step(num_workers, mode, split, default_sigint, closing):
    num_envs = 4
    envs = shmvec.ShmVecEnv(cartpoles(num_envs), num_workers=num_workers, start_method="fork",
                            **autoreset_kwargs(mode))
    closing(envs)
    ref = gym.vector.SyncVectorEnv(cartpoles(num_envs), **autoreset_kwargs(mode))
    assert_same(envs.reset(seed=3), ref.reset(seed=3), "reset")
    ref.step(actions(0, num_envs))  # (sweep_lockstep's step 0)
    out, interrupted = sweep_lockstep(envs, num_envs, split)
    for t, got in enumerate(out, 1):
        assert_same(got, ref.step(actions(t, num_envs)), f"step {t}")
    assert interrupted >= 50, interrupted  # the sweep did reach into shmvec's calls


def test_ctrl_c_while_the_workers_placement_reads_the_load(monkeypatch, default_sigint, closing):
    """Lock-step workers' placement reads the CPUs' load from /proc every
    0.2 s of stepping (cpus.WorkerPlacement); here before every command, so
    that the sweep's SIGINTs land inside the reading too. One there left a
    /proc file open for the garbage to close (a ResourceWarning, an error in
    this suite: the sweep above met it now and then)."""
    from shmvec._engine.cpus import WorkerPlacement

    monkeypatch.setattr(WorkerPlacement, "WINDOW_S", 0.0)
    num_envs = 4
    envs = shmvec.ShmVecEnv(cartpoles(num_envs), num_workers=2, caller_steps=False, start_method="fork")
    closing(envs)
    if envs._engine._placement is None:
        pytest.skip("no placement watches these workers here (a CPU quota, or CPUs this process may not use)")
    ref = gym.vector.SyncVectorEnv(cartpoles(num_envs))
    assert_same(envs.reset(seed=3), ref.reset(seed=3), "reset")
    ref.step(actions(0, num_envs))
    out, interrupted = sweep_lockstep(envs, num_envs, split=True)
    for t, got in enumerate(out, 1):
        assert_same(got, ref.step(actions(t, num_envs)), f"step {t}")
    assert interrupted >= 50, interrupted


def sweep_send_recv(envs, num_envs: int) -> tuple[list, int]:
    """recv() and send() once each without a SIGINT, counting their
    events, then once each for each k up to twice the larger count, with a
    SIGINT at each one's k-th event; (each env's rows (obs, reward,
    terminated, truncated), its reset first; how many calls were cut
    short). The loop goes on as the README says: recv() again; after a
    send(), send again, where "already in flight" means it went."""
    call = ProfiledCall()
    rows: list[list] = [[] for _ in range(num_envs)]
    envs.async_reset(seed=3)
    last, interrupted, k = 0, 0, 0
    while k < last or k == 0:
        result, hit = call(k, envs.recv)
        recv_events = call.events
        if hit:
            interrupted += 1
            result = envs.recv()  # what the one cut short gathered
        obs, rewards, terminations, truncations, infos = result
        ids = infos["env_id"]
        for j, i in enumerate(ids):
            rows[i].append((obs[j].copy(), rewards[j], terminations[j], truncations[j]))
        batch = np.array([action(len(rows[i]) - 1, i) for i in ids])
        _, hit = call(k, envs.send, batch, ids)
        if hit:
            interrupted += 1
            try:  # sent or not? Sending again tells
                envs.send(batch, ids)
            except ValueError as exc:
                assert "already in flight" in str(exc), exc
        if k == 0:
            last = 2 * max(recv_events, call.events)
        k += 1
    return rows, interrupted


@pytest.mark.parametrize("mode", AUTORESETTING_MODES, ids=mode_id)
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_ctrl_c_at_every_point_of_recv_and_send_loses_no_env(num_workers, mode, default_sigint, closing):
    num_envs = 4
    envs = shmvec.ShmVecEnv(cartpoles(num_envs), num_workers=num_workers, start_method="fork",
                            batch_size=2, **autoreset_kwargs(mode))
    closing(envs)
    rows, interrupted = sweep_send_recv(envs, num_envs)
    ref = gym.vector.SyncVectorEnv(cartpoles(num_envs), **autoreset_kwargs(mode))
    expected = [ref.reset(seed=3)[0]]
    for t in range(max(len(r) for r in rows)):
        expected.append(ref.step(actions(t, num_envs))[:4])
    for i, env_rows in enumerate(rows):
        assert np.array_equal(env_rows[0][0], expected[0][i]), (i, "reset")
        for t, got in enumerate(env_rows[1:], 1):
            want = tuple(x[i] for x in expected[t])
            assert np.array_equal(got[0], want[0]) and got[1:] == want[1:], (i, t, got, want)
    # The sweep did reach into shmvec's calls. With workers, send() and most
    # recv()s are one native call each, with few points around them: 48-61
    # calls are cut short (Python 3.10 and 3.11), 124 without workers.
    assert interrupted >= 30, interrupted


@pytest.mark.parametrize("mode", AUTORESETTING_MODES, ids=mode_id)
@pytest.mark.parametrize("call", ["step", "recv"])
def test_no_finalizer_runs_inside_a_step(call, mode, closing):
    """Python drops a KeyboardInterrupt raised inside a __del__ ("Exception
    ignored in"), so a finalizer that runs inside shmvec's call is a point
    where a Ctrl-C would be lost, not raised (Gymnasium 0.29's VectorEnv
    has a __del__: a VectorEnv made and dropped in every batch was one)."""
    num_envs = 4
    envs = shmvec.ShmVecEnv(cartpoles(num_envs), num_workers=1, start_method="fork",
                            batch_size=2 if call == "recv" else None, **autoreset_kwargs(mode))
    closing(envs)
    finalizers = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "__del__":
            finalizers.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")

    ended = 0
    ids = np.arange(num_envs)
    envs.async_reset(seed=3) if call == "recv" else envs.reset(seed=3)
    for t in range(300):
        gc.disable()  # the collector's finalizers are other objects', at any call
        sys.setprofile(profile)
        try:
            if call == "recv":
                _, _, terminations, truncations, infos = envs.recv()
                ids = infos["env_id"]
            else:
                _, _, terminations, truncations, _ = envs.step(actions(t, num_envs))
        finally:
            sys.setprofile(None)
            gc.enable()
        ended += int(terminations.sum() + truncations.sum())
        if call == "recv":
            envs.send(np.array([action(t, i) for i in ids]), ids)
    assert ended > 10  # episodes ended: their final observations and infos were built
    assert finalizers == []


def test_ctrl_c_at_every_point_of_an_sb3_step_wait_loses_no_step(default_sigint, closing):
    """SB3's front end: after a Ctrl-C, step_wait() returns the step."""
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.vec_env import DummyVecEnv

    import shmvec.sb3

    num_envs = 4
    venv = shmvec.sb3.ShmVecEnv(cartpoles(num_envs), num_workers=1, start_method="fork")
    closing(venv)
    ref = DummyVecEnv(cartpoles(num_envs))
    venv.seed(3)
    ref.seed(3)
    assert np.array_equal(venv.reset(), ref.reset())
    call = ProfiledCall()
    venv.step_async(actions(0, num_envs))
    call(0, venv.step_wait)
    ref.step(actions(0, num_envs))
    interrupted = 0
    for k in range(1, 2 * call.events):
        acts = actions(k, num_envs)
        venv.step_async(acts)
        result, hit = call(k, venv.step_wait)
        if hit:
            interrupted += 1
            result = venv.step_wait()
        want = ref.step(acts)
        for got, expected in zip(result[:3], want[:3]):
            assert np.array_equal(got, expected), (k, got, expected)
    assert interrupted >= 50, interrupted
