"""Gymnasium 0.29.1's vector API (what CleanRL as it ships uses): shmvec
behaves as 0.29's SyncVectorEnv, with 0.29's same-step autoreset infos,
0.29's wrappers and VectorEnvWrapper (1.x-only features are refused by name:
tests/test_missing_features.py). The rest of the suite checks the common
contract under every line."""

from __future__ import annotations

import collections
import functools
import multiprocessing

import pytest

from shmvec._gym_compat import GYMNASIUM_1

if GYMNASIUM_1:
    pytest.skip("Gymnasium 0.29's vector API: these run under gymnasium==0.29.1 (.ci/gymnasium-lines-check)",
                allow_module_level=True)

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv, VectorEnv, VectorEnvWrapper
from helpers import assert_same, run_lockstep, sync_pair

import shmvec
from shmvec.testing import SpacesEnv

FORK = {"num_workers": 1, "start_method": "fork"}


def cartpoles(n=4, max_steps=12, wrap=lambda env: env):
    return [lambda: wrap(gym.make("CartPole-v1", max_episode_steps=max_steps))] * n


def test_is_a_0_29_vector_env(closing):
    envs, ref = sync_pair(cartpoles(), **FORK)
    closing(envs), closing(ref)
    assert isinstance(envs, VectorEnv) and envs.is_vector_env is True
    assert "autoreset_mode" not in envs.metadata and envs.metadata == ref.metadata
    for name in ("num_envs", "observation_space", "action_space", "single_observation_space",
                 "single_action_space"):
        assert getattr(envs, name) == getattr(ref, name), name


def test_same_step_autoreset_infos_as_0_29_builds_them(closing):
    """An ended env is reset in the same step; its reset info gets
    final_observation and final_info (one dict per env, None elsewhere),
    each with its mask; the other envs have none."""
    fns = [functools.partial(SpacesEnv, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(2),
                             max_steps=3 + i, terminate_prob=0.0) for i in range(3)]
    envs, ref = sync_pair(fns, num_workers=1, caller_steps=True, start_method="fork")
    closing(envs), closing(ref)
    envs.reset(seed=0), ref.reset(seed=0)
    for t in range(3):
        out, expected = envs.step(np.zeros(3, np.int64)), ref.step(np.zeros(3, np.int64))
        assert_same(out, expected, f"step {t}")
    infos = out[4]
    assert infos["_final_observation"].tolist() == infos["_final_info"].tolist() == [True, False, False]
    assert infos["final_info"].dtype == object and isinstance(infos["final_info"][0], dict)
    assert infos["final_info"][1] is None and infos["final_observation"][2] is None
    assert "final_obs" not in infos  # 1.x's key


def drop_wall_time(final_infos) -> None:
    """RecordEpisodeStatistics' episode time differs from run to run."""
    for info in final_infos:
        if info is not None:
            del info["episode"]["t"]


# VectorListInfo reads num_envs through Wrapper.__getattr__, which 0.29 warns about (on SyncVectorEnv too)
@pytest.mark.filterwarnings("ignore:.*to get variables from other wrappers is deprecated:UserWarning")
def test_episode_statistics_and_list_infos_wrappers(closing):
    """0.29's RecordEpisodeStatistics around each env (as CleanRL does) and
    VectorListInfo around the vector env."""
    wrap = gym.wrappers.RecordEpisodeStatistics
    envs, ref = sync_pair(cartpoles(wrap=wrap), **FORK)
    closing(envs), closing(ref)
    envs.reset(seed=1), ref.reset(seed=1)
    ended = 0
    for t in range(30):
        actions = np.array([t % 2, 1, 0, 1])
        out, expected = envs.step(actions), ref.step(actions)
        drop_wall_time(out[4]["final_info"] if "final_info" in out[4] else [])
        drop_wall_time(expected[4]["final_info"] if "final_info" in expected[4] else [])
        assert_same(out, expected, f"step {t}")
        ended += int(expected[4].get("_final_info", np.zeros(4, bool)).sum())
    assert ended >= 4
    listed, listed_ref = gym.wrappers.VectorListInfo(envs), gym.wrappers.VectorListInfo(ref)
    assert_same(listed.reset(seed=2), listed_ref.reset(seed=2))
    for t in range(15):
        out, expected = listed.step(np.ones(4, np.int64)), listed_ref.step(np.ones(4, np.int64))
        drop_wall_time([info.get("final_info") for info in out[4] + expected[4]])
        assert_same(out, expected, f"step {t}")


def test_vector_env_wrapper_resets_through_reset_wait(closing):
    """0.29's VectorEnvWrapper passes seed and options to reset_wait too."""
    envs, ref = sync_pair(cartpoles(), **FORK)
    closing(envs), closing(ref)
    wrapped, wrapped_ref = VectorEnvWrapper(envs), VectorEnvWrapper(ref)
    assert_same(wrapped.reset(seed=3), wrapped_ref.reset(seed=3))
    for t in range(20):
        assert_same(wrapped.step(np.ones(4, np.int64)), wrapped_ref.step(np.ones(4, np.int64)), f"step {t}")


def test_set_attr_sets_the_outermost_wrapper(closing):
    """As 0.29's vector envs: setattr on the outermost wrapper, so an env's
    own attribute of that name is left alone (1.x sets the env's)."""
    make = functools.partial(SpacesEnv, max_steps=5, terminate_prob=0.0)
    fns = [lambda: gym.wrappers.TimeLimit(make(), 50)] * 3
    envs, ref = sync_pair(fns, **FORK)
    closing(envs), closing(ref)
    envs.set_attr("max_steps", 2), ref.set_attr("max_steps", 2)
    assert envs.get_attr("max_steps") == ref.get_attr("max_steps") == (2, 2, 2)
    run_lockstep(envs, ref, steps=12)  # episodes still end after 5 steps


def test_dict_batches_and_actions_are_ordered_dicts(closing):
    fns = [functools.partial(SpacesEnv, spaces.Dict({"a": spaces.Discrete(3), "b": spaces.Box(0, 1, (2,))}),
                             spaces.Dict({"x": spaces.Discrete(2), "y": spaces.Box(0, 1, (1,))}))] * 2
    envs, ref = sync_pair(fns, **FORK)
    closing(envs), closing(ref)
    obs, _ = envs.reset(seed=0)
    assert type(obs) is type(ref.reset(seed=0)[0]) is collections.OrderedDict
    run_lockstep(envs, ref, steps=20)


def test_spaces_given_as_keywords_are_taken_as_0_29_takes_them(closing):
    """0.29's SyncVectorEnv(env_fns, observation_space=, action_space=)
    (AsyncVectorEnv's too): spaces equal to the envs' are taken."""
    fns = cartpoles()
    env = gym.make("CartPole-v1")
    given = {"observation_space": env.observation_space, "action_space": env.action_space}
    envs, ref = shmvec.ShmVecEnv(fns, **given, **FORK), SyncVectorEnv(fns, **given)
    closing(envs), closing(ref)
    assert envs.single_observation_space == ref.single_observation_space == env.observation_space
    assert envs.single_action_space == ref.single_action_space == env.action_space
    run_lockstep(envs, ref, steps=20)


@pytest.mark.parametrize("name, other", [("observation_space", spaces.Box(-1, 1, (4,), np.float32)),
                                         ("action_space", spaces.Discrete(3))])
def test_spaces_given_as_keywords_must_equal_the_envs(name, other):
    """A given space that differs from the envs' is 0.29's RuntimeError, with
    its message, and leaves no worker behind."""
    fns = cartpoles()
    with pytest.raises(RuntimeError) as expected:
        SyncVectorEnv(fns, **{name: other})
    before = child_pids()
    with pytest.raises(RuntimeError) as got:
        shmvec.ShmVecEnv(fns, **{name: other}, **FORK)
    assert str(got.value) == str(expected.value)
    assert child_pids() == before


def child_pids() -> set[int]:
    """A set: active_children() lists a set's members, in an order that can
    change as others come and go (a test that reaps its workers itself leaves
    multiprocessing entries it cannot poll)."""
    return {process.pid for process in multiprocessing.active_children()}


def test_sb3_front_end_works(closing):
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.vec_env import DummyVecEnv

    from shmvec.sb3 import ShmVecEnv

    fns = cartpoles(4)
    venv, dummy = ShmVecEnv(fns, **FORK), DummyVecEnv(fns)
    closing(venv), closing(dummy)
    venv.seed(0), dummy.seed(0)
    assert_same(venv.reset(), dummy.reset())
    for t in range(30):
        actions = np.array([t % 2, 1, 0, 1])
        assert_same(venv.step(actions), dummy.step(actions), f"step {t}")
