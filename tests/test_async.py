"""EnvPool-style async stepping (batch_size < num_envs): every env's own
trajectory is what SyncVectorEnv gives it, whatever order envs come back in;
no env starves; misuse is an error, never a hang."""

from __future__ import annotations

import functools
import os
import re
import signal
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from fault_envs import HANG, OK, ColumnInfoEnv, ctrl_c, later, then_ctrl_c
from gymnasium.vector import SyncVectorEnv
from helpers import AUTORESETTING_MODES, assert_same, autoreset_kwargs, mode_id, needs_autoreset_modes, row_info

import shmvec
from shmvec import _core
from shmvec.testing import SpacesEnv, StragglerEnv


def receive_resets(envs) -> list[int]:
    """async_reset(), then receive every env's reset result."""
    envs.async_reset(seed=0)
    return [int(i) for _ in range(envs.num_envs // envs.batch_size) for i in envs.recv()[4]["env_id"]]


def sync_trajectories(make, num_envs, actions, mode):
    ref = SyncVectorEnv([make] * num_envs, **autoreset_kwargs(mode))
    obs, infos = ref.reset(seed=0)
    trajectories = [[(obs[i], 0.0, False, False, row_info(infos, i))] for i in range(num_envs)]
    for t in range(actions.shape[1]):
        obs, rew, term, trunc, infos = ref.step(actions[:, t])
        for i in range(num_envs):
            trajectories[i].append((obs[i], rew[i], term[i], trunc[i], row_info(infos, i)))
    ref.close()
    return trajectories


def async_trajectories(envs, actions, rounds):
    num_envs = envs.num_envs
    trajectories = [[] for _ in range(num_envs)]
    envs.async_reset(seed=0)
    order = []
    for _ in range(rounds):
        obs, rew, term, trunc, infos = envs.recv()
        ids = infos["env_id"]
        assert len(ids) == envs.batch_size and len(set(ids.tolist())) == len(ids)
        order.append(ids.tolist())
        sent = []
        for k, i in enumerate(ids):
            trajectories[i].append((obs[k], rew[k], term[k], trunc[k], row_info(infos, k)))
            sent.append(actions[i, len(trajectories[i]) - 1] if len(trajectories[i]) <= actions.shape[1] else 0)
        envs.send(np.array(sent), ids)
    return trajectories, order


# (num_workers, caller_steps): workers only; workers and the caller's own
# slice, which recv() steps while too few envs have finished (the default);
# the caller stepping every env itself, in recv() (the default when no CPU
# is idle for a worker).
STEPPERS = [(3, False), (2, True), (0, True)]
STEPPER_IDS = ["workers", "workers-and-caller", "caller-steps-all"]


@pytest.mark.parametrize("num_workers,caller_steps", STEPPERS, ids=STEPPER_IDS)
@pytest.mark.parametrize("mode", AUTORESETTING_MODES, ids=mode_id)
@pytest.mark.parametrize("make", [
    lambda: gym.make("CartPole-v1"),
    functools.partial(SpacesEnv, max_steps=5, terminate_prob=0.2),
], ids=["cartpole", "spaces"])
def test_each_env_trajectory_matches_sync(make, mode, num_workers, caller_steps):
    num_envs, batch, rounds = 6, 2, 150
    rng = np.random.default_rng(0)
    n_actions = 2 if isinstance(make(), gym.Wrapper) else 3
    actions = rng.integers(0, n_actions, size=(num_envs, rounds))
    envs = shmvec.ShmVecEnv([make] * num_envs, batch_size=batch, num_workers=num_workers, caller_steps=caller_steps,
                            **autoreset_kwargs(mode), start_method="fork")
    assert envs.num_workers == num_workers
    try:
        got, _ = async_trajectories(envs, actions, rounds)
    finally:
        envs.close()
    # Each env is compared over the steps it got (which envs come back first is a race).
    assert sum(len(t) for t in got) == rounds * batch
    longest = max(len(t) for t in got)
    expected = sync_trajectories(make, num_envs, actions[:, :longest], mode)
    for i in range(num_envs):
        for t in range(len(got[i])):
            assert_same(got[i][t][0], expected[i][t][0], f"env {i} step {t} obs")
            assert float(got[i][t][1]) == float(expected[i][t][1]), f"env {i} step {t} reward"
            assert bool(got[i][t][2]) == bool(expected[i][t][2]) and bool(got[i][t][3]) == bool(expected[i][t][3])
            assert_same(got[i][t][4], expected[i][t][4], f"env {i} step {t} info")


@pytest.mark.parametrize("num_workers,caller_steps", STEPPERS, ids=STEPPER_IDS)
@pytest.mark.parametrize("action_space", [
    gym.spaces.Box(-1, 1, (2, 3), np.float32),
    gym.spaces.Dict({"move": gym.spaces.Box(-1, 1, (2,), np.float64), "pick": gym.spaces.MultiDiscrete([3, 4])}),
], ids=["box", "dict"])
def test_each_env_gets_its_own_action_rows(action_space, num_workers, caller_steps, closing):
    # send() writes each env's rows of every action leaf into the arena
    # natively; a float64 batch for a float32 Box reaches the envs in the
    # space's dtype. Rewards depend on the actions (SpacesEnv).
    make = functools.partial(SpacesEnv, action_space=action_space, max_steps=6, terminate_prob=0.2)
    num_envs, batch, rounds = 5, 2, 40
    action_space.seed(0)
    actions = [[action_space.sample() for _ in range(rounds)] for _ in range(num_envs)]

    def batch_of(items):
        out = gym.vector.utils.concatenate(action_space, items, gym.vector.utils.create_empty_array(
            action_space, len(items)))
        return out.astype(np.float64) if isinstance(out, np.ndarray) else out  # a cast send() makes

    envs = shmvec.ShmVecEnv([make] * num_envs, batch_size=batch, num_workers=num_workers, caller_steps=caller_steps,
                            start_method="fork")
    closing(envs)
    got = [[] for _ in range(num_envs)]
    envs.async_reset(seed=0)
    for _ in range(rounds):
        obs, rew, term, trunc, infos = envs.recv()
        ids = infos["env_id"].tolist()
        for k, i in enumerate(ids):
            got[i].append((obs[k], rew[k], term[k], trunc[k]))
        envs.send(batch_of([actions[i][len(got[i]) - 1] for i in ids]), ids)
    assert sum(map(len, got)) == rounds * batch
    ref = SyncVectorEnv([make] * num_envs)
    obs, _ = ref.reset(seed=0)
    expected = [[(obs[i], 0.0, False, False)] for i in range(num_envs)]
    for t in range(max(map(len, got)) - 1):
        obs, rew, term, trunc, _ = ref.step(gym.vector.utils.concatenate(
            action_space, [actions[i][t] for i in range(num_envs)],
            gym.vector.utils.create_empty_array(action_space, num_envs)))
        for i in range(num_envs):
            expected[i].append((obs[i], rew[i], term[i], trunc[i]))
    ref.close()
    for i in range(num_envs):
        for t, (step, want) in enumerate(zip(got[i], expected[i])):
            assert_same(step[0], want[0], f"env {i} step {t} obs")
            assert (float(step[1]), bool(step[2]), bool(step[3])) == (float(want[1]), bool(want[2]), bool(want[3])), \
                f"env {i} step {t}"


def test_stragglers_never_starve():
    make = functools.partial(StragglerEnv, base_ms=0.2, slow_ms=5, slow_prob=0.2)
    envs = shmvec.ShmVecEnv([make] * 8, batch_size=3, num_workers=4, start_method="fork")
    try:
        envs.async_reset(seed=1)
        counts = np.zeros(8, dtype=int)
        for _ in range(120):
            obs, rew, term, trunc, infos = envs.recv()
            ids = infos["env_id"]
            assert len(ids) == 3 and len(set(ids.tolist())) == 3
            assert obs.shape == (3, 4) and rew.shape == (3,)
            counts[ids] += 1
            envs.send(np.zeros(3, dtype=np.int64), ids)
        assert counts.min() >= 10, counts  # every env keeps coming back
    finally:
        envs.close()


class CountingEnv(gym.Env):
    """Its observation counts its steps since reset; `n` is the count."""

    observation_space = gym.spaces.Box(-1e9, 1e9, (1,), np.float64)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        self.n = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.n = 0
        return np.array([0.0]), {}

    def step(self, action):
        self.n += 1
        return np.array([float(self.n)]), 1.0, False, False, {}


@pytest.mark.parametrize("num_workers, caller_steps", [(1, True), (0, True), (2, False)])
def test_calls_find_envs_in_flight_after_their_step(num_workers, caller_steps):
    """get_attr/set_attr/call while envs are in flight see and change each
    env after the step it was sent, whichever process steps it: a worker
    runs the call after the steps sent before it, and the caller now steps
    its own envs in flight first (their results wait for recv())."""
    envs = shmvec.ShmVecEnv([CountingEnv] * 4, batch_size=2, num_workers=num_workers, caller_steps=caller_steps,
                            start_method="fork")
    try:
        envs.async_reset(seed=0)
        envs.recv(), envs.recv()
        envs.send(np.ones(4, dtype=np.int64), np.arange(4))  # every env: one step in flight
        assert envs.get_attr("n") == (1, 1, 1, 1)
        envs.set_attr("n", 100)
        got = {}
        for _ in range(2):
            obs, *_, infos = envs.recv()
            got.update(zip(infos["env_id"].tolist(), obs.ravel().tolist()))
        assert got == {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}  # the steps sent before the set
        envs.send(np.ones(2, dtype=np.int64), infos["env_id"])
        obs, *_, infos = envs.recv()
        assert obs.ravel().tolist() == [101.0, 101.0]
    finally:
        envs.close()


@pytest.fixture
def async_envs():
    envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4, batch_size=2, num_workers=2,
                            start_method="fork", timeout=5)
    yield envs
    envs.close()


def test_misuse_is_an_error(async_envs):
    envs = async_envs
    with pytest.raises(RuntimeError, match="send"):
        envs.step(np.zeros(4, dtype=np.int64))
    with pytest.raises(RuntimeError, match="async_reset"):
        envs.reset()
    with pytest.raises(RuntimeError, match="in flight"):
        envs.recv()  # nothing in flight
    with pytest.raises(ValueError, match="reset_mask"):  # async_reset() resets every env
        envs.async_reset(options={"reset_mask": np.array([True, False, True, False])})
    with pytest.raises(ValueError, match="no env ids"):
        envs.send(np.zeros(0, dtype=np.int64), [])
    envs.async_reset(seed=0)
    with pytest.raises(ValueError, match="not yet received"):
        envs.send(np.zeros(1, dtype=np.int64), [0])
    _, _, _, _, infos = envs.recv()
    ids = infos["env_id"]
    with pytest.raises(ValueError, match="shape"):
        envs.send(np.zeros(3, dtype=np.int64), ids)  # count differs from ids
    # -4 and 2**64 - 1 index the 4 envs' mask without an error (a negative
    # index, and a uint64 read as -1): they must be refused all the same.
    for out_of_range in ([7], [-1], [-4], np.array([-1], dtype=np.int8), [2**62],
                         np.array([2**63], dtype=np.uint64), np.array([2**64 - 1], dtype=np.uint64)):
        with pytest.raises(ValueError, match=r"\[0, 4\)"):
            envs.send(np.zeros(1, dtype=np.int64), out_of_range)
    with pytest.raises(ValueError, match="repeated"):
        envs.send(np.zeros(2, dtype=np.int64), [ids[0], ids[0]])
    with pytest.raises(TypeError):
        envs.send(np.zeros(2, dtype=np.float64), ids)
    envs.send(np.zeros(2, dtype=np.int64), ids)
    with pytest.raises(ValueError, match="in flight"):
        envs.send(np.zeros(2, dtype=np.int64), ids)
    reset_rest = envs.recv()[4]["env_id"]  # reset results come first
    stepped = envs.recv()[4]["env_id"]
    assert sorted(reset_rest.tolist() + ids.tolist()) == [0, 1, 2, 3]
    assert sorted(stepped.tolist()) == sorted(ids.tolist())
    with pytest.raises(RuntimeError, match="in flight"):
        envs.recv()


@pytest.mark.parametrize("bad", [{"a": np.array([1, 2])}, [np.array([1, 2])]], ids=["missing-key", "not-a-dict"])
def test_actions_without_the_spaces_structure_are_refused_as_in_lock_step(bad, closing):
    make = functools.partial(SpacesEnv, action_space=spaces.Dict({"a": spaces.Discrete(3),
                                                                  "b": spaces.MultiBinary(2)}))
    lock_step = shmvec.ShmVecEnv([make] * 2, num_workers=0)
    closing(lock_step)
    lock_step.reset(seed=0)
    with pytest.raises(ValueError, match="structure of the action space") as expected:
        lock_step.step(bad)
    envs = shmvec.ShmVecEnv([make] * 4, batch_size=2, num_workers=0)
    closing(envs)
    ids = receive_resets(envs)[:2]
    with pytest.raises(ValueError, match=re.escape(str(expected.value))):
        envs.send(bad, ids)
    envs.send({"a": np.array([1, 2]), "b": np.ones((2, 2), np.int8)}, ids)  # nothing was sent: the envs still take it


def test_the_callers_own_envs_keep_stepping_when_the_workers_keep_ahead(closing):
    # recv() steps the caller's own envs while too few envs have finished,
    # and at least one each call: with the worker's envs always finished
    # first, the caller's would otherwise never step again.
    envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 6, batch_size=3, num_workers=1, caller_steps=True,
                            start_method="fork")
    closing(envs)
    own = envs._engine._caller.rows
    assert own == range(0, 3)
    received = np.zeros(6, dtype=int)
    envs.async_reset(seed=0)
    for _ in range(40):
        ids = envs.recv()[4]["env_id"]
        received[ids] += 1
        envs.send(np.zeros(len(ids), dtype=np.int64), ids)
        deadline = time.monotonic() + 5
        while envs._engine.pool.channel.async_progress()[0][1] and time.monotonic() < deadline:
            time.sleep(0.001)  # the worker finishes everything it was sent before the next recv()
    assert received[own.start:own.stop].min() >= 5, received


@needs_autoreset_modes("autoreset_mode DISABLED")
def test_disabled_autoreset_is_refused():
    with pytest.raises(ValueError, match="DISABLED"):
        shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4, batch_size=2, autoreset_mode="Disabled")


def test_construction_errors():
    fns = [lambda: gym.make("CartPole-v1")] * 4
    with pytest.raises(ValueError, match="batch_size"):
        shmvec.ShmVecEnv(fns, batch_size=0)
    with pytest.raises(ValueError, match="batch_size"):
        shmvec.ShmVecEnv(fns, batch_size=5)
    with pytest.raises(ValueError, match="needs an env for the caller besides one per worker"):
        shmvec.ShmVecEnv(fns, batch_size=2, num_workers=4, caller_steps=True)
    with pytest.raises(ValueError, match="num_workers=0 needs caller_steps=True"):
        shmvec.ShmVecEnv(fns, batch_size=2, num_workers=0, caller_steps=False)


def test_worker_death_while_in_flight():
    envs = shmvec.ShmVecEnv([functools.partial(StragglerEnv, base_ms=200, slow_prob=0)] * 4,
                            batch_size=2, num_workers=2, start_method="fork")
    try:
        envs.async_reset()
        ids = envs.recv()[4]["env_id"]
        envs.send(np.zeros(2, dtype=np.int64), ids)
        envs.recv()
        for p in envs._engine.pool.processes:
            os.kill(p.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(shmvec.WorkerDiedError):
            envs.recv()
        assert time.monotonic() - start < 5
    finally:
        envs.close()


def test_timeout_while_in_flight():
    envs = shmvec.ShmVecEnv([functools.partial(StragglerEnv, base_ms=0.1, slow_ms=30_000, slow_prob=1.0)] * 2,
                            batch_size=1, num_workers=1, caller_steps=False, start_method="fork", timeout=0.5)
    try:
        receive_resets(envs)
        envs.send(np.zeros(1, dtype=np.int64), [0])
        with pytest.raises(TimeoutError):
            envs.recv()
    finally:
        start = time.monotonic()
        envs.close(terminate=True)
        assert time.monotonic() - start < 10


# (num_workers, caller_steps, the env that fails): env 1 in a worker, env 0
# in the caller's own slice (its first), env 1 with the caller stepping all.
@pytest.mark.parametrize("num_workers,caller_steps,row", [(1, False, 1), (1, True, 0), (0, True, 1)],
                         ids=["worker", "caller-slice", "caller-steps-all"])
def test_env_error_in_async_step_reaches_caller(num_workers, caller_steps, row):
    class Boom(SpacesEnv):
        def step(self, action):
            raise KeyError("boom")

    envs = shmvec.ShmVecEnv([Boom] * 2, batch_size=1, num_workers=num_workers, caller_steps=caller_steps,
                            start_method="fork")
    try:
        receive_resets(envs)
        envs.send(np.zeros(1, dtype=np.int64), [row])
        with pytest.raises(KeyError, match="boom") as info:
            envs.recv()
        assert "Traceback" in str(info.value.__cause__)  # stepped as a worker steps it: with its traceback
        with pytest.raises(RuntimeError, match="reset"):
            envs.send(np.zeros(1, dtype=np.int64), [0])
        for _ in range(2):  # the env's error once, then what to do, as send() and lock-step say it
            with pytest.raises(RuntimeError, match=r"an env raised during the last call.*async_reset\(\)"):
                envs.recv()
        envs.async_reset()  # usable again
        assert len(envs.recv()[4]["env_id"]) == 1
    finally:
        envs.close()


@pytest.mark.parametrize("caller_steps,row", [(False, 1), (True, 0)], ids=["worker", "caller-slice"])
def test_large_infos_arrive_whole(caller_steps, row):
    # Too large for the env's record slot: kept by its stepper until recv() fetches it.
    class BigInfo(SpacesEnv):
        def __init__(self):
            super().__init__(terminate_prob=0.0)  # the step's own info, not an ended episode's final_info

        def step(self, action):
            obs, r, te, tr, _ = super().step(action)
            return obs, r, te, tr, {"blob": np.arange(50_000, dtype=np.int64)}  # 400 kB

    envs = shmvec.ShmVecEnv([BigInfo] * 2, batch_size=1, num_workers=1, caller_steps=caller_steps,
                            start_method="fork")
    try:
        receive_resets(envs)
        envs.send(np.zeros(1, dtype=np.int64), [row])
        infos = envs.recv()[4]
        np.testing.assert_array_equal(infos["blob"][0], np.arange(50_000))
    finally:
        envs.close()


def test_ctrl_c_as_recv_fetches_a_large_record_loses_nothing():
    """A Ctrl-C as recv() has fetched a record too large for its slot from
    the worker: the next recv() hands out the same batch, that record
    included. The worker forgot a record once fetched: KeyError."""
    envs = shmvec.ShmVecEnv([functools.partial(ColumnInfoEnv, blob=20_000)] * 4, batch_size=2, num_workers=1,
                            caller_steps=False, start_method="fork")
    try:
        receive_resets(envs)
        envs.send(np.zeros(4, dtype=np.int64), [0, 1, 2, 3])
        steps = envs._engine.async_steps
        steps._fetch_record = then_ctrl_c(steps._fetch_record)
        with pytest.raises(KeyboardInterrupt):
            envs.recv()
        del steps._fetch_record
        received = []
        for _ in range(2):
            infos = envs.recv()[4]
            received += infos["env_id"].tolist()
            assert list(infos["blob"]) == ["x" * 20_000] * 2 and infos["t"].tolist() == [1, 1]
        assert sorted(received) == [0, 1, 2, 3]
    finally:
        envs.close()


def test_ctrl_c_while_recv_waits_for_a_large_record_loses_nothing():
    """The worker answers a fetch of a record too large for its slot between
    two steps, here after a slow one (1 s). A Ctrl-C during that wait: the
    next recv() waits the fetch out and hands out the batch, record
    included. It posted a second fetch beside the first: RuntimeError
    "post() while workers are still busy with a command", at every recv()."""
    make = functools.partial(ColumnInfoEnv, blob=20_000, hang_s=1.0)
    envs = shmvec.ShmVecEnv([make] * 3, batch_size=1, num_workers=1, caller_steps=False, start_method="fork")
    try:
        receive_resets(envs)
        envs.send(np.array([OK, HANG]), [0, 1])
        while not envs._engine.async_steps.wait_finished(1, 5.0):
            pass
        with later((0.3, ctrl_c)), pytest.raises(KeyboardInterrupt):
            envs.recv()  # env 0's record: fetched once the worker is done with env 1's step
        received = {}
        for _ in range(2):
            infos = envs.recv()[4]
            received[int(infos["env_id"][0])] = infos["blob"][0]
        assert received == {0: "x" * 20_000, 1: "x" * 20_000}
    finally:
        envs.close()


class EnvIdInfoEnv(SpacesEnv):
    """Returns an info of its own under "env_id", the key that recv() gives
    the batch's env ids: a number (stored in info columns) or a string (not)."""

    def __init__(self, value=7):
        super().__init__(terminate_prob=0.0, infos=False)
        self.value = value

    def reset(self, *, seed=None, options=None):
        obs, _ = super().reset(seed=seed, options=options)
        return obs, {}

    def step(self, action):
        obs, r, te, tr, _ = super().step(action)
        return obs, r, te, tr, {"env_id": self.value}


@pytest.mark.parametrize("value", [7, "mine", "x" * 20_000], ids=["column", "record", "large-record"])
@pytest.mark.parametrize("caller_steps,row", [(False, 1), (True, 0)], ids=["worker", "caller-slice"])
def test_an_envs_own_env_id_info_is_an_error_not_overwritten(value, caller_steps, row):
    # large-record: too large for its slot, the record is fetched from its
    # stepper, and fetched again by the second recv() (it was handed over
    # once and forgotten: KeyError)
    envs = shmvec.ShmVecEnv([functools.partial(EnvIdInfoEnv, value)] * 2, batch_size=1, num_workers=1,
                            caller_steps=caller_steps, start_method="fork")
    try:
        receive_resets(envs)
        envs.send(np.zeros(1, dtype=np.int64), [row])
        for _ in range(2):  # the batch is kept, not lost: the same error again
            with pytest.raises(ValueError, match=r"infos have the key 'env_id'.*rename"):
                envs.recv()
    finally:
        envs.close()
    lock_step = shmvec.ShmVecEnv([functools.partial(EnvIdInfoEnv, value)] * 2, num_workers=1,
                                 caller_steps=caller_steps, start_method="fork")
    try:  # lock-step hands the env's own key through, as SyncVectorEnv does
        lock_step.reset(seed=0)
        infos = lock_step.step(np.zeros(2, dtype=np.int64))[4]
        assert list(infos["env_id"]) == [value, value] and infos["_env_id"].all()
    finally:
        lock_step.close()


def _sleeps() -> int:
    """Times this process has slept (voluntary context switches)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))


def test_recv_is_woken_once_not_once_per_finished_env():
    # A worker wakes a recv() that sleeps when enough envs have finished, not
    # at each finished env: before the wake mark, each of the 32 envs of a
    # batch woke the front end (about 11 sleeps per recv measured on 2 CPUs).
    envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 64, batch_size=32, num_workers=1, caller_steps=False)
    try:
        envs.async_reset(seed=0)
        actions = np.zeros(32, dtype=np.int64)
        recvs = 300
        before = _sleeps()
        for _ in range(recvs):
            envs.send(actions, envs.recv()[4]["env_id"])
        assert (_sleeps() - before) / recvs < 3
    finally:
        envs.close()


def test_each_mode_refuses_the_other_modes_calls_with_a_clear_error(closing):
    # send() on a lock-step env once failed deep in the engine ("async mode is
    # not attached", later an AttributeError), after writing the actions.
    lockstep = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=1)
    closing(lockstep)
    lockstep.reset(seed=0)
    for call in (lambda: lockstep.async_reset(), lambda: lockstep.recv(),
                 lambda: lockstep.send(np.zeros(2, dtype=np.int64), np.array([0, 1]))):
        with pytest.raises(RuntimeError, match=r"is for async mode: create the ShmVecEnv with batch_size < num_envs"):
            call()
    lockstep.step(np.zeros(4, dtype=np.int64))  # still steps

    async_envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=1, batch_size=2)
    closing(async_envs)
    for call, instead in ((lambda: async_envs.reset(), "async_reset"),
                          (lambda: async_envs.step(np.zeros(4, dtype=np.int64)), "send/recv"),
                          (lambda: async_envs.reset_wait(), "async_reset"),
                          (lambda: async_envs.step_wait(), "send/recv")):
        with pytest.raises(RuntimeError, match=f"is for synchronous stepping.*use {instead}"):
            call()


def test_row_queue_keeps_finished_rows_in_order():
    # recv() pops finished envs into a RowQueue; the front end reads and
    # drops them from its head once they are handed out.
    queue = _core.RowQueue()
    assert len(queue) == 0 and queue.head(0).dtype == np.int64
    queue.extend(np.array([5, 2], dtype=np.int64))
    queue.extend([7])
    assert len(queue) == 3 and queue.head(2).tolist() == [5, 2] and queue.head(3).tolist() == [5, 2, 7]
    with pytest.raises(IndexError, match="fewer rows"):
        queue.head(4)
    with pytest.raises(ValueError, match="1-D"):
        queue.extend(np.zeros((1, 1), np.int64))
    queue.drop(2)
    assert queue.head(len(queue)).tolist() == [7]
    queue.clear()
    assert len(queue) == 0


def test_the_callers_stepper_checks_each_env_row(closing):
    # Async mode without workers: recv() steps every env in the caller, row
    # by row from its ring, as a worker does; a row not in the slice is an error.
    envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4, batch_size=2, num_workers=0)
    closing(envs)
    envs.async_reset(seed=0)
    stepper = envs._engine._caller.stepper
    for bad in (4, -1):
        with pytest.raises(IndexError, match="row not in this slice"):
            stepper.step_row(bad)


def test_the_async_channel_takes_env_rows_as_an_array_and_checks_each(closing):
    # send() hands the channel its int64 env ids as they are (no Python int
    # per env), and recv() its finished rows: every row is still checked.
    envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4, batch_size=2, num_workers=1)
    closing(envs)
    channel = envs._engine.pool.channel
    for bad, error in [(np.array([4]), IndexError), (np.array([-1]), IndexError),
                       (np.array([2**32]), IndexError), (np.zeros((1, 1), np.int64), ValueError)]:
        for call in (channel.send, channel.rows_with_records):
            with pytest.raises(error, match="env rows must be 1-D|env row out of range"):
                call(bad)
    assert channel.sent_count == 0
    assert channel.rows_with_records(np.arange(4)) == [] and channel.rows_with_records([0, 1]) == []
    # send()'s one native call: a problem with the ids is returned with
    # nothing written or sent; a batch or mask the front end never makes is
    # refused before anything changes.
    views, mask = envs._io.action_views, np.zeros(4, np.bool_)
    before = views[0].copy()
    for ids, problem in [([4], 1), ([1, 1], 2)]:
        assert channel.send_actions(np.array(ids), mask, views, [np.ones(len(ids), np.int64)]) == problem
    for bad_mask, values, match in [(np.zeros(4, np.int8), [np.ones(1, np.int64)], "mask"),
                                    (mask, [np.ones(1, np.float64)], "does not match"),
                                    (mask, [np.ones((1, 1), np.int64)], "does not match"),
                                    (mask, [], "one batch of values per view")]:
        with pytest.raises(ValueError, match=match):
            channel.send_actions(np.array([1]), bad_mask, views, values)
    assert channel.sent_count == 0 and not mask.any() and np.array_equal(views[0], before)
    receive_resets(envs)
    envs.send(np.zeros(4, dtype=np.int64), np.arange(4))
    for _ in range(10):  # the envs flow as before
        envs.send(np.zeros(2, dtype=np.int64), envs.recv()[4]["env_id"])
    assert channel.sent_count == 4 + 10 * 2
