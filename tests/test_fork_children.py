"""Fds and memory that must not escape into fork children: a learner's other
children (a torch DataLoader worker, os.fork, a fork-based subprocess) must
not keep shmvec's workers alive or its CPUs reserved after the learner dies,
and forked workers must not keep other engines' arenas."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from fault_envs import FaultEnv, lock_is_free, running, wait_gone, worker_pids

import shmvec

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

LEARNER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import shmvec
    from shmvec._engine.system import PARENT_ONLY_FDS
    from fault_envs import FaultEnv

    if __name__ == "__main__":
        envs = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1, caller_steps=True, pin_workers=True,
                                start_method=sys.argv[1])
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        workers = sorted(set(envs.call("pid")) - {os.getpid()})
        assert PARENT_ONLY_FDS and not any(os.get_inheritable(fd) for fd in PARENT_ONLY_FDS)
        child = os.fork()  # as a DataLoader worker or a fork-based subprocess would
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(child, *workers, flush=True)
        time.sleep(120)
""")


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_sigkilled_learner_with_a_forked_child_leaves_no_worker_nor_reservation(start_method, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=TESTS_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XDG_RUNTIME_DIR", None)
    script = tmp_path / "learner.py"
    script.write_text(LEARNER)
    proc = subprocess.Popen([sys.executable, str(script), start_method], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        line = proc.stdout.readline()
        assert line.strip(), f"the learner failed: {proc.stderr.read() if proc.poll() is not None else ''}"
        child, *workers = (int(p) for p in line.split())
        pids = [child, *workers]
        assert len(workers) == 1
        locks = [str(p) for p in (tmp / f"shmvec-cpus-{os.getuid()}").iterdir()]
        assert locks and not all(lock_is_free(p) for p in locks)
        proc.kill()
        proc.wait(timeout=10)
        left = wait_gone(workers, timeout=1.0)
        assert left == [], "shmvec's worker outlived its SIGKILLed learner by a second (its fork child kept it alive)"
        assert running(child)
        assert all(lock_is_free(p) for p in locks), "the learner's fork child keeps CPUs reserved"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.stdout.close()
        proc.stderr.close()


def arena_inodes_of(pid: int) -> tuple[set[int], set[int]]:
    """Inodes of the shmvec arenas that process `pid` maps, and of those it holds open."""
    with open(f"/proc/{pid}/maps") as f:
        mapped = {int(line.split()[4]) for line in f if "shmvec-arena" in line}
    held = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "shmvec-arena" in os.readlink(f"/proc/{pid}/fd/{name}"):
                held.add(os.stat(f"/proc/{pid}/fd/{name}").st_ino)
        except OSError:
            pass
    return mapped, held


def test_forked_workers_keep_no_other_engines_arena(closing):
    """Under start_method="fork" a worker inherits every engine of its parent:
    it must let go of their arenas (memfds and mappings), or closing them
    frees no memory while it lives."""
    first = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1, caller_steps=False, pin_workers=False,
                             start_method="fork")
    closing(first)
    first.reset()
    first_arena = os.fstat(first._engine.pool.fds[1]).st_ino
    second = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1, caller_steps=False, pin_workers=False,
                              start_method="fork")
    closing(second)
    second.reset()
    second_arena = os.fstat(second._engine.pool.fds[1]).st_ino
    for pid in worker_pids(second):
        mapped, held = arena_inodes_of(pid)
        assert first_arena not in mapped, "a worker of the second env maps the first env's arena"
        assert first_arena not in held, "a worker of the second env holds the first env's memfd"
        assert second_arena in mapped
    first.close()
    second.reset()  # the second env's workers still work


GLOBAL_RNG_SCRIPT = textwrap.dedent("""
    import gymnasium as gym
    import numpy as np
    import shmvec

    class GlobalRngEnv(gym.Env):
        # Draws from numpy's global RNG, as some envs do (sb3-contrib's InvalidActionEnvDiscrete)
        observation_space = gym.spaces.Box(0, 1, (1,), np.float64)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            return np.array([np.random.rand()]), {}

        def step(self, action):
            return np.array([np.random.rand()]), 0.0, False, False, {}

    if __name__ == "__main__":
        envs = shmvec.ShmVecEnv([GlobalRngEnv] * 3, num_workers=3, caller_steps=False, start_method="forkserver")
        print(envs.reset()[0][:, 0].tolist())
        envs.close()
        try:
            from stable_baselines3.common.vec_env import SubprocVecEnv
        except ImportError:
            print(None)
        else:  # another library's processes, from the program's one fork server
            venv = SubprocVecEnv([GlobalRngEnv] * 3, start_method="forkserver")
            print(venv.reset()[:, 0].tolist())
            venv.close()
""")


@pytest.mark.heavy
def test_forkserver_children_draw_their_own_numpy_global_random_numbers(tmp_path):
    """The fork server preloads numpy, so every process forked from it began
    with its one global RNG state: envs drawing from np.random.* drew the same
    numbers in every worker, and in other libraries' workers from the same
    fork server (SB3's SubprocVecEnv). A fresh import seeds it from the OS,
    as each child now does."""
    script = tmp_path / "global_rng.py"
    script.write_text(GLOBAL_RNG_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shm, subproc = [ast.literal_eval(line) for line in done.stdout.splitlines()[-2:]]
    assert len(set(shm)) == 3, shm
    assert subproc is None or len(set(subproc)) == 3, subproc
