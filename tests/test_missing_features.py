"""Before Gymnasium 1.1 (0.29 and 1.0), what a later Gymnasium added is
refused with an error that names the version it needs and the one
installed: autoreset_mode, options["reset_mask"] and shmvec.ray (1.1), and
under 0.29 observation_mode (1.0)."""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest

import shmvec
from shmvec._gym_compat import AUTORESET_MODES, GYMNASIUM_1, GYMNASIUM_VERSION

pytestmark = pytest.mark.skipif(AUTORESET_MODES, reason=f"Gymnasium {GYMNASIUM_VERSION} has every feature")

INSTALLED = re.escape(GYMNASIUM_VERSION)


def cartpoles(n):
    return [lambda: gym.make("CartPole-v1")] * n


@pytest.mark.parametrize("kwargs, feature, since", [
    ({"autoreset_mode": "NextStep"}, "autoreset_mode='NextStep'", "1.1"),
    ({"autoreset_mode": "SameStep"}, "autoreset_mode='SameStep'", "1.1"),
    ({"autoreset_mode": "Disabled"}, "autoreset_mode='Disabled'", "1.1"),
    ({"observation_mode": "different"}, "observation_mode='different'", "1.0"),
])
def test_arguments_are_refused_naming_the_version(kwargs, feature, since):
    if since == "1.0" and GYMNASIUM_1:
        pytest.skip(f"Gymnasium {GYMNASIUM_VERSION} has {feature}")
    with pytest.raises(ValueError, match=rf"^{feature} needs gymnasium>={since};.*installed gymnasium {INSTALLED}"):
        shmvec.ShmVecEnv(cartpoles(2), num_workers=0, **kwargs)


def test_reset_mask_is_refused_naming_the_version(closing):
    envs = shmvec.ShmVecEnv(cartpoles(2), num_workers=0)
    closing(envs)
    with pytest.raises(ValueError, match=rf"reset_mask.*gymnasium>=1\.1.*{INSTALLED}"):
        envs.reset(options={"reset_mask": np.array([True, False])})
    envs.reset(seed=0)  # still usable


def test_ray_front_end_is_refused_naming_the_version():
    with pytest.raises(ImportError, match=rf"shmvec\.ray.*gymnasium>=1\.1.*{INSTALLED}"):
        import shmvec.ray  # noqa: F401
