"""Workloads people train on, against the limit measured in the same run:
Pong in Gymnasium's Atari pipeline and HalfCheetah-v5 (16 envs, with ale-py's
and EnvPool's native vector envs when installed; HalfCheetah in async mode too,
8 a batch: infos every step), CartPole with a torch MLP
policy in the loop (64 envs), and CartPole on a machine kept busy by two
CPU hogs (64 and 256 envs): hogs already running when the vector env is
made, or ("busy-late") started once it has been made and warmed up.

As `shmvec bench` measures (`shmvec.bench.measure_once`, the same code):
each case's configurations and its limit in --bench-passes interleaved
passes (default 3), each measurement in a fresh process, for
--benchmark-max-time seconds (default 1); the figures are the medians, with
min-max in the summary. A CPU hog's placement beside a vector env is the
kernel's draw, which can hold for a second and more: one pass per
configuration would report that draw, not the configuration. "limit" is one
plain single-env loop per usable CPU, all at once, summed
(`shmvec.bench.measure.concurrent_limit`), with the hogs running too where
the case has them; it has no policy. Needs `pip install "shmvec[bench-real]"`
for Pong and HalfCheetah and torch for the policy case; a case that cannot
run here is skipped with the reason, and a peer that cannot is named in the
summary."""

import importlib.util

import pytest
from benchlib import record_passes, skipped

from shmvec.bench import measure_once
from shmvec.bench.measure import Hogs, concurrent_limit, isolated
from shmvec.bench.peers import PEERS, workload_missing

SHMVEC, SYNC = ("shmvec", "shmvec", {}), ("sync", "sync", {})
ALE, ENVPOOL = ("ale", "ale", {}), ("envpool", "envpool", {})
ASYNC_32 = ("shmvec-async", "shmvec-async", {"batch_size": 32})
ASYNC_8 = ("shmvec-async", "shmvec-async", {"batch_size": 8})
TWO_WORKERS = ("shmvec-2workers", "shmvec", {"num_workers": 2, "caller_steps": False})
# The quiet 2-CPU machine's default, asked for explicitly: kept beside the hogs.
ONE_WORKER = ("shmvec-1worker", "shmvec", {"num_workers": 1})
UNPINNED = ("shmvec-unpinned", "shmvec", {"pin_workers": False})
BUSY = [SHMVEC, ASYNC_32, UNPINNED, ONE_WORKER, TWO_WORKERS, SYNC]  # every configuration beside the hogs

# case -> (env spec, Atari pipeline, envs, policy, hogs, [(who, peer, ShmVecEnv options)])
CASES = {
    "pong-16": ("ALE/Pong-v5", True, 16, None, 0, [SHMVEC, SYNC, ALE, ENVPOOL]),
    "halfcheetah-16": ("HalfCheetah-v5", False, 16, None, 0, [SHMVEC, ASYNC_8, SYNC, ENVPOOL]),
    "policy-64": ("CartPole-v1", False, 64, "mlp", 0, [SHMVEC, ASYNC_32, SYNC]),
    "busy-64": ("CartPole-v1", False, 64, None, 2, BUSY),
    "busy-256": ("CartPole-v1", False, 256, None, 2, BUSY),
    "busy-late-64": ("CartPole-v1", False, 64, None, 2, [SHMVEC, ASYNC_32, SYNC]),
    "busy-late-256": ("CartPole-v1", False, 256, None, 2, [SHMVEC, ASYNC_32, SYNC]),
}
LATE = {"busy-late-64", "busy-late-256"}  # the hogs start after the warm-up (the limit's from the start)


@pytest.fixture
def seconds(request):
    return float(request.config.getoption("benchmark_max_time"))


@pytest.fixture
def passes(request, benchmark):
    # A smoke run (--benchmark-disable) measures once.
    return 1 if benchmark.disabled else int(request.config.getoption("bench_passes"))


def _skip_missing(case: str) -> None:
    spec, atari, _, policy, _, _ = CASES[case]
    missing = workload_missing(spec, atari)
    if missing:
        pytest.skip(missing)
    if policy and importlib.util.find_spec("torch") is None:
        pytest.skip('the policy needs torch (pip install "torch==2.13.0")')


@pytest.mark.parametrize("case", CASES)
def test_real(benchmark, seconds, passes, case):
    """Every configuration of `case` and its limit, in `passes` interleaved
    passes (each measurement in a fresh process); records their medians."""
    spec, atari, num_envs, policy, hogs, configs = CASES[case]
    _skip_missing(case)
    reasons = {who: PEERS[peer].unavailable(spec, atari) for who, peer, _ in configs}
    runnable = [(who, peer, options) for who, peer, options in configs if not reasons[who]]
    late = case in LATE

    def limit() -> dict:
        with Hogs(hogs):
            return concurrent_limit(spec, seconds, atari)

    def one(peer: str, options: dict) -> dict:
        with Hogs(0 if late else hogs):
            return isolated(measure_once, peer, spec, num_envs, seconds, options, atari, policy, "cpu",
                            (hogs if late else 0, False))

    def run() -> dict[str, list[dict]]:
        results: dict[str, list[dict]] = {who: [] for who in ["limit", *(who for who, _, _ in runnable)]}
        for _ in range(passes):
            results["limit"].append(limit())
            for who, peer, options in runnable:
                results[who].append(one(peer, options))
        return results

    benchmark.group = case
    results = benchmark.pedantic(run, rounds=1, iterations=1)
    for who, reason in reasons.items():
        if reason:
            skipped(case, who, reason)
    for who, measured in results.items():
        record_passes(benchmark, case, who, measured)
