"""Start-up to the first observation, 64 CartPole envs: shmvec against
AsyncVectorEnv with the same start method. Each round runs in a new process,
so a fork server started by an earlier round (or another suite) cannot help."""

import pytest
from benchlib import in_fresh_process, record, start


@pytest.mark.parametrize("peer", ["shmvec", "async"])
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_startup(benchmark, start_method, peer):
    case = f"startup-64-{start_method}"
    benchmark.group = case
    in_fresh_process(benchmark, start, peer, "CartPole-v1", 64, start_method, rounds=3)
    if not benchmark.disabled:
        record(benchmark, case, peer, benchmark.stats.stats.median, "seconds")
