"""Workers run one thread per pool: BLAS/OpenMP (numpy's) and the pools
that envs bring, such as OpenCV's (Gymnasium's AtariPreprocessing)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import shmvec


class Cv2Env(gym.Env):
    observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        import cv2  # as AtariPreprocessing does when it is made

        self.cv2 = cv2

    def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {}

    def cv2_threads(self) -> int:
        return self.cv2.getNumThreads()


def test_opencv_runs_one_thread_in_workers(closing):
    pytest.importorskip("cv2")
    envs = shmvec.ShmVecEnv([Cv2Env] * 2, num_workers=2, start_method="fork")
    closing(envs)
    assert envs.call("cv2_threads") == (1, 1)
