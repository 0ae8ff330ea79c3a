"""A torch learner at its default threads competes with shmvec's workers
for the cores: shmvec says so once, with the setting that fixes it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import warnings
    import gymnasium as gym
    import torch
    import shmvec

    torch.set_num_threads({threads})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=1, start_method="fork").close()
    print([str(w.message) for w in caught if w.category is shmvec.PerformanceWarning])
""")


def run(threads: int, cwd) -> list[str]:
    # Away from the source tree: the installed shmvec, with its built extension.
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(threads=threads)], capture_output=True,
                         text=True, timeout=120, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


def test_warns_once_when_torch_threads_compete(tmp_path):
    pytest.importorskip("torch")
    from shmvec._system import usable_cpus

    messages = run(max(2, usable_cpus()), tmp_path)  # torch's default: one thread per core
    assert len(messages) == 1
    assert "torch.set_num_threads(1)" in messages[0]
    assert run(1, tmp_path) == []
