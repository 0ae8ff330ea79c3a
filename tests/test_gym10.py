"""Gymnasium 1.0 (what Stable-Baselines3 2.4 pins): 1.x's contract with one
autoreset mode, next-step, and no AutoresetMode nor options["reset_mask"]
(both came in 1.1). shmvec behaves as 1.0's SyncVectorEnv and refuses what 1.1
added by name. The rest of the suite checks the common contract."""

from __future__ import annotations

import pytest

from shmvec._gym_compat import AUTORESET_MODES, GYMNASIUM_1

if not GYMNASIUM_1 or AUTORESET_MODES:
    pytest.skip("Gymnasium 1.0's vector API: these run under gymnasium==1.0.0 (.ci/gymnasium-lines-check)",
                allow_module_level=True)

import gymnasium as gym
import numpy as np
from helpers import run_lockstep, sync_pair

import shmvec


def cartpoles(n):
    return [lambda: gym.make("CartPole-v1")] * n


def test_next_step_autoreset_and_metadata_as_sync(closing):
    envs, ref = sync_pair(cartpoles(3), num_workers=1, start_method="fork")
    closing(envs), closing(ref)
    assert envs.metadata == ref.metadata and "autoreset_mode" not in envs.metadata
    run_lockstep(envs, ref, steps=100)  # episodes end: the next step resets them


@pytest.mark.parametrize("mode", ["NextStep", "SameStep", "Disabled"])
def test_autoreset_mode_is_refused_naming_the_version(mode):
    with pytest.raises(ValueError, match=rf"^autoreset_mode='{mode}' needs gymnasium>=1\.1;.*installed gymnasium 1\.0"):
        shmvec.ShmVecEnv(cartpoles(2), num_workers=0, autoreset_mode=mode)


def test_reset_mask_is_refused_naming_the_version(closing):
    envs = shmvec.ShmVecEnv(cartpoles(2), num_workers=0)
    closing(envs)
    with pytest.raises(ValueError, match=r"reset_mask.*gymnasium>=1\.1.*1\.0"):
        envs.reset(options={"reset_mask": np.array([True, False])})
    envs.reset(seed=0)  # still usable


def test_ray_front_end_is_refused_naming_the_version():
    with pytest.raises(ImportError, match=r"shmvec\.ray.*gymnasium>=1\.1.*1\.0"):
        import shmvec.ray  # noqa: F401
