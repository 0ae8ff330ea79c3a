"""CleanRL's own ``ppo.py`` prints the same episodic returns on
``shmvec.ShmVecEnv`` as on the ``SyncVectorEnv`` it ships with, for the same
seed: the one-line swap works on CleanRL as it ships.

``tests/data/cleanrl/`` holds ``cleanrl/ppo.py`` and CleanRL's LICENSE (MIT)
from vwxyzjn/cleanrl at commit fe8d8a03, unchanged except for one marked
edit that makes the vector env class selectable (``CLEANRL_VECTOR_ENV``).
CleanRL pins ``gymnasium==0.29.1`` and its loop reads 0.29's
``infos["final_info"]``, so this runs under 0.29 (``.ci/gymnasium-lines-check``), with
CleanRL's own dependencies tyro and tensorboard.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from shmvec._gym_compat import GYMNASIUM_1, GYMNASIUM_VERSION

if GYMNASIUM_1:
    pytest.skip(f"CleanRL's ppo.py is written for gymnasium 0.29.1 (installed: {GYMNASIUM_VERSION})",
                allow_module_level=True)
for module in ("torch", "tyro", "tensorboard"):  # CleanRL's dependencies, not shmvec's
    pytest.importorskip(module)

PPO = pathlib.Path(__file__).resolve().parent / "data" / "cleanrl" / "ppo.py"
# A short CPU run: 3 rollouts of 4 envs x 128 steps, with 2 policy updates in between.
ARGS = ["--seed", "1", "--total-timesteps", "1536", "--num-envs", "4", "--no-cuda"]
RETURN = re.compile(r"^global_step=\d+, episodic_return=.*$", re.MULTILINE)


def episodic_returns(vector_env: str, cwd: pathlib.Path) -> list[str]:
    """Runs ppo.py in `cwd` (its tensorboard logs go there) and returns the
    lines it prints for each episode."""
    cwd.mkdir()
    result = subprocess.run(
        [sys.executable, str(PPO), *ARGS], cwd=cwd, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, CLEANRL_VECTOR_ENV=vector_env),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return RETURN.findall(result.stdout)


@pytest.mark.timeout(600)
def test_ppo_prints_the_same_returns_as_sync_vector_env(tmp_path):
    expected = episodic_returns("sync", tmp_path / "sync")
    got = episodic_returns("shmvec", tmp_path / "shmvec")
    assert len(expected) > 20  # many episodes ended, under a policy that learnt in between
    assert got == expected
