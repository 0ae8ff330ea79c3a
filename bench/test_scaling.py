"""How steps per second scale with the number of CartPole envs (1 to 1024;
peers with a process per env stop at 128) and with shmvec's workers."""

import pytest
from benchlib import CPUS, time_steps

SPEC = "CartPole-v1"
NUM_ENVS = [1, 4, 16, 64, 128, 256, 1024]


@pytest.mark.parametrize("peer", ["shmvec", "sync", "async", "envpool"])
@pytest.mark.parametrize("num_envs", NUM_ENVS)
def test_num_envs(benchmark, vector_env, num_envs, peer):
    envs = vector_env(peer, SPEC, num_envs)
    time_steps(benchmark, envs, num_envs, f"scaling-envs-{num_envs}", peer)


# Every split of the CPUs between the caller and the workers, and one worker
# more than there are CPUs (spinners beyond the cores collapse throughput).
WORKER_CONFIGS = [(True, w) for w in range(CPUS + 1)] + [(False, w) for w in range(1, CPUS + 2)]


@pytest.mark.parametrize(("caller_steps", "num_workers"), WORKER_CONFIGS,
                         ids=[f"caller{int(c)}-workers{w}" for c, w in WORKER_CONFIGS])
def test_workers(benchmark, vector_env, caller_steps, num_workers):
    envs = vector_env("shmvec", SPEC, 64, num_workers=num_workers, caller_steps=caller_steps)
    time_steps(benchmark, envs, 64, "scaling-workers-64",
               f"{'caller+' if caller_steps else ''}{num_workers} workers")
