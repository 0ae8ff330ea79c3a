"""Memory of 64 CartPole envs after 100 steps, as PSS of the front end and
every process it started (a page shared by n processes counts 1/n in each),
each measured in a new process: shmvec against AsyncVectorEnv with the same
start method, and SyncVectorEnv (one process) for scale."""

import pytest
from benchlib import in_fresh_process, memory, record

CONFIGS = [("shmvec", "fork"), ("async", "fork"), ("shmvec", "forkserver"), ("async", "forkserver"),
           ("sync", None)]


@pytest.mark.parametrize(("peer", "start_method"), CONFIGS, ids=[f"{p}-{m or 'none'}" for p, m in CONFIGS])
def test_memory(benchmark, peer, start_method):
    benchmark.group = "memory-64"
    pss = in_fresh_process(benchmark, memory, peer, "CartPole-v1", 64, start_method, rounds=1)
    cases = [f"memory-64-{start_method}"] if start_method else ["memory-64-fork", "memory-64-forkserver"]
    for case in cases:
        record(benchmark, case, peer, pss, "pss_mib")
