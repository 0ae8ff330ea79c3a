"""Workers run one thread per pool: BLAS/OpenMP (numpy's) and the pools
that envs bring, such as OpenCV's (Gymnasium's AtariPreprocessing)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

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


@pytest.mark.parametrize("restart", [False, True], ids=["start", "restart"])
def test_fork_after_the_caller_ran_opencv_threads_starts(restart, tmp_path):
    """A forked worker that set the thread count of an OpenCV pool its
    parent had run hung before its first command (the caller resizing
    frames itself, or an env of the caller's slice, before the vector env
    is made or a worker restarted). Workers are forked with the caller's
    pool at one thread, and the caller gets its own count back. In a fresh
    process: a hang there is a timeout, not a stuck suite."""
    pytest.importorskip("cv2")
    script = textwrap.dedent(f"""
        import os, signal
        import cv2, numpy as np
        import shmvec
        from test_worker_threads import Cv2Env

        cv2.setNumThreads(2)
        cv2.resize(np.zeros((2000, 2000, 3), np.uint8), (1200, 900))  # runs OpenCV's pool
        envs = shmvec.ShmVecEnv([Cv2Env] * 2, num_workers=1, caller_steps=False, start_method="fork",
                                restart_failed_workers=True)
        envs.reset(seed=0)
        if {restart}:
            cv2.resize(np.zeros((2000, 2000, 3), np.uint8), (1200, 900))
            os.kill(envs._engine.pool.processes[0].pid, signal.SIGKILL)
            envs.step(np.zeros(2, np.int64))  # reports the restart
        print(envs.call("cv2_threads"), cv2.getNumThreads())
        envs.close()
    """)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)  # (away from the source tree, whose shmvec has no built core)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "(1, 1) 2"


class BlasEnv(gym.Env):
    observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {}

    def pool_threads(self) -> list[int]:
        from threadpoolctl import threadpool_info

        return [pool["num_threads"] for pool in threadpool_info()]


def _openblas_threads_here() -> int:
    from threadpoolctl import threadpool_info

    return max([pool["num_threads"] for pool in threadpool_info() if pool["internal_api"] == "openblas"], default=1)


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_blas_pools_run_one_thread_in_workers(closing, start_method):
    envs = shmvec.ShmVecEnv([BlasEnv] * 2, num_workers=2, start_method=start_method)
    closing(envs)
    for pools in envs.call("pool_threads"):
        assert pools and set(pools) == {1}


def test_forkserver_workers_start_no_blas_threads(tmp_path):
    """A fork stops OpenBLAS's pool; setting its thread count in the child
    starts it again, a thread per CPU, each spinning on the worker's CPU for
    about 0.1 s. The fork server holds the pool at one thread instead, so a
    worker runs only its own two threads: its main one and the watcher of
    its parent's pipe. In a fresh process away from the source tree: the
    fork server imports its preload from the directory it was started in
    (multiprocessing does not apply the parent's sys.path there), and a
    ``shmvec`` there without its built extension fails the preload silently."""
    if _openblas_threads_here() < 2:
        pytest.skip("OpenBLAS runs one thread here: no pool to restart")
    script = textwrap.dedent("""
        import os
        import shmvec
        from test_worker_threads import BlasEnv

        if __name__ == "__main__":
            envs = shmvec.ShmVecEnv([BlasEnv] * 2, num_workers=2, start_method="forkserver")
            envs.reset(seed=0)
            print([len(os.listdir(f"/proc/{p.pid}/task")) for p in envs._engine.pool.processes])
            envs.close()
    """)
    (tmp_path / "main.py").write_text(script)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "[2, 2]"
