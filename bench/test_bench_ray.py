"""The cost of the Ray hop on one machine: 64 CartPoles stepped by one
``shmvec.ShmVecEnv`` against a ``shmvec.ray.RayVecEnv`` with 2 actors (one
CPU each, each stepping its 32 envs through its own ShmVecEnv), both in
synchronous mode on the same CPUs.

The hop per batch is the difference of their times per batch: what a step
pays for going through Ray (actions out, results back, merging). It is
printed and kept in the Ray benchmark's ``extra_info["ray_hop_ms"]``.

Then the same RayVecEnv beside two busy processes (``Hogs``), its actors at
Ray's niceness for workers (15) and at 0 (``RAY_worker_niceness`` in their
``runtime_env``): what the README's advice for a shared node is worth.

    pytest bench/test_bench_ray.py -s --benchmark-max-time=0.5
"""

from __future__ import annotations

import functools
import pathlib

import gymnasium as gym
import pytest

ray = pytest.importorskip("ray")

from benchlib import CPUS, RESULTS, time_steps

from shmvec.bench.measure import Hogs

import shmvec
from shmvec.ray import RayVecEnv

NUM_ENVS = 64
CASE = f"ray-hop-cartpole-{NUM_ENVS}"
MAKE = functools.partial(gym.make, "CartPole-v1")
BUILD = {
    "shmvec": lambda: shmvec.ShmVecEnv([MAKE] * NUM_ENVS),
    "ray-2-actors": lambda: RayVecEnv([MAKE] * NUM_ENVS, 2, actor_options={"num_cpus": max(1, CPUS // 2)}),
}
BUSY_CASE = f"ray-busy-2-cartpole-{NUM_ENVS}"


@pytest.fixture(scope="module", autouse=True)
def cluster(tmp_path_factory):
    # Ray puts the driver's working directory on its workers' path: not the
    # repository root, whose source tree would shadow the installed shmvec.
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(pathlib.Path(__file__).parent)
        ray.init(num_cpus=max(2, CPUS), include_dashboard=False, log_to_driver=False,
                 _temp_dir=str(tmp_path_factory.mktemp("ray")))  # not /tmp/ray
    yield
    ray.shutdown()


@pytest.mark.parametrize("who", BUILD)  # shmvec first: the Ray case compares itself with it
def test_ray_hop(benchmark, who):
    envs = BUILD[who]()
    try:
        time_steps(benchmark, envs, NUM_ENVS, CASE, who)
    finally:
        envs.close()
    if who == "shmvec" or (CASE, "shmvec") not in RESULTS or benchmark.disabled:
        return
    local_ms, ray_ms = (1e3 * NUM_ENVS / RESULTS[CASE, w][0] for w in ("shmvec", who))
    benchmark.extra_info["ray_hop_ms"] = ray_ms - local_ms
    print(f"\n{CASE}: {ray_ms:.3f} ms per batch through Ray ({who}), {local_ms:.3f} ms in one "
          f"ShmVecEnv: the Ray hop costs {ray_ms - local_ms:.3f} ms per batch")


@pytest.mark.parametrize("niceness", ["15", "0"])  # 15 first: the 0 case compares itself with it
def test_ray_beside_busy_processes(benchmark, niceness):
    who = f"ray-2-actors-nice-{niceness}"
    envs = RayVecEnv([MAKE] * NUM_ENVS, 2, actor_options={
        "num_cpus": max(1, CPUS // 2), "runtime_env": {"env_vars": {"RAY_worker_niceness": niceness}}})
    try:
        envs.reset()  # made and started before the hogs: only the steps are timed beside them
        with Hogs(2):
            time_steps(benchmark, envs, NUM_ENVS, BUSY_CASE, who)
    finally:
        envs.close()
    low = (BUSY_CASE, "ray-2-actors-nice-15")
    if niceness == "15" or low not in RESULTS or benchmark.disabled:
        return
    ratio = RESULTS[BUSY_CASE, who][0] / RESULTS[low][0]
    benchmark.extra_info["x_nice_15"] = ratio
    print(f"\n{BUSY_CASE}: beside 2 busy processes, actors at nice 0 step {ratio:.2f}x as fast as at "
          "Ray's nice 15")
