"""The examples run and do what they say."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from helpers import needs_gymnasium_1

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, cwd: pathlib.Path, timeout: float) -> dict:
    """Runs an example script; returns its final ``RESULT {...}`` line."""
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                         cwd=cwd, timeout=timeout, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), out.stdout[-2000:]
    return json.loads(last.removeprefix("RESULT "))


@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_gymnasium_1("examples/cleanrl_ppo.py uses gymnasium.wrappers.vector")
def test_cleanrl_ppo_learns_cartpole(tmp_path):
    pytest.importorskip("torch")
    # rl-zoo's CartPole settings for PPO, so that 100k steps are enough.
    result = run_example(
        "cleanrl_ppo.py", "--total-timesteps", "100000", "--seed", "1", "--num-envs", "8", "--num-steps", "32",
        "--learning-rate", "1e-3", "--gamma", "0.98", "--gae-lambda", "0.8", "--update-epochs", "20",
        "--num-minibatches", "1", "--ent-coef", "0.0", "--quiet",
        cwd=tmp_path, timeout=850,
    )
    assert result["global_step"] >= 99_000
    assert result["episodes"] >= 100
    assert result["mean_return"] >= 475, result
