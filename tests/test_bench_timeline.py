"""`python -m shmvec.bench.timeline`: each lock-step batch split into the
caller's slice, the wait for the workers and the rest."""

import multiprocessing
import re
import time

import numpy as np
import pytest

from shmvec._engine.env_slice import EnvSlice
from shmvec._engine.pool import WorkerPool
from shmvec.bench import timeline
from shmvec.testing import NoopEnv

CALLER_S, WORKER_S = 0.001, 0.004


class WorkerSlowEnv(NoopEnv):
    """Steps in 1 ms in the caller, 4 ms in a worker (imported there by name)."""

    def step(self, action):
        time.sleep(WORKER_S if multiprocessing.parent_process() else CALLER_S)
        return super().step(action)


class UnevenEnv(NoopEnv):
    """The env reset with seed 0 steps in 4 ms, the others in 0.5 ms."""

    def reset(self, *, seed=None, options=None):
        self.slow = seed == 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        time.sleep(0.004 if self.slow else 0.0005)
        return super().step(action)


def test_share_spread_is_the_slowest_share_of_a_batch_over_the_mean_share():
    uneven = timeline.share_spread("test_bench_timeline:UnevenEnv", [1, 1], batches=20, warmup=2)
    assert 1.45 < uneven < 1.85  # 4 ms against a mean share of 2.25 ms (sleeps overshoot a little)
    even = timeline.share_spread("test_bench_timeline:WorkerSlowEnv", [2, 2], batches=20, warmup=2)
    assert 1.0 <= even < 1.25  # every env 1 ms here (no worker), so both shares 2 ms


def test_a_slow_worker_shows_as_wait_and_the_callers_envs_as_its_slice():
    step, wait = EnvSlice.step, WorkerPool.wait
    times, layout, shares = timeline.timeline("test_bench_timeline:WorkerSlowEnv", 2, 20, num_workers=1, warmup=2)
    assert layout.startswith("the caller steps 1 env, 1 ") and layout.endswith(" worker 1")
    assert times.shape == (20, 3) and shares == [1, 1]
    total, caller, waited = times.T
    assert (total >= WORKER_S * 1e6).all()  # every batch waits for the worker's 4 ms
    assert (caller >= CALLER_S * 1e6).all()
    assert (caller + waited <= total).all()
    assert np.median(waited) > np.median(caller) / 2  # the worker, 3 ms slower, is waited for
    assert (EnvSlice.step, WorkerPool.wait) == (step, wait)  # the timing wrappers are gone


def test_no_workers_no_wait_one_line_per_window_and_the_plain_loops_pace(capsys):
    timeline.main(["test_bench_timeline:WorkerSlowEnv", "--num-envs", "2", "--workers", "0",
                   "--batches", "25", "--window", "10", "--plain-seconds", "0.05"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("test_bench_timeline:WorkerSlowEnv x2: the caller steps 2 envs, no workers")
    windows = [line.split() for line in lines[2:5]]
    assert [w[0] for w in windows] == ["0-9", "10-19", "20-24"]
    assert all(int(w[1]) >= 2 * CALLER_S * 1e6 and int(w[3]) == 0 for w in windows)  # total, wait
    assert lines[5].split()[0] == "all"
    plain = re.search(r"A plain single-env loop here steps in ([\d.]+) us: a batch at that pace on every CPU "
                      r"\(2 envs per process\) takes (\d+) us, ([\d.]+) of this run's", lines[7])
    assert float(plain[1]) >= CALLER_S * 1e6 and abs(int(plain[2]) - 2 * float(plain[1])) <= 1
    assert len(lines) == 8  # one share: no spread line


def test_with_workers_the_shares_spread_is_the_last_line(capsys):
    timeline.main(["test_bench_timeline:UnevenEnv", "--num-envs", "2", "--workers", "1", "--batches", "10",
                   "--plain-seconds", "0", "--spread-batches", "10"])
    last = capsys.readouterr().out.splitlines()[-1]
    spread = re.fullmatch(r"The same shares stepped one after another in plain loops in one process: the slowest "
                          r"share of a batch took ([\d.]+) times the mean share \(the envs' own step times vary\), "
                          r"so lock-step at the plain pace would reach ([\d.]+) of it\.", last)
    assert 1.45 < float(spread[1]) < 1.85 and abs(float(spread[2]) - 1 / float(spread[1])) < 0.006


def test_steps_by_env_times_the_callers_envs_in_the_order_it_steps_them():
    """UnevenEnv reset with seed 0 steps in 4 ms, the others in 0.5 ms: the
    first column is the slow one, in the vector env and in the plain loop
    (the same seeds)."""
    in_vector, in_loop = timeline.steps_by_env("test_bench_timeline:UnevenEnv", 3, batches=6, num_workers=0,
                                               warmup=1)
    for times in (in_vector, in_loop):
        assert times.shape == (3,)
        assert 4000 <= times[0] < 8000 and (500 <= times[1:]).all() and (times[1:] < 2500).all()


def test_steps_by_env_covers_only_the_callers_own_envs():
    in_vector, in_loop = timeline.steps_by_env("test_bench_timeline:WorkerSlowEnv", 3, batches=4, num_workers=1,
                                               warmup=1)
    assert in_vector.shape == in_loop.shape and 1 <= len(in_vector) < 3  # the worker's envs (4 ms) are not timed
    assert (CALLER_S * 1e6 <= in_vector).all() and (in_vector < WORKER_S * 1e6).all()
    # Two workers for two envs: the caller steps none.
    assert timeline.steps_by_env("test_bench_timeline:WorkerSlowEnv", 2, batches=2, num_workers=2, warmup=1) is None


@pytest.mark.heavy
def test_by_env_prints_both_rows_and_the_cost_over_the_plain_loop(capsys):
    timeline.main(["test_bench_timeline:UnevenEnv", "--num-envs", "2", "--workers", "0", "--batches", "3",
                   "--plain-seconds", "0", "--by-env"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-4] == "The caller's envs one by one (--by-env), median us a step, in the order it steps them:"
    rows = [re.fullmatch(rf"{label} +([\d.]+) +([\d.]+)", line) for label, line in
            zip(("in the vector env", "in a plain loop"), lines[-3:-1])]
    assert all(rows) and all(float(row[1]) > 4 * float(row[2]) for row in rows), lines[-3:-1]
    cost = re.fullmatch(r"Over the plain loop: the first env ([+-][\d.]+) us, each of the others ([+-][\d.]+) us "
                        r"on average; the slice ([+-][\d.]+) us, ([\d.]+) times as long\.", lines[-1])
    assert cost, lines[-1]
    vector, loop = ([float(row[1]), float(row[2])] for row in rows)
    # Each of the four medians is printed to 0.05 us, the cost to 0.05 us more.
    assert abs(float(cost[3]) - (sum(vector) - sum(loop))) <= 0.25 + 1e-9
    assert abs(float(cost[4]) - sum(vector) / sum(loop)) < 0.0006


def test_counts_below_one_are_refused(capsys):
    for option in ("--num-envs", "--batches", "--window"):
        with pytest.raises(SystemExit):
            timeline.main([option, "0"])
        assert f"argument {option}: expected an integer of 1 or more, got '0'" in capsys.readouterr().err


def test_an_env_it_cannot_make_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        timeline.main(["NoSuchEnv-v0"])
    assert exit_info.value.code == 2
    assert "not a registered gymnasium env id" in capsys.readouterr().err
