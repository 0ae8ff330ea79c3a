"""Step infos that travel as columns in shared memory (shmvec._engine.info_columns):
exactly what SyncVectorEnv's env-by-env vectorization gives (keys, order,
masks, dtypes), whichever envs have infos, whatever value types they use,
and whichever infos fall back to the record path."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv
from helpers import AUTORESETTING_MODES, MODES, assert_same, autoreset_kwargs, mode_id, run_lockstep, sync_pair

import shmvec
from shmvec import _core
from shmvec._engine.info_columns import INFO_STORAGE, InfoColumns
from shmvec._gym_compat import VectorEnv

LAYOUTS = [(1, True), (2, False), (0, True)]


def _value_for(kind: type, t: int, i: int):
    """A value for an info of type `kind` at step t of env i: it changes
    from step to step, and a float one has a sign and a fraction."""
    if kind is bool:
        return t % 2 == 0
    if kind in (float, np.float64, np.float32, np.float16):
        return (-1) ** t * (t + i) * 1.5
    return (t + i) % 100


class InfoEnv(gym.Env):
    """Infos of one schema most steps (the common case), with variations:
    `pattern` picks which envs sometimes return none, another schema, or
    values that cannot be columns."""

    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, index: int, pattern: str = "same", max_steps: int = 7):
        self.index, self.pattern, self.max_steps = index, pattern, max_steps

    def _info(self) -> dict:
        t, i = self.t, self.index
        info = {"x_position": float(t * 0.5 + i), "lives": 3 - t % 3, "alive": t % 2 == 0,
                "reward_ctrl": np.float32(-0.25 * t), "frame": np.int32(4 * t)}
        if self.pattern in ("sometimes_empty", "every_type") and (t + i) % 3 == 0:
            return {}
        if self.pattern == "every_type":  # each value type the columns take, cast as _add_info casts it
            return {kind.__name__: kind(_value_for(kind, t, i)) for kind in INFO_STORAGE}
        if self.pattern == "other_schema" and i % 2:
            return {"lives": t, "x_position": float(t)}  # other keys, other order
        if self.pattern == "odd_values" and t % 4 == 1:
            info = dict(info, frame=np.bool_(True), name=f"t{t}", nested={"a": t})
        if self.pattern == "big_ints" and t % 3 == 2:
            info = dict(info, lives=np.uint64(2**40 + t))  # a type the columns do not take
        return info

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), self._info()

    def step(self, action):
        self.t += 1
        obs = np.full(2, self.t / 10, np.float32)
        return obs, 1.0, self.t >= self.max_steps - self.index % 3, False, self._info()


def pair(pattern, mode, num_workers, caller_steps, num_envs=5):
    fns = [functools.partial(InfoEnv, i, pattern) for i in range(num_envs)]
    return sync_pair(fns, mode, num_workers=num_workers, caller_steps=caller_steps, start_method="fork")


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("pattern", ["same", "sometimes_empty", "every_type", "other_schema", "odd_values",
                                     "big_ints"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["caller+1worker", "2workers", "caller-only"])
def test_infos_match_sync(pattern, mode, layout, closing):
    envs, ref = pair(pattern, mode, *layout)
    closing(envs), closing(ref)
    run_lockstep(envs, ref, steps=25)


def test_common_case_takes_the_columns(closing):
    """The point of it: infos of one schema come from the columns, not
    from pickled records vectorized env by env."""
    envs, ref = pair("same", None, 1, True)
    closing(envs), closing(ref)
    envs.reset(seed=0), ref.reset(seed=0)
    *_, infos = envs.step(np.zeros(5, np.int64))
    assert_same(infos, ref.step(np.zeros(5, np.int64))[-1])
    columns = envs._engine.info_columns
    assert columns.rows().tolist() == [0, 1, 2, 3, 4]
    assert list(infos) == ["x_position", "_x_position", "lives", "_lives", "alive", "_alive",
                           "reward_ctrl", "_reward_ctrl", "frame", "_frame"]
    assert infos["reward_ctrl"].dtype == np.float32 and infos["frame"].dtype == np.int32
    infos["_lives"][0] = False  # each mask is its own array, as _add_info makes them
    assert infos["_alive"][0]


def test_mujoco_infos_match_sync(closing):
    pytest.importorskip("mujoco")
    make = functools.partial(gym.make, "HalfCheetah-v5", max_episode_steps=30)
    for mode in AUTORESETTING_MODES:
        envs, ref = sync_pair([make] * 4, mode, num_workers=1, start_method="fork")
        closing(envs), closing(ref)
        run_lockstep(envs, ref, steps=70)
        assert envs._engine.info_columns.rows().size == 4


def test_sb3_infos_from_columns_match_dummy_vec_env():
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.vec_env import DummyVecEnv

    from shmvec.sb3 import ShmVecEnv

    for pattern in ("same", "odd_values", "sometimes_empty"):
        fns = [functools.partial(InfoEnv, i, pattern) for i in range(4)]
        shm, dummy = ShmVecEnv(fns, num_workers=1, start_method="fork"), DummyVecEnv(fns)
        try:
            shm.seed(0), dummy.seed(0)
            assert_same(shm.reset(), dummy.reset())
            assert_same(shm.reset_infos, dummy.reset_infos)
            for t in range(20):
                actions = np.full(4, t % 2)
                got, want = shm.step(actions), dummy.step(actions)
                assert_same(got, want, f"{pattern} step {t}")
                assert_same(shm.reset_infos, dummy.reset_infos, f"{pattern} reset infos {t}")
        finally:
            shm.close(), dummy.close()


class _RecordingSync(SyncVectorEnv):
    """SyncVectorEnv that keeps the infos it batched in its last step or
    reset, as it passed them to _add_info (the env's own, and its final
    observation and info where an episode ended)."""

    def reset(self, **kwargs):
        self.added = []
        return super().reset(**kwargs)

    def step(self, actions):
        self.added = []
        return super().step(actions)

    def _add_info(self, infos, info, env_num):
        if self._depth == 0:  # not _add_info's own calls for nested dicts
            self.added.append(info)
        self._depth += 1
        try:
            return super()._add_info(infos, info, env_num)
        finally:
            self._depth -= 1

    _depth = 0


class _Batch(VectorEnv):
    """Gymnasium's own _add_info over a batch of `num_envs` positions."""

    def __init__(self, num_envs: int):
        self.num_envs = num_envs


@pytest.mark.parametrize("num_workers", [2, 0], ids=["workers", "caller-steps-all"])
@pytest.mark.parametrize("mode", AUTORESETTING_MODES, ids=mode_id)
@pytest.mark.parametrize("pattern", ["same", "sometimes_empty", "every_type", "other_schema", "odd_values",
                                     "big_ints"])
def test_async_batch_infos_match_add_info(pattern, mode, num_workers, closing):
    """Each recv() batch's infos are what Gymnasium's _add_info builds from
    its envs' own infos in batch order (keys, order, masks, dtypes), whether
    they came in columns, in records, or both."""
    fns = [functools.partial(InfoEnv, i, pattern) for i in range(5)]
    check_async_batches(fns, mode, num_workers, 2, 60, closing)


def test_async_mujoco_infos_match_add_info(closing):
    pytest.importorskip("mujoco")
    make = functools.partial(gym.make, "HalfCheetah-v5", max_episode_steps=30)
    for mode in AUTORESETTING_MODES:
        check_async_batches([make] * 6, mode, 2, 3, 90, closing)


def check_async_batches(fns, mode, num_workers, batch_size, rounds, closing):
    """Sends random actions to the envs of `fns` in async mode for `rounds`
    batches, and checks each batch against SyncVectorEnvs of one env each,
    given the same actions: the observations, rewards and flags, and the
    infos that _add_info builds over the batch from the infos each of those
    passed to it."""
    num_envs = len(fns)
    envs = shmvec.ShmVecEnv(fns, batch_size=batch_size, num_workers=num_workers, start_method="fork",
                            **autoreset_kwargs(mode))
    refs = [_RecordingSync([fn], **autoreset_kwargs(mode)) for fn in fns]
    for vector_env in (envs, *refs):
        closing(vector_env)
    expected = [None] * num_envs  # per env: (obs, reward, terminated, truncated, the infos _add_info got)
    envs.async_reset(seed=0)
    for i, ref in enumerate(refs):
        obs, _ = ref.reset(seed=i)
        expected[i] = (obs[0], 0.0, False, False, ref.added)
    space = envs.single_action_space
    space.seed(0)
    for t in range(rounds):
        obs, rewards, terminations, truncations, infos = envs.recv()
        ids = infos.pop("env_id")
        infos_of_batch = {}
        batch = _Batch(batch_size)
        for k, i in enumerate(ids.tolist()):
            want_obs, want_reward, want_term, want_trunc, info = expected[i]
            assert_same(obs[k], want_obs, f"round {t} env {i} obs")
            assert (rewards[k], terminations[k], truncations[k]) == (want_reward, want_term, want_trunc)
            for part in info:
                infos_of_batch = batch._add_info(infos_of_batch, part, k)
        assert_same(infos, infos_of_batch, f"round {t} infos of envs {ids.tolist()}")
        actions = np.stack([space.sample() for _ in ids])
        for k, i in enumerate(ids.tolist()):
            obs_i, reward, terminated, truncated, _ = refs[i].step(actions[k:k + 1])
            expected[i] = (obs_i[0], float(reward[0]), bool(terminated[0]), bool(truncated[0]), refs[i].added)
        envs.send(actions, ids)


def test_async_common_case_takes_the_columns(closing, monkeypatch):
    """In async mode too, once every worker has shown its schema, a batch
    whose infos are all in columns is built in recv()'s one native call:
    never env by env, nor through InfoColumns.batch in Python."""
    import shmvec.send_recv

    python_paths = []
    vectorize_batch, batch = shmvec.send_recv.vectorize_batch, InfoColumns.batch
    monkeypatch.setattr(shmvec.send_recv, "vectorize_batch",
                        lambda *args: python_paths.append("vectorize_batch") or vectorize_batch(*args))
    monkeypatch.setattr(InfoColumns, "batch", lambda *args: python_paths.append("batch") or batch(*args))
    fns = [functools.partial(InfoEnv, i, "same", max_steps=1000) for i in range(4)]
    envs = shmvec.ShmVecEnv(fns, batch_size=2, num_workers=2, start_method="fork")
    closing(envs)
    envs.async_reset(seed=0)

    def round_trip():
        obs, *_, infos = envs.recv()
        envs.send(np.zeros(2, np.int64), infos["env_id"])
        return obs, infos

    # Until both workers' schemas are fetched: each is fetched with the first
    # batch that holds a step of that worker's envs, which takes as many
    # rounds as the other worker keeps finishing first (on two busy CPUs,
    # more than ten).
    for _ in range(1000):
        if envs._engine.info_columns.columns is not None:
            break
        round_trip()
    assert envs._engine.info_columns.columns is not None
    python_paths.clear()
    for _ in range(20):
        obs, infos = round_trip()
    ids = infos["env_id"]
    assert python_paths == []
    assert list(infos) == ["x_position", "_x_position", "lives", "_lives", "alive", "_alive",
                           "reward_ctrl", "_reward_ctrl", "frame", "_frame", "env_id"]
    steps = np.rint(obs[:, 0] * 10)  # each env's step count (InfoEnv's observation)
    assert infos["x_position"].tolist() == (steps * 0.5 + ids).tolist()
    assert infos["frame"].dtype == np.int32 and infos["_frame"].all()


@pytest.mark.parametrize("flags", [np.zeros((2, 2), np.uint8), np.zeros(4, np.int64), np.zeros(8, np.uint8)[::2]],
                         ids=["2d", "int64", "strided"])
def test_info_batch_refuses_flags_of_the_wrong_kind(flags):
    """The native reader checks the flags before reading a byte of them."""
    with pytest.raises(ValueError, match="info flags must be a"):
        _core.info_batch(flags, [], None)
    assert _core.info_batch(np.zeros(4, np.uint8), [], None) == {}


def test_info_batch_refuses_rows_that_are_not_one_env_id_each():
    flags = np.zeros(4, np.uint8)
    with pytest.raises(ValueError, match="info rows must be a 1-d int array"):
        _core.info_batch(flags, [], np.zeros((1, 1), np.int64))
    with pytest.raises(IndexError, match="info row out of range"):
        _core.info_batch(flags, [], np.array([4]))
    assert _core.info_batch(flags, [], np.array([3, 0])) == {}
