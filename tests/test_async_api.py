"""AsyncVectorEnv's own API, so that code written for it runs unchanged:
the *_async / *_wait pairs and their call state, per-call timeouts that keep
the call pending, AsyncVectorEnv's constructor keywords, observation_mode,
and any worker count for any number of envs."""

from __future__ import annotations

import functools
import multiprocessing
import re
import time
import warnings

import gymnasium as gym
import numpy as np
import pytest
from fault_envs import GATE, FaultEnv, actions_for
from gymnasium import spaces
from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError
from gymnasium.vector import SyncVectorEnv
from helpers import FINAL_OBS, SAME_STEP, assert_same, needs_gymnasium_1, needs_same_step, run_lockstep, sync_pair

import shmvec
from shmvec.testing import SpacesEnv


def fault_envs(num_envs=4, gate=None, **kwargs):
    kwargs.setdefault("start_method", "fork")
    kwargs.setdefault("num_workers", 1)
    return shmvec.ShmVecEnv([functools.partial(FaultEnv, gate=gate)] * num_envs, **kwargs)


# -- the *_async / *_wait pairs -------------------------------------------------------


def test_async_wait_pairs_give_what_the_plain_calls_give(closing):
    fns = [lambda: gym.make("CartPole-v1")] * 4
    envs = shmvec.ShmVecEnv(fns, num_workers=1, start_method="fork")
    ref = SyncVectorEnv(fns)
    closing(envs), closing(ref)
    envs.reset_async(seed=3)
    assert_same(envs.reset_wait(), ref.reset(seed=3), "reset")
    for t in range(40):
        actions = np.array([t % 2, 1, 0, (t // 3) % 2])
        envs.step_async(actions)
        assert_same(envs.step_wait(), ref.step(actions), f"step {t}")
    envs.call_async("get_wrapper_attr", "spec")
    assert envs.call_wait() == ref.call("get_wrapper_attr", "spec")


def test_call_state_errors_match_async_vector_env(closing):
    envs = fault_envs()
    closing(envs)
    with pytest.raises(NoAsyncCallError, match=re.escape("Calling `reset_wait` without any prior call to `reset_async`.")):
        envs.reset_wait()
    envs.reset_async()
    for begin, name in [(lambda: envs.step_async(actions_for(4)), "step_async"),
                        (envs.reset_async, "reset_async"), (lambda: envs.call_async("pid"), "call_async"),
                        (lambda: envs.set_attr("t", 0), "set_attr"), (lambda: envs.step(actions_for(4)), "step_async")]:
        with pytest.raises(AlreadyPendingCallError,
                           match=re.escape(f"Calling `{name}` while waiting for a pending call to `reset` to complete")):
            begin()
    with pytest.raises(NoAsyncCallError, match=re.escape("Calling `step_wait` without any prior call to `step_async`.")):
        envs.step_wait()
    envs.reset_wait()
    with pytest.raises(NoAsyncCallError, match="call_wait"):
        envs.call_wait()
    # A refused call changed nothing: the env steps as if it had not happened.
    obs, *_ = envs.step(actions_for(4))
    assert np.array_equal(obs, np.ones((4, 2), np.float32))


@pytest.mark.parametrize("num_workers, caller_steps", [(2, False), (1, True)])
def test_step_wait_timeout_keeps_the_step_pending(num_workers, caller_steps, tmp_path, closing):
    """A per-call timeout raises the TimeoutError AsyncVectorEnv raises, and
    loses nothing: the step stays pending and step_wait() collects it."""
    gate = tmp_path / "gate"
    envs = fault_envs(gate=str(gate), num_workers=num_workers, caller_steps=caller_steps)
    closing(envs)
    envs.reset()
    envs.step_async(actions_for(4, 3, GATE))  # env 3, a worker's, waits for the gate
    start = time.monotonic()
    with pytest.raises(multiprocessing.TimeoutError) as info:
        envs.step_wait(timeout=0.2)
    assert isinstance(info.value, TimeoutError)  # the builtin one too
    assert time.monotonic() - start < 3
    with pytest.raises(AlreadyPendingCallError):
        envs.step(actions_for(4))
    gate.touch()
    obs, rewards, *_ = envs.step_wait(timeout=30)
    assert np.array_equal(obs, np.ones((4, 2), np.float32))
    assert np.array_equal(rewards, np.ones(4))
    obs, *_ = envs.step(actions_for(4))  # and on it goes
    assert np.array_equal(obs, np.full((4, 2), 2, np.float32))


@pytest.mark.parametrize("num_workers, caller_steps", [(2, False), (1, True), (0, True)])
def test_a_zero_timeout_returns_finished_results(num_workers, caller_steps, closing):
    """*_wait(timeout=0) polls, as AsyncVectorEnv's does: a loop that polls
    gets the results. Where the caller steps a slice of its own, the first
    wait runs it, past the timeout (TimeoutError, the results kept); the
    next finds the workers' part done. It raised at every poll before."""
    fns = [lambda: gym.make("CartPole-v1")] * 4
    envs = shmvec.ShmVecEnv(fns, num_workers=num_workers, caller_steps=caller_steps, start_method="fork")
    ref = SyncVectorEnv(fns)
    closing(envs), closing(ref)

    def finished(begin, end, *args, **kwargs):
        begin(*args, **kwargs)
        time.sleep(0.2)  # the workers' part is done long before
        for poll in range(2 if caller_steps else 1):
            try:
                return end(timeout=0)
            except multiprocessing.TimeoutError:
                assert caller_steps and poll == 0
        raise AssertionError("two polls did not get the finished results")

    assert_same(finished(envs.reset_async, envs.reset_wait, seed=3), ref.reset(seed=3))
    for _ in range(3):
        actions = np.array([0, 1, 1, 0])
        assert_same(finished(envs.step_async, envs.step_wait, actions), ref.step(actions))
    assert finished(envs.call_async, envs.call_wait, "get_wrapper_attr", "spec") == ref.call("get_wrapper_attr", "spec")


def test_call_wait_timeout_then_results(tmp_path, closing):
    envs = fault_envs(num_workers=2, caller_steps=False, gate=str(tmp_path / "gate"))
    closing(envs)
    envs.reset()
    envs.set_attr("hang_s", [0.0, 0.0, 0.0, 1.0])
    envs.call_async("hang")
    with pytest.raises(TimeoutError):
        envs.call_wait(timeout=0.1)
    assert envs.call_wait(timeout=30) == (None,) * 4


def test_close_with_a_pending_call_warns_and_closes(closing):
    envs = fault_envs()
    closing(envs)
    envs.reset()
    envs.step_async(actions_for(4))
    with pytest.warns(UserWarning, match=re.escape("Calling `close` while waiting for a pending call to `step` to complete.")):
        envs.close()
    assert envs.closed


@pytest.mark.parametrize("row", [0, 3], ids=["the caller's env", "a worker's env"])
def test_close_with_a_pending_step_is_bounded_when_an_env_of_it_hangs(row, tmp_path, closing):
    """close() waits for a pending call at most `timeout` seconds. The
    caller's own slice of a pending step runs in the call that collects it,
    and nobody collects it at close(): it used to run there, so an env of
    it that hangs held close() for as long (for good, if it never returns)."""
    gate = str(tmp_path / "gate")  # never made: env `row` waits its 60 s
    envs = fault_envs(gate=gate, num_workers=1, caller_steps=True)
    closing(envs)
    envs.reset()
    envs.step_async(actions_for(4, row, GATE))
    started = time.monotonic()
    with pytest.warns(UserWarning, match="Calling `close` while waiting"):
        envs.close(timeout=0.5)
    assert envs.closed
    assert time.monotonic() - started < 20


# -- AsyncVectorEnv's constructor keywords --------------------------------------------


def test_async_vector_env_keywords(closing):
    fns = [lambda: gym.make("CartPole-v1")] * 3
    envs = shmvec.ShmVecEnv(fns, context="fork", shared_memory=False, daemon=True)
    closing(envs)
    ref = SyncVectorEnv(fns)
    closing(ref)
    run_lockstep(envs, ref, steps=20)
    with pytest.raises(ValueError, match="worker"):
        shmvec.ShmVecEnv(fns, worker=lambda *args: None)
    with pytest.raises(ValueError, match="disagree"):
        shmvec.ShmVecEnv(fns, context="fork", start_method="spawn")


@needs_gymnasium_1("vector envs without space keywords")
@pytest.mark.parametrize("name", ["observation_space", "action_space"])
def test_0_29_space_keywords_are_refused_as_1_x_refuses_them(name):
    """0.29's SyncVectorEnv and AsyncVectorEnv took the spaces as keywords
    (tests/test_gym029.py); 1.x's take none: a TypeError, before any env is made."""
    made = []
    fns = [lambda: made.append(1) or gym.make("CartPole-v1")] * 2
    space = gym.make("CartPole-v1").observation_space
    with pytest.raises(TypeError, match=name):
        gym.vector.AsyncVectorEnv(fns, **{name: space})
    with pytest.raises(TypeError, match=rf"unexpected keyword argument '{name}'.*only 0\.29's"):
        shmvec.ShmVecEnv(fns, num_workers=0, **{name: space})
    assert not made


@pytest.mark.parametrize("cpus", [2, 16])
def test_max_concurrency_caps_the_stepping_processes(monkeypatch, cpus):
    """AsyncVectorEnv's max_concurrency (Gymnasium 1.4) caps how many envs
    step at once; shmvec's processes each step their envs one at a time, so
    it caps the stepping processes, the caller counting while it steps."""
    from shmvec._engine import plan

    monkeypatch.setattr(plan, "usable_cpus", lambda: cpus)
    for async_mode in (False, True):
        assert plan.plan_slices(64, None, None, async_mode, max_concurrency=1) == (0, True)
        assert plan.plan_slices(64, None, None, async_mode, max_concurrency=2) == (1, True)
        assert plan.plan_slices(64, None, None, async_mode, max_concurrency=100) == (cpus - 1, True)
        assert plan.plan_slices(64, None, False, async_mode, max_concurrency=1) == (1, False)
        assert plan.plan_slices(64, 3, False, async_mode, max_concurrency=3) == (3, False)
        with pytest.raises(ValueError, match="max_concurrency=2"):
            plan.plan_slices(64, 2, True, async_mode, max_concurrency=2)
        with pytest.raises(ValueError, match="max_concurrency=2"):
            plan.plan_slices(64, 3, False, async_mode, max_concurrency=2)


def test_max_concurrency_as_async_vector_env_takes_it(closing):
    fns = [lambda: gym.make("CartPole-v1")] * 4
    envs = shmvec.ShmVecEnv(fns, max_concurrency=1, start_method="fork")
    ref = SyncVectorEnv(fns)
    closing(envs), closing(ref)
    assert envs.max_concurrency == 1 and envs.num_workers == 0
    run_lockstep(envs, ref, steps=20)
    # AsyncVectorEnv's checks, with its errors
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="max_concurrency"):
            shmvec.ShmVecEnv(fns, max_concurrency=bad)


# -- observation_mode ------------------------------------------------------------------


def box_env(high):
    return functools.partial(SpacesEnv, spaces.Box(0, high, (3,), np.float32), spaces.Discrete(2))


@needs_gymnasium_1("observation_mode")
@pytest.mark.parametrize("mode", ["different", "pair"])
def test_observation_mode_different_matches_sync(mode, closing):
    from gymnasium.vector.utils import batch_differing_spaces

    fns = [box_env(h) for h in (1.0, 2.0, 3.0, 4.0)]
    single = spaces.Box(0, 1.0, (3,), np.float32)
    observation_mode = mode if mode == "different" else (batch_differing_spaces([f().observation_space for f in fns]), single)
    envs = shmvec.ShmVecEnv(fns, observation_mode=observation_mode, num_workers=1, start_method="fork")
    ref = SyncVectorEnv(fns, observation_mode=observation_mode)
    closing(envs), closing(ref)
    assert envs.observation_space == ref.observation_space
    assert envs.single_observation_space == ref.single_observation_space
    run_lockstep(envs, ref, steps=30)


@needs_gymnasium_1("observation_mode")
def test_observation_mode_checks(closing):
    fns = [box_env(h) for h in (1.0, 2.0)]
    with pytest.raises(RuntimeError, match="observation_mode='different'"):
        shmvec.ShmVecEnv(fns, start_method="fork")
    with pytest.raises(ValueError, match="Invalid `observation_mode`"):
        shmvec.ShmVecEnv(fns, observation_mode="invalid")
    # Spaces that "different" cannot batch: SyncVectorEnv's own errors, types and messages.
    shapes = [functools.partial(SpacesEnv, spaces.Box(0, 1, (n,), np.float32), spaces.Discrete(2)) for n in (2, 3)]
    types = [functools.partial(SpacesEnv, space, spaces.Discrete(2))
             for space in (spaces.Box(0, 1, (1,), np.float32), spaces.Discrete(3))]
    for fns in (shapes, types):
        with pytest.raises((TypeError, ValueError, AssertionError)) as expected:  # (1.0's are asserts)
            SyncVectorEnv(fns, observation_mode="different")
        with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
            shmvec.ShmVecEnv(fns, observation_mode="different", start_method="fork")


# -- any worker count for any number of envs ----------------------------------------


@pytest.mark.parametrize("num_envs, num_workers", [(1, 1), (2, 2), (3, 3), (3, 1)])
def test_one_worker_per_env_works(num_envs, num_workers, closing):
    fns = [lambda: gym.make("CartPole-v1")] * num_envs
    envs = shmvec.ShmVecEnv(fns, num_workers=num_workers, start_method="fork")
    ref = SyncVectorEnv(fns)
    closing(envs), closing(ref)
    assert envs.num_workers == num_workers
    run_lockstep(envs, ref, steps=30)


def test_worker_count_errors():
    fns = [lambda: gym.make("CartPole-v1")] * 2
    with pytest.raises(ValueError, match="num_workers=3 is more than the 2 envs"):
        shmvec.ShmVecEnv(fns, num_workers=3)
    with pytest.raises(ValueError, match="caller_steps=True needs an env for the caller"):
        shmvec.ShmVecEnv(fns, num_workers=2, caller_steps=True)


# -- SAME_STEP final_obs: the env's own objects ----------------------------------------


class PlainObjectsEnv(gym.Env):
    """Returns a Python int and a list inside its observations, as some envs do."""

    observation_space = spaces.Tuple((spaces.Discrete(5), spaces.Box(0, 9, (2,), np.int64)))
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return (0, np.zeros(2, np.int64)), {}

    def step(self, action):
        self.t += 1
        return (self.t, np.full(2, self.t, np.int64)), 1.0, self.t >= 2 + int(action), False, {}


@needs_same_step
@pytest.mark.parametrize("num_workers, caller_steps", [(1, True), (2, False)])
def test_same_step_final_obs_is_the_envs_own_object(num_workers, caller_steps, closing):
    fns = [PlainObjectsEnv] * 4
    envs, ref = sync_pair(fns, SAME_STEP, num_workers=num_workers, caller_steps=caller_steps, start_method="fork")
    closing(envs), closing(ref)
    run_lockstep(envs, ref, steps=12)
    envs.reset(seed=0)
    for _ in range(2):
        *_, infos = envs.step(np.zeros(4, np.int64))
    assert type(infos[FINAL_OBS][0][0]) is int  # not a numpy integer rebuilt from shared memory


def test_warnings_as_errors_still_close(closing):
    """close() with a pending call warns; with -W error the warning is an
    exception, and the vector env is still closed."""
    envs = fault_envs()
    envs.reset()
    envs.step_async(actions_for(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning):
            envs.close()
    assert envs._engine.closed


@pytest.mark.parametrize("cpus", [1, 2, 16])
def test_async_mode_leaves_the_caller_a_cpu_for_the_policy(monkeypatch, cpus):
    # In async mode the caller runs the policy while workers step: by
    # default one worker per usable CPU less the caller's, and the caller
    # a slice of its own that recv() steps while it would wait. With no CPU
    # left for a worker, the caller steps every env itself (in recv()).
    from shmvec._engine import plan

    monkeypatch.setattr(plan, "usable_cpus", lambda: cpus)
    assert plan.plan_slices(64, None, None, async_mode=True) == (cpus - 1, True)
    assert plan.plan_slices(64, None, None, async_mode=False) == (max(0, cpus - 1), True)
    assert plan.plan_slices(2, None, None, async_mode=True) == (min(1, cpus - 1), True)  # an env for the caller
    assert plan.plan_slices(64, None, False, async_mode=True) == (max(1, cpus - 1), False)
    assert plan.plan_slices(4, 4, None, async_mode=True) == (4, False)  # one process per env: none left


@pytest.mark.parametrize("busy", [0, 1, 14, 15, 16])
def test_default_workers_leave_out_the_cpus_other_programs_keep_busy(monkeypatch, busy):
    # Beside other programs' busy threads, a worker per usable CPU would
    # wait at every step for one of them to get a CPU back: one per idle
    # CPU instead, the caller counting as one, so none when one CPU is idle
    # (the caller steps every env). With none idle, one worker all the same
    # where its handoffs need not wait for other programs' turns: in async
    # mode, and in lock-step on the caller's CPU (`follows`), if the busy
    # threads share our scheduling group. (One env: none for a worker.)
    from shmvec._engine import plan

    monkeypatch.setattr(plan, "usable_cpus", lambda: 16)
    idle_for_workers = max(0, 15 - busy)
    all_busy = busy == 16
    assert plan.plan_slices(64, None, None, async_mode=False, busy_cpus=busy) == (idle_for_workers, True)
    assert plan.plan_slices(64, None, None, async_mode=False, busy_cpus=busy, follows=True,
                            shares_with_busy=True) == (1 if all_busy else idle_for_workers, True)
    assert plan.plan_slices(64, None, None, async_mode=True, busy_cpus=busy, shares_with_busy=True) == (
        1 if all_busy else idle_for_workers, True)
    # beside threads of another scheduling group (a job in its own session), a worker more gets no share
    assert plan.plan_slices(64, None, None, async_mode=False, busy_cpus=busy, follows=True) == (idle_for_workers, True)
    assert plan.plan_slices(64, None, None, async_mode=True, busy_cpus=busy) == (idle_for_workers, True)
    assert plan.plan_slices(64, None, False, async_mode=True, busy_cpus=busy) == (max(1, idle_for_workers), False)
    assert plan.plan_slices(64, 4, None, async_mode=False, busy_cpus=busy) == (4, True)  # an explicit count stands
    assert plan.plan_slices(1, None, None, async_mode=True, busy_cpus=busy, shares_with_busy=True) == (0, True)


@pytest.mark.parametrize("cpus, busy, async_mode, pin, follows", [
    (2, 2, False, "auto", True), (16, 16, False, "auto", True), (2, 3, False, "auto", True),
    (2, 1, False, "auto", False), (16, 15, False, "auto", False),  # a CPU idle: the caller takes it
    (2, 2, True, "auto", False),  # async mode: processes that do not wait for each other at every step
    (2, 2, False, False, False), (2, 2, False, True, False), (2, 2, False, [0, 1], False),  # the user's pinning
    (1, 1, False, "auto", False),  # one CPU: nowhere else to run
])
def test_lock_step_workers_follow_the_caller_only_where_no_cpu_is_idle(monkeypatch, cpus, busy, async_mode, pin,
                                                                       follows):
    from shmvec._engine import plan

    monkeypatch.setattr(plan, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(plan, "allowed_cpu_ids", lambda: list(range(cpus)))  # no CPU quota
    assert plan.workers_follow_caller(async_mode, pin, busy) is follows


@pytest.mark.parametrize("cpus, num_workers, caller_steps", [(2, 1, True), (2, 2, False), (2, 3, False),
                                                           (16, 2, True), (16, 15, True), (16, 16, False)])
def test_explicit_workers_leave_the_caller_a_slice_only_with_a_cpu_for_it(monkeypatch, cpus, num_workers,
                                                                          caller_steps):
    # Left unset, the caller steps a slice only if a CPU is left for it: with
    # the workers on every CPU it would be one stepping process more than the
    # CPUs, and each batch would wait for turns (CartPole x64, num_workers=2
    # on 2 CPUs: 1.43x SyncVectorEnv with the caller stepping, 1.96x without).
    from shmvec._engine import plan

    monkeypatch.setattr(plan, "usable_cpus", lambda: cpus)
    assert plan.plan_slices(64, num_workers, None, async_mode=False) == (num_workers, caller_steps)
    assert plan.plan_slices(64, num_workers, True, async_mode=False) == (num_workers, True)  # as told


def test_explicit_workers_filling_the_cpus_step_every_env(monkeypatch, closing):
    from shmvec._engine import plan

    monkeypatch.setattr(plan, "usable_cpus", lambda: 2)
    fns = [lambda: gym.make("CartPole-v1")] * 4
    envs = shmvec.ShmVecEnv(fns, num_workers=2, start_method="fork")
    closing(envs)
    assert envs._engine.worker_rows == [range(0, 2), range(2, 4)]
    envs.reset(seed=0)
    envs.step(np.zeros(4, dtype=np.int64))


def test_fewer_workers_for_busy_cpus_are_said_with_the_setting_that_restores_them(monkeypatch):
    # The busy-CPU choice lasts for the env's life and is otherwise
    # invisible: a PerformanceWarning names it, at the user's line, with
    # the num_workers that an idle machine gets.
    from shmvec._engine import engine, plan

    monkeypatch.setattr(plan, "usable_cpus", lambda: 2)
    monkeypatch.setattr(engine, "cpus_busy_elsewhere", lambda own_pids=(): 1)
    with pytest.warns(shmvec.PerformanceWarning, match=r"1 of this process's 2 CPUs kept busy .* runs 0 worker "
                      r"processes instead of 1 .* num_workers=1 to run them anyway") as caught:
        envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4)
    try:
        assert envs.num_workers == 0
        said = [w for w in caught if "kept busy" in str(w.message)]
        assert [w.filename for w in said] == [__file__]  # once, at the user's line, not shmvec's
    finally:
        envs.close()
    assert plan.busy_cpus_note(4, None, 1, True, False, busy_cpus=0) is None  # an idle machine: nothing to say


def test_explicit_workers_beyond_the_idle_cpus_are_warned_with_the_setting_that_runs_faster(monkeypatch):
    # An explicit count stands, but beside busy CPUs the processes beyond
    # the idle ones wait for each other's turns at every step: one
    # PerformanceWarning at the user's line says so and what shmvec would
    # run instead. Counts the idle CPUs hold are quiet.
    from shmvec._engine import engine, plan

    monkeypatch.setattr(plan, "usable_cpus", lambda: 2)
    monkeypatch.setattr(engine, "cpus_busy_elsewhere", lambda own_pids=(): 1)
    with pytest.warns(shmvec.PerformanceWarning, match=r"1 of this process's 2 CPUs kept busy .* num_workers=1 "
                      r"runs more processes than .* unset, shmvec runs 0 worker processes here "
                      r"\(the caller steps every env itself\)") as caught:
        envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=1)
    try:
        assert envs.num_workers == 1  # the user's count stands
        said = [w for w in caught if "kept busy" in str(w.message)]
        assert [w.filename for w in said] == [__file__]
    finally:
        envs.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=0).close()
    assert not [w for w in caught if "kept busy" in str(w.message)]
    # 4 CPUs, 1 busy: two workers and the caller fit, a third worker does not
    monkeypatch.setattr(plan, "usable_cpus", lambda: 4)
    assert plan.busy_cpus_note(64, 2, 2, True, False, busy_cpus=1) is None
    assert "(the caller counts as one: it steps a slice)" in plan.busy_cpus_note(64, 3, 3, True, False, busy_cpus=1)
    assert plan.busy_cpus_note(64, 3, 3, False, False, busy_cpus=1) is None  # a caller that steps none: they fit
    assert "num_workers=4 runs more" in plan.busy_cpus_note(64, 4, 4, False, False, busy_cpus=1)
    assert plan.busy_cpus_note(64, 3, 3, True, False, busy_cpus=0) is None  # an idle machine holds them
    # async mode: the caller runs the policy, the workers step
    assert plan.busy_cpus_note(64, 2, 2, False, True, busy_cpus=1) is None
    assert "num_workers=3 runs more processes than the CPUs left idle (the caller counts as one: it runs the " \
           "policy)" in plan.busy_cpus_note(64, 3, 3, False, True, busy_cpus=1)
    # no CPU idle, lock-step: the workers run on the caller's CPU, and the note says so
    monkeypatch.setattr(plan, "usable_cpus", lambda: 2)
    assert "num_workers=2 runs more processes than the CPUs left idle, so its workers run on the CPU the caller " \
           "runs on" in plan.busy_cpus_note(64, 2, 2, False, False, busy_cpus=2, follows=True)


def test_async_mode_refuses_action_spaces_without_fixed_shapes_when_made():
    """At construction, not at the first send() after async_reset() and recv() worked."""
    from shmvec.testing import SpacesEnv

    make = functools.partial(SpacesEnv, spaces.Box(-1, 1, (2,), np.float32),
                             spaces.Dict({"t": spaces.Text(4), "b": spaces.Discrete(2)}))
    with pytest.raises(NotImplementedError, match=r"async mode .* action leaves \[\"\['t'\]\"\]"):
        shmvec.ShmVecEnv([make] * 4, batch_size=2, num_workers=1, start_method="fork")
