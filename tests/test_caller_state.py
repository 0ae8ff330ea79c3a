"""Workers started by forkserver (the default) or spawn see the caller as
fork's children do: its environment variables as they are when the vector
env is made, and the Gymnasium ids it registered at run time (inside the
main guard, which such workers never run), and its warning filters (a
`warnings.filterwarnings` there silences what it names in every env), so
that changing the class name from a fork-based vector env changes nothing
else."""

from __future__ import annotations

import os
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv
from helpers import run_lockstep

import shmvec

VARIABLE = "SHMVEC_TEST_CALLER_VARIABLE"


class EnvironEnv(gym.Env):
    """Records, when made, what it sees of the environment."""

    observation_space = spaces.Box(-1, 1, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self):
        self.seen = os.environ.get(VARIABLE, "<unset>")
        self.omp_threads = os.environ.get("OMP_NUM_THREADS")
        self.pid = os.getpid()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {}


@pytest.mark.parametrize("start_method", ["forkserver", pytest.param("spawn", marks=pytest.mark.heavy), "fork"])
def test_workers_see_the_callers_environment_as_it_is_when_the_env_is_made(start_method, monkeypatch, closing):
    # A vector env first, so that the fork server has started before the
    # variables change: it began with the caller's environment of then.
    closing(shmvec.ShmVecEnv([EnvironEnv] * 2, num_workers=1, caller_steps=False, start_method=start_method))
    monkeypatch.setenv(VARIABLE, "set-later")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # a worker's pools stay at one thread all the same
    envs = shmvec.ShmVecEnv([EnvironEnv] * 4, num_workers=1, caller_steps=True, start_method=start_method)
    closing(envs)
    pids = envs.get_attr("pid")
    assert pids[0] == os.getpid() != pids[-1]  # the caller's own slice and a worker's
    assert envs.get_attr("seen") == ("set-later",) * 4
    assert envs.get_attr("omp_threads") == ("4", "4", "1", "1")

    monkeypatch.delenv(VARIABLE)
    envs = shmvec.ShmVecEnv([EnvironEnv] * 2, num_workers=1, caller_steps=False, start_method=start_method)
    closing(envs)
    assert envs.get_attr("seen") == ("<unset>",) * 2


def make_run_time_cartpole():
    return gym.make("RunTimeRegistered-v0")


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_factories_find_ids_the_caller_registered_at_run_time(start_method, closing):
    gym.register(id="RunTimeRegistered-v0", entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
                 max_episode_steps=7)
    try:
        envs = shmvec.ShmVecEnv([make_run_time_cartpole] * 2, num_workers=1, caller_steps=False,
                                start_method=start_method)
        closing(envs)
        ref = SyncVectorEnv([make_run_time_cartpole] * 2)
        closing(ref)
        run_lockstep(envs, ref, steps=10)  # truncated at 7 steps, as registered
    finally:
        del gym.registry["RunTimeRegistered-v0"]


def test_an_id_registered_nowhere_is_still_gymnasiums_error(closing):
    with pytest.raises(gym.error.NameNotFound, match="NoSuchRunTimeEnv"):
        shmvec.ShmVecEnv([lambda: gym.make("NoSuchRunTimeEnv-v0")] * 2, num_workers=1, caller_steps=False,
                         start_method="forkserver")


class WarningEnv(EnvironEnv):
    def warn(self, message: str) -> str:
        """What this process's warning filters make of a UserWarning."""
        try:
            with warnings.catch_warnings(record=True) as shown:  # the filters as they are; shown ones recorded
                warnings.warn(message, UserWarning)
        except UserWarning:
            return "raised"
        return "shown" if shown else "ignored"


@pytest.mark.parametrize("start_method", ["forkserver", "spawn", "fork"])
def test_workers_take_the_callers_warning_filters_as_they_are_when_the_env_is_made(start_method, closing):
    ref = SyncVectorEnv([WarningEnv] * 4)
    closing(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("default", UserWarning)
        warnings.filterwarnings("ignore", message="silenced by the caller", category=UserWarning)
        warnings.filterwarnings("error", message="an error to the caller", category=UserWarning)
        envs = shmvec.ShmVecEnv([WarningEnv] * 4, num_workers=1, caller_steps=True, start_method=start_method)
        closing(envs)
        for message, outcome in [("silenced by the caller", "ignored"), ("an error to the caller", "raised"),
                                 ("not filtered", "shown")]:
            assert envs.call("warn", message) == ref.call("warn", message) == (outcome,) * 4, message
