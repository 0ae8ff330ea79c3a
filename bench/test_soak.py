"""Soak: full speed for SHMVEC_SOAK_SECONDS (default 600) with episodes
ending, infos flowing, call/get_attr interleaved, and a worker SIGKILLed
every SHMVEC_SOAK_KILL_EVERY seconds (default 60) under
restart_failed_workers=True, in lock-step (sync) and in async mode
(batch_size 16 of 32 envs). Reports steps/s over time, memory (PSS), open
fds and processes at start and end, and asserts none of them grows.

    pytest bench/test_soak.py -s                          # 10 minutes each mode
    pytest bench/test_soak.py -s -k async                 # async mode only
    SHMVEC_SOAK_SECONDS=60 SHMVEC_SOAK_KILL_EVERY=10 pytest bench/test_soak.py -s
"""

import functools
import os
import signal
import time

import numpy as np
import pytest

from shmvec import ShmVecEnv, ShmVecError
from shmvec.bench.measure import tree_memory
from shmvec.testing import SpacesEnv

SECONDS = float(os.environ.get("SHMVEC_SOAK_SECONDS", 600))
KILL_EVERY = float(os.environ.get("SHMVEC_SOAK_KILL_EVERY", 60))


def resources() -> dict:
    memory = tree_memory()  # this process and all it started
    return {"pss_mib": round(memory["pss_mib"], 1), "processes": memory["processes"],
            "fds": len(os.listdir("/proc/self/fd"))}


class Lockstep:
    """step() for all 32 envs at a time."""

    def __init__(self, envs):
        self.envs = envs
        envs.reset(seed=0)

    def step(self, actions):
        return self.envs.step(actions)[4], self.envs.num_envs


class Async:
    """recv() 16 envs, send() them their next actions."""

    def __init__(self, envs):
        self.envs = envs
        envs.async_reset(seed=0)

    def step(self, actions):
        infos = self.envs.recv()[4]
        ids = infos["env_id"]
        self.envs.send(actions[:len(ids)], ids)
        return infos, len(ids)


@pytest.mark.timeout(SECONDS + 300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_soak(mode):
    make = functools.partial(SpacesEnv, max_steps=50, terminate_prob=0.02)  # infos on about half the steps
    envs = ShmVecEnv([make] * 32, restart_failed_workers=True, max_restarts=1000, timeout=30,
                     batch_size=16 if mode == "async" else None)
    try:
        loop = Lockstep(envs) if mode == "sync" else Async(envs)
        envs.action_space.seed(0)
        actions = [envs.action_space.sample() for _ in range(64)]
        for k in range(200):  # warm up before the first reading
            loop.step(actions[k % 64])
        before = resources()
        start = last_kill = last_report = time.monotonic()
        steps = window_steps = restarts = total = 0
        rates = []
        while time.monotonic() - start < SECONDS:
            infos, count = loop.step(actions[steps % 64])
            restarts += int(infos.get("_shmvec_restarted", np.zeros(1, bool)).sum())
            steps += 1
            total += count
            window_steps += count
            if steps % 500 == 0:
                try:
                    envs.get_attr("t")
                    envs.call("_info", 1)
                except ShmVecError:  # a worker was killed during the call: call again later
                    pass
            now = time.monotonic()
            if now - last_kill >= KILL_EVERY and envs.num_workers:
                os.kill(envs._engine.pool.processes[steps % envs.num_workers].pid, signal.SIGKILL)
                last_kill = now
            if now - last_report >= 10:
                rates.append(window_steps / (now - last_report))
                print(f"  t={now - start:5.0f} s  {rates[-1]:,.0f} steps/s  restarted envs so far: {restarts}")
                window_steps, last_report = 0, now
        after = resources()
        print(f"soak ({mode}): {SECONDS:.0f} s, {total:,} env steps, {envs._engine.restarts} worker restarts, "
              f"{restarts} restart reports")
        print(f"  start: {before}\n  end:   {after}")
        assert envs._engine.restarts >= int(SECONDS // KILL_EVERY) - 1
        assert after["fds"] <= before["fds"]
        assert after["processes"] == before["processes"]
        assert after["pss_mib"] <= before["pss_mib"] * 1.2 + 20
    finally:
        envs.close()
