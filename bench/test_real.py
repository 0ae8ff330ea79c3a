"""Workloads people train on, against the limit measured in the same run:
Pong in Gymnasium's Atari pipeline and HalfCheetah-v5 (16 envs, with ale-py's
and EnvPool's native vector envs when installed; HalfCheetah in async mode too,
8 a batch: infos every step), CartPole with a torch MLP
policy in the loop (64 envs), and CartPole on a machine kept busy by two
CPU hogs (64 and 256 envs): hogs already running when the vector env is
made, or ("busy-late") started once it has been made and warmed up.

Each configuration steps in a fresh process, the same code as `shmvec bench`
(`shmvec.bench.measure_once`), for --benchmark-max-time seconds (default 1).
"limit" is one plain single-env loop per usable CPU, all at once, summed
(`shmvec.bench.measure.concurrent_limit`), with the hogs running too where
the case has them; it has no policy. Needs `pip install "shmvec[bench-real]"`
for Pong and HalfCheetah and torch for the policy case; what is missing is
skipped with the reason."""

import importlib.util

import pytest
from benchlib import record

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
RUNS = [(case, who) for case, (*_, configs) in CASES.items() for who, _, _ in configs]


@pytest.fixture
def seconds(request):
    return float(request.config.getoption("benchmark_max_time"))


def _skip_missing(case: str) -> None:
    spec, atari, _, policy, _, _ = CASES[case]
    missing = workload_missing(spec, atari)
    if missing:
        pytest.skip(missing)
    if policy and importlib.util.find_spec("torch") is None:
        pytest.skip('the policy needs torch (pip install "torch==2.13.0")')


@pytest.mark.parametrize(("case", "who"), RUNS, ids=[f"{c}-{w}" for c, w in RUNS])
def test_real(benchmark, seconds, case, who):
    spec, atari, num_envs, policy, hogs, configs = CASES[case]
    _skip_missing(case)
    peer, options = next((p, o) for w, p, o in configs if w == who)
    reason = PEERS[peer].unavailable(spec, atari)
    if reason:
        pytest.skip(reason)

    def run():
        late = case in LATE
        with Hogs(0 if late else hogs):
            return isolated(measure_once, peer, spec, num_envs, seconds, options, atari, policy, "cpu",
                            (hogs if late else 0, False))

    benchmark.group = case
    result = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update({k: v for k, v in result.items() if k != "steps_per_s"})
    record(benchmark, case, who, result["steps_per_s"], "steps_per_s")


@pytest.mark.parametrize("case", CASES)
def test_limit(benchmark, seconds, case):
    spec, atari, _, _, hogs, _ = CASES[case]
    _skip_missing(case)

    def run():
        with Hogs(hogs):
            return concurrent_limit(spec, seconds, atari)

    benchmark.group = case
    result = benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info["loops"] = result["loops"]
    record(benchmark, case, "limit", result["steps_per_s"], "steps_per_s")
