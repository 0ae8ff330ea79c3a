"""Gymnasium's vector wrappers on ``shmvec.ShmVecEnv`` give exactly what they
give on ``SyncVectorEnv``, in every autoreset mode each of them supports (and
refuse the same modes)."""

from __future__ import annotations

import functools

from helpers import skip_unless_gymnasium

skip_unless_gymnasium("Gymnasium's vector wrappers (gymnasium.wrappers.vector)", "1.0")

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv
from gymnasium.wrappers import vector as wrappers
from helpers import MODES, autoreset_kwargs, needs_autoreset_modes, run_lockstep

import shmvec
from shmvec._gym_compat import AutoresetMode
from shmvec.testing import SpacesEnv

N = 3


def env(observation_space, action_space):
    return functools.partial(SpacesEnv, observation_space, action_space, max_steps=10, terminate_prob=0.1)


BOX = env(spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-1, 1, (2,), np.float32))
DICT = env(spaces.Dict({"a": spaces.Box(-1, 1, (3,), np.float32), "b": spaces.Box(0, 1, (2, 2), np.float32)}),
           spaces.Discrete(3))
IMAGE = env(spaces.Box(0, 255, (6, 6, 3), np.uint8), spaces.Discrete(3))
INTS = env(spaces.Box(-5, 5, (3,), np.int16), spaces.Discrete(3))

# SyncVectorEnv pops "reset_mask" out of the caller's options dict, so that
# RecordEpisodeStatistics never sees a partial reset and zeroes every env's
# statistics; shmvec leaves the dict alone and the wrapper keeps the others'
# (see test_episode_statistics_survive_partial_resets).
SYNC_DIFFERS = {("RecordEpisodeStatistics", AutoresetMode.DISABLED),
                ("RecordEpisodeStatistics+NormalizeReward+ClipAction", AutoresetMode.DISABLED)}

WRAPPERS = {
    "RecordEpisodeStatistics": (BOX, wrappers.RecordEpisodeStatistics),
    "NormalizeObservation": (BOX, wrappers.NormalizeObservation),
    "NormalizeReward": (BOX, functools.partial(wrappers.NormalizeReward, gamma=0.9)),
    "ClipAction": (BOX, wrappers.ClipAction),  # its action space is unbounded: samples get clipped
    "RescaleAction": (BOX, functools.partial(wrappers.RescaleAction, min_action=np.float32(0), max_action=np.float32(2))),
    "TransformAction": (BOX, functools.partial(wrappers.TransformAction, func=lambda a: a[:, ::-1] * 0.5)),
    "TransformObservation": (BOX, functools.partial(wrappers.TransformObservation, func=lambda o: o * 2)),
    "FlattenObservation": (DICT, wrappers.FlattenObservation),
    "FilterObservation": (DICT, functools.partial(wrappers.FilterObservation, filter_keys=["b"])),
    "DtypeObservation": (INTS, functools.partial(wrappers.DtypeObservation, dtype=np.float32)),
    "RescaleObservation": (BOX, functools.partial(wrappers.RescaleObservation, min_obs=np.float32(0),
                                                  max_obs=np.float32(1))),
    "ReshapeObservation": (BOX, functools.partial(wrappers.ReshapeObservation, shape=(3, 1))),
    "GrayscaleObservation": (IMAGE, wrappers.GrayscaleObservation),
    "ClipReward": (BOX, functools.partial(wrappers.ClipReward, min_reward=-0.5, max_reward=0.5)),
    "TransformReward": (BOX, functools.partial(wrappers.TransformReward, func=lambda r: 2 * r + 1)),
    "DictInfoToList": (BOX, wrappers.DictInfoToList),
    "RecordEpisodeStatistics+NormalizeReward+ClipAction": (
        BOX, lambda e: wrappers.ClipAction(wrappers.NormalizeReward(wrappers.RecordEpisodeStatistics(e)))),
}


@pytest.fixture
def frozen_clock(monkeypatch):
    # Episode times are wall-clock; frozen, they compare exactly.
    monkeypatch.setattr(wrappers.common.time, "perf_counter", lambda: 100.0)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("name", list(WRAPPERS))
def test_wrapper_same_as_on_sync(name, mode, frozen_clock):
    if (name, mode) in SYNC_DIFFERS:
        pytest.skip("SyncVectorEnv consumes reset_mask before the wrapper sees it")
    make, wrap = WRAPPERS[name]
    fns = [make] * N
    sync = SyncVectorEnv(fns, **autoreset_kwargs(mode))
    envs = shmvec.ShmVecEnv(fns, **autoreset_kwargs(mode), num_workers=1, start_method="fork")
    try:
        try:
            ref = wrap(sync)
        except (ValueError, TypeError, AssertionError) as exc:  # a mode the wrapper does not support
            # (Gymnasium 1.1's wrappers assert it, without a message)
            with pytest.raises(type(exc), match="autoreset_mode" if str(exc) else None):
                wrap(envs)
            return
        run_lockstep(wrap(envs), ref, steps=50)
    finally:
        envs.close()
        sync.close()


def test_record_episode_statistics_counts_episodes_on_shmvec():
    envs = wrappers.RecordEpisodeStatistics(
        shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * N, num_workers=1, start_method="fork"))
    envs.reset(seed=0)
    returns = []
    for _ in range(200):
        _, _, _, _, infos = envs.step(np.zeros(N, dtype=np.int64))  # always left: short episodes
        if "episode" in infos:
            returns += infos["episode"]["r"][infos["_episode"]].tolist()
    envs.close()
    assert len(returns) == envs.episode_count >= N
    assert all(5 <= r <= 20 for r in returns)


@needs_autoreset_modes("options['reset_mask']")
def test_episode_statistics_survive_partial_resets():
    envs = wrappers.RecordEpisodeStatistics(shmvec.ShmVecEnv(
        [lambda: gym.make("CartPole-v1")] * N, autoreset_mode=AutoresetMode.DISABLED, num_workers=1,
        start_method="fork"))
    envs.reset(seed=[0, 10, 20])
    since_reset = np.zeros(N, dtype=int)
    lengths = []
    for _ in range(100):
        _, _, terminations, truncations, infos = envs.step(np.array([0, 1, 0]))  # short, unequal episodes
        since_reset += 1
        done = terminations | truncations
        if done.any():
            assert infos["episode"]["l"][done].tolist() == since_reset[done].tolist()
            assert infos["episode"]["r"][done].tolist() == since_reset[done].tolist()  # CartPole: 1 a step
            lengths += since_reset[done].tolist()
            envs.reset(options={"reset_mask": done})
            since_reset[done] = 0
    envs.close()
    assert len(set(lengths)) > 1 and len(lengths) > 2 * N
