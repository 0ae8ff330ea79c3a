"""Async send/recv against lock-step stepping of the same envs, same run:
the straggler profile (most steps 0.5 ms, 5% of steps 20 ms; the env sleeps)
with 32 envs on 8 workers and with shmvec's default workers (on 2 CPUs one
worker and the caller's own slice: async mode's recv() steps the caller's
envs where lock-step's step() does), CartPole-v1 with batch_size = num_envs // 2, and
CartPole-v1 x256 without workers (a busy machine's default) in batches of 32:
there the caller steps every env either way, so async mode's ratio is what
its per-batch bookkeeping costs."""

import functools
import time

import numpy as np
import pytest
from benchlib import record

from shmvec import ShmVecEnv
from shmvec.bench.peers import env_factory
from shmvec.testing import StragglerEnv

SECONDS = 3.0

CASES = {
    # case -> (factory, num_envs, num_workers, batch_size)
    "straggler-32": (functools.partial(StragglerEnv, base_ms=0.5, slow_ms=20, slow_prob=0.05), 32, 8, 8),
    "straggler-32-default-workers": (functools.partial(StragglerEnv, base_ms=0.5, slow_ms=20, slow_prob=0.05), 32,
                                     None, 8),
    "cartpole-async-64": (env_factory("CartPole-v1"), 64, None, 32),
    "cartpole-async-256-no-workers": (env_factory("CartPole-v1"), 256, 0, 32),
}


def lockstep_rate(envs, seconds):
    envs.reset(seed=0)
    actions = np.zeros(envs.num_envs, dtype=np.int64)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(actions)
        steps += envs.num_envs
    return steps / (time.perf_counter() - start)


def async_rate(envs, seconds):
    envs.async_reset(seed=0)
    actions = np.zeros(envs.batch_size, dtype=np.int64)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        env_ids = envs.recv()[4]["env_id"]
        envs.send(actions, env_ids)
        steps += len(env_ids)
    return steps / (time.perf_counter() - start)


@pytest.mark.parametrize("mode", ["lockstep", "async"])
@pytest.mark.parametrize("case", CASES)
def test_async_vs_lockstep(benchmark, case, mode):
    make, num_envs, workers, batch = CASES[case]
    kwargs = {"num_workers": workers} if workers is not None else {}
    if mode == "async":
        envs = ShmVecEnv([make] * num_envs, batch_size=batch, **kwargs)
        run = async_rate
    else:
        envs = ShmVecEnv([make] * num_envs, **kwargs)
        run = lockstep_rate
    try:
        benchmark.group = case
        rate = benchmark.pedantic(run, args=(envs, SECONDS), rounds=1, iterations=1)
        record(benchmark, case, f"shmvec-{mode}", rate, "steps_per_s")
    finally:
        envs.close()
