"""shmvec stepped from threads other than the main one: a background
rollout or evaluation thread, several threads with an env each. Each case
runs as a program of its own, since what is checked is how the program
exits or how a Ctrl-C reaches its main thread."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import quick_by_default

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

DAEMON_THREAD_SCRIPT = """
import sys, threading, time
import gymnasium as gym
import numpy as np
import shmvec

front, num_workers = sys.argv[1], int(sys.argv[2])
class DictObs(gym.ObservationWrapper):  # several leaves: the native stepper calls Python to flatten them
    def __init__(self, env):
        super().__init__(env)
        self.observation_space = gym.spaces.Dict(
            {"a": env.observation_space, "b": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)})
    def observation(self, obs):
        return {"a": obs, "b": obs[:2]}

def make():
    env = gym.make("CartPole-v1")
    return DictObs(env) if front == "dict" else env
fns = [make] * 4
if front in ("gym", "dict"):
    envs = shmvec.ShmVecEnv(fns, num_workers=num_workers, start_method="fork")
    envs.reset(seed=0)
    step = lambda: envs.step(np.zeros(4, dtype=np.int64))
elif front == "async":
    envs = shmvec.ShmVecEnv(fns, num_workers=num_workers, start_method="fork", batch_size=2)
    envs.async_reset(seed=0)
    def step():
        infos = envs.recv()[-1]
        envs.send(np.zeros(2, dtype=np.int64), infos["env_id"])
else:
    import shmvec.sb3
    envs = shmvec.sb3.ShmVecEnv(fns, num_workers=num_workers, start_method="fork")
    envs.reset()
    step = lambda: envs.step(np.zeros(4, dtype=np.int64))
stepped = threading.Event()

def rollout():
    while True:
        step()
        stepped.set()

threading.Thread(target=rollout, daemon=True).start()
stepped.wait(30)
time.sleep(0.3)
sys.exit(3)  # no close(): the interpreter finalizes with the thread mid-step
"""


# By default: the caller stepping alone and a worker's native wait, with the Gymnasium front end.
@pytest.mark.parametrize("num_workers, front", quick_by_default([[0, 1, 2], ["gym", "dict", "async", "sb3"]],
                                                                  (0, "gym"), (1, "gym")))
def test_exit_with_a_daemon_thread_mid_step_keeps_the_exit_status(front, num_workers, tmp_path):
    """Up to Python 3.13, CPython ends a daemon thread that takes the GIL back
    while the interpreter finalizes with pthread_exit, which unwinds the
    native frames below. A native wait's return used to be such a point,
    inside a destructor: std::terminate() aborted the whole program (SIGABRT).
    An env's Python code called by the native stepper is another: the
    unwinding freed Python objects without the GIL as the main thread's
    garbage collector ran (SIGSEGV in most runs with the caller stepping)."""
    if front == "sb3":
        pytest.importorskip("stable_baselines3")
    script = tmp_path / "daemon_thread.py"
    script.write_text(DAEMON_THREAD_SCRIPT)
    done = subprocess.run([sys.executable, str(script), front, str(num_workers)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "terminate called" not in done.stderr, done.stderr


THREADS_CTRL_C_SCRIPT = """
import os, signal, sys, threading, time
import gymnasium as gym
import numpy as np
import shmvec

class SlowEnv(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)
    def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}
    def step(self, action):
        time.sleep(0.3)
        return np.zeros(1, np.float32), 0.0, False, False, {}

def rollout(envs):
    envs.reset(seed=0)
    while True:
        envs.step(np.zeros(2, dtype=np.int64))

if __name__ == "__main__":
    for _ in range(int(sys.argv[1])):
        # two envs: the caller's own thread steps one of them, a worker the other
        envs = shmvec.ShmVecEnv([SlowEnv] * 2, num_workers=1, caller_steps=True, start_method="fork")
        threading.Thread(target=rollout, args=(envs,), daemon=True).start()
    time.sleep(1.0)  # the threads' steps now overlap
    sent = time.monotonic()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    except KeyboardInterrupt:
        print(f"KeyboardInterrupt after {time.monotonic() - sent:.2f} s", flush=True)
        os._exit(0)
    os._exit(1)
"""


@pytest.mark.parametrize("threads", [1, 3])
def test_ctrl_c_reaches_the_main_thread_while_other_threads_step_their_own_envs(threads, tmp_path):
    """Ctrl-C is held while the caller steps its own envs, so that no env's
    step is cut in two; but Python raises KeyboardInterrupt in the main
    thread only, so only the main thread's steps need holding it. Holds of
    several threads used to overlap and keep it back for good."""
    script = tmp_path / "threads_ctrl_c.py"
    script.write_text(THREADS_CTRL_C_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(threads)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "KeyboardInterrupt after" in done.stdout
    assert "finish their step first" not in done.stderr  # no hold stood in its way
