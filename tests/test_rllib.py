"""RLlib's env runners step their envs in shmvec.ShmVecEnv (through
``shmvec.ray.register_rllib_env`` and ``gym_env_vectorize_mode=
"vector_entry_point"``), and PPO learns CartPole that way."""

from __future__ import annotations

import pytest
from helpers import skip_unless_gymnasium_1

skip_unless_gymnasium_1("shmvec.ray.register_rllib_env")
pytest.importorskip("ray.rllib", exc_type=ImportError)  # needs "ray[rllib]" and torch

from test_examples import run_example


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rllib_ppo_learns_cartpole_through_shmvec(tmp_path):
    result = run_example("rllib_ppo.py", "--iterations", "60", "--target", "400", "--num-cpus", "3",
                         cwd=tmp_path, timeout=850)
    assert result["vector_envs"] == ["ShmVecEnv"]
    assert result["mean_return"] >= 400, result
