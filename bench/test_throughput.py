"""Steps per second of shmvec and every installed peer on the same envs,
side by side (one pytest-benchmark group per case), and one env in a plain
loop; the machine's limit is measured, not multiplied: one plain loop per
usable CPU, all at once, summed."""

import pytest
from benchlib import record, time_calls, time_steps

from shmvec.bench.measure import action_batches, concurrent_limit, plain_step
from shmvec.bench.peers import PEERS, env_factory

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


# Lock-step peers that run these envs; shmvec's async mode is in test_async.py and Atari in test_real.py.
LOCKSTEP = [name for name, peer in PEERS.items() if peer.is_vector_env and name not in ("shmvec-async", "ale")]


@pytest.mark.parametrize("peer", LOCKSTEP)
@pytest.mark.parametrize("case", CASES)
def test_step(benchmark, vector_env, case, peer):
    spec, num_envs = CASES[case]
    envs = vector_env(peer, spec, num_envs)
    time_steps(benchmark, envs, num_envs, case, peer)


@pytest.mark.parametrize("case", CASES)
def test_plain_loop(benchmark, request, case):
    env = env_factory(CASES[case][0])()
    env.reset(seed=0)
    time_calls(benchmark, plain_step(env), action_batches(env.action_space, None), 1, case, "plain")
    env.close()
    if not benchmark.disabled:
        limit = concurrent_limit(CASES[case][0], float(request.config.getoption("benchmark_max_time")))
        benchmark.extra_info["limit_loops"] = limit["loops"]
        record(benchmark, case, "limit", limit["steps_per_s"], "steps_per_s")

