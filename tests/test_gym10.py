"""Gymnasium 1.0 (what Stable-Baselines3 2.4 pins): 1.x's contract with one
autoreset mode, next-step, and no AutoresetMode nor options["reset_mask"]
(both came in 1.1). shmvec behaves as 1.0's SyncVectorEnv (what 1.1 added is
refused by name: tests/test_missing_features.py). The rest of the suite
checks the common contract."""

from __future__ import annotations

import pytest

from shmvec._gym_compat import AUTORESET_MODES, GYMNASIUM_1

if not GYMNASIUM_1 or AUTORESET_MODES:
    pytest.skip("Gymnasium 1.0's vector API: these run under gymnasium==1.0.0 (.ci/gymnasium-lines-check)",
                allow_module_level=True)

import gymnasium as gym
from helpers import run_lockstep, sync_pair


def cartpoles(n):
    return [lambda: gym.make("CartPole-v1")] * n


def test_next_step_autoreset_and_metadata_as_sync(closing):
    envs, ref = sync_pair(cartpoles(3), num_workers=1, start_method="fork")
    closing(envs), closing(ref)
    assert envs.metadata == ref.metadata and "autoreset_mode" not in envs.metadata
    run_lockstep(envs, ref, steps=100)  # episodes end: the next step resets them
