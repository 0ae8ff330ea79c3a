"""Steps per second of shmvec and every installed peer on the same envs,
side by side (one pytest-benchmark group per case), and one env in a plain
loop, which sets the machine's limit (usable CPUs x its rate)."""

import pytest
from benchlib import CPUS, record, time_calls, time_steps

from shmvec.measure import action_batches, plain_step
from shmvec.peers import PEERS, env_factory

# case -> (env spec, number of envs)
CASES = {
    "noop-2": ("shmvec.testing:NoopEnv", 2),  # pure overhead
    "noop-64": ("shmvec.testing:NoopEnv", 64),
    "cartpole-64": ("CartPole-v1", 64),
    "acrobot-64": ("Acrobot-v1", 64),
    "pendulum-64": ("Pendulum-v1", 64),
    "image-16": ("shmvec.testing:ImageEnv", 16),  # 84x84x4 uint8 observations
    "straggler-16": ("shmvec.testing:StragglerEnv", 16),  # envs that wait, sometimes long
}


@pytest.mark.parametrize("peer", PEERS)
@pytest.mark.parametrize("case", CASES)
def test_step(benchmark, vector_env, case, peer):
    spec, num_envs = CASES[case]
    envs = vector_env(peer, spec, num_envs)
    time_steps(benchmark, envs, num_envs, case, peer)


@pytest.mark.parametrize("case", CASES)
def test_plain_loop(benchmark, case):
    env = env_factory(CASES[case][0])()
    env.reset(seed=0)
    time_calls(benchmark, plain_step(env), action_batches(env.action_space, None), 1, case, "plain")
    env.close()
    if "steps_per_s" in benchmark.extra_info:
        record(benchmark, case, "limit", CPUS * benchmark.extra_info["steps_per_s"], "steps_per_s")

