"""A warning an env raises in a worker reaches the caller, as under
SyncVectorEnv: shown there once, recorded by `warnings.catch_warnings` and
`pytest.warns` around the call that raised it, and subject to the caller's
filters (one that turns it into an error raises it as the env's error)."""

from __future__ import annotations

import functools
import os
import pickle
import signal
import threading
import warnings

import gymnasium as gym
import numpy as np
import pytest
from fault_envs import Boom
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv

import shmvec

STEP, WARN_THEN_RAISE, WARN_UNPICKLABLE = range(3)


class UnpicklableWarning(UserWarning):
    """A warning whose argument pickle refuses (a lock)."""


class WarnEnv(gym.Env):
    """Warns when made, in reset(), in every step (one message the same for
    every env, one naming the env), in hello() and in close()."""

    observation_space = spaces.Box(0, 1e6, (1,), np.float32)
    action_space = spaces.Discrete(3)

    def __init__(self, index: int):
        self.index = index
        self.t = 0
        warnings.warn(f"env {index} made", UserWarning)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        warnings.warn("reset", UserWarning)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        warnings.warn("every env, every step", UserWarning)
        warnings.warn(f"env {self.index} stepped", DeprecationWarning)
        if action == WARN_THEN_RAISE:
            warnings.warn(f"env {self.index} about to raise", RuntimeWarning)
            raise Boom(f"env {self.index}")
        if action == WARN_UNPICKLABLE:
            warnings.warn(UnpicklableWarning(threading.Lock()))
        return np.full(1, self.t, np.float32), 0.0, False, False, {}

    def hello(self) -> int:
        warnings.warn(f"env {self.index} called", UserWarning)
        return self.index

    def close(self):
        warnings.warn(f"env {self.index} closed", UserWarning)

    def first_filter(self) -> str:
        """The action of its process's first warning filter."""
        return warnings.filters[0][0]


def factories(num_envs: int) -> list:
    return [functools.partial(WarnEnv, i) for i in range(num_envs)]


def shown(record: list) -> list[tuple]:
    """What a warning shows, of each warning recorded (and empties the record)."""
    out = [(w.category, str(w.message), w.filename, w.lineno) for w in record]
    record.clear()
    return out


def warnings_of_a_run(make, actions_per_step: list[np.ndarray]) -> dict[str, list]:
    """The warnings shown by each call of a run, Python's default filter
    applying (each message shown once where it was raised)."""
    out = {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        # Python 3.12+ warns the caller when fork() copies a process with threads (BLAS pools)
        warnings.filterwarnings("ignore", message="This process .* is multi-threaded", category=DeprecationWarning)
        warnings.simplefilter("ignore", shmvec.PerformanceWarning)  # shmvec's own (torch's threads), once a process
        envs = make()
        try:
            out["made"] = shown(record)
            envs.reset(seed=0)
            out["reset"] = shown(record)
            for k, actions in enumerate(actions_per_step):
                envs.step(actions)
                out[f"step {k}"] = shown(record)
            envs.call("hello")
            out["call"] = shown(record)
        finally:
            envs.close()
        out["close"] = sorted(shown(record), key=str)  # shmvec closes its workers' envs first
    return out


@pytest.mark.parametrize("num_workers, caller_steps", [(1, True), (1, False), (2, True), (4, False)])
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_workers_warnings_are_shown_in_the_caller_as_sync_vector_env_shows_them(num_workers, caller_steps,
                                                                                start_method):
    fns = factories(4)
    steps = [np.zeros(4, np.int64)] * 3
    expected = warnings_of_a_run(lambda: SyncVectorEnv(fns), steps)
    got = warnings_of_a_run(lambda: shmvec.ShmVecEnv(fns, num_workers=num_workers, caller_steps=caller_steps,
                                                     start_method=start_method), steps)
    assert expected["step 0"] and not expected["step 1"]  # the test's premise: each is shown once
    assert got == expected


def test_under_spawn_too():
    fns = factories(2)
    steps = [np.zeros(2, np.int64)] * 2
    expected = warnings_of_a_run(lambda: SyncVectorEnv(fns), steps)
    got = warnings_of_a_run(lambda: shmvec.ShmVecEnv(fns, num_workers=1, caller_steps=False,
                                                     start_method="spawn"), steps)
    assert got == expected


@pytest.fixture
def made():
    """Makes vector envs of WarnEnvs with one worker, under Python's default
    filter (the one workers take then), and closes them quietly after the test."""
    out = []

    def make(num_envs: int = 2, **kwargs):
        kwargs = {"num_workers": 1, "caller_steps": False, "start_method": "fork", **kwargs}
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            out.append(shmvec.ShmVecEnv(factories(num_envs), **kwargs))
        return out[-1]

    yield make
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for envs in out:
            envs.close()


def test_pytest_warns_around_a_step_records_a_workers_warning(made):
    envs = made()
    with pytest.warns(UserWarning, match="reset"):
        envs.reset(seed=0)
    with pytest.warns((UserWarning, DeprecationWarning)) as record:
        envs.step(np.zeros(2, np.int64))
    assert [str(w.message) for w in record] == ["every env, every step", "env 0 stepped",
                                                "every env, every step", "env 1 stepped"]


def check_recv_shows_the_warnings_of_its_envs(envs) -> None:
    """Async mode, 4 envs in batches of 2: recv() shows what their resets
    and steps raised, under Python's default filter."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        envs.async_reset(seed=0)
        envs.recv()
        envs.recv()
        assert [str(w.message) for w in record] == ["reset"]
        record.clear()
        envs.send(np.zeros(4, np.int64), np.arange(4))
        envs.recv()
        envs.recv()
        assert sorted(str(w.message) for w in record) == sorted(
            ["every env, every step"] + [f"env {i} stepped" for i in range(4)])


def test_async_mode_shows_the_workers_warnings(made):
    check_recv_shows_the_warnings_of_its_envs(made(4, num_workers=2, batch_size=2))


@pytest.mark.parametrize("batch_size", [None, 1])
def test_a_warning_before_an_env_error_is_shown_and_the_error_raised(batch_size, made):
    envs = made(batch_size=batch_size)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if batch_size is None:
            envs.reset(seed=0)
            with pytest.raises(Boom, match="env 1"):
                envs.step(np.array([STEP, WARN_THEN_RAISE]))
        else:
            envs.async_reset(seed=0)
            envs.recv()
            envs.recv()
            envs.send(np.array([WARN_THEN_RAISE]), np.array([1]))
            with pytest.raises(Boom, match="env 1"):
                envs.recv()
    assert "env 1 about to raise" in [str(w.message) for w in record]


def test_a_filter_the_caller_set_later_turns_the_warning_into_the_envs_error(made):
    envs = made()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs.reset(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="every env, every step"):
            envs.step(np.zeros(2, np.int64))
    with pytest.raises(RuntimeError, match="reset all envs"):  # as after any env error mid-batch
        envs.step(np.zeros(2, np.int64))


def test_a_warning_pickle_refuses_arrives_as_its_text(made):
    with pytest.raises(TypeError):
        pickle.dumps(UnpicklableWarning(threading.Lock()))
    envs = made(start_method="forkserver")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        envs.reset(seed=0)
        envs.step(np.array([STEP, WARN_UNPICKLABLE]))
    unpicklable = [w for w in record if "lock" in str(w.message)]
    assert len(unpicklable) == 1
    assert issubclass(unpicklable[0].category, UserWarning)
    assert unpicklable[0].filename == __file__


# -- filters the caller changes after the vector env is made -----------------


def warnings_as_filters_change(make, num_envs: int) -> dict[str, list]:
    """The warnings shown by each call of a run whose filters change between
    calls: a message shown once is shown again once the filters change (as
    Python does in any process), every one under "always", none that
    "ignore" names."""
    zeros = np.zeros(num_envs, np.int64)
    out = {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("ignore")  # as the vector env is made
        envs = make()
        try:
            warnings.simplefilter("default")
            warnings.simplefilter("ignore", shmvec.PerformanceWarning)
            envs.reset(seed=0)
            envs.step(zeros)
            out["default"] = shown(record)
            envs.step(zeros)
            out["default, again"] = shown(record)
            warnings.simplefilter("always")
            envs.reset(seed=0)
            envs.step(zeros)
            out["always"] = shown(record)
            warnings.simplefilter("ignore", DeprecationWarning)
            envs.step(zeros)
            out["always, deprecations ignored"] = shown(record)
            warnings.resetwarnings()
            warnings.simplefilter("default")
            warnings.simplefilter("ignore", shmvec.PerformanceWarning)
            envs.step(zeros)
            envs.call("hello")
            out["default after a reset of the filters"] = shown(record)
        finally:
            warnings.simplefilter("ignore")
            envs.close()
    return out


@pytest.mark.parametrize("num_workers, caller_steps", [(1, False), (2, True)])
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_workers_follow_the_filters_the_caller_sets_later_as_sync_vector_env_does(num_workers, caller_steps,
                                                                                   start_method):
    fns = factories(4)
    expected = warnings_as_filters_change(lambda: SyncVectorEnv(fns), 4)
    got = warnings_as_filters_change(lambda: shmvec.ShmVecEnv(fns, num_workers=num_workers,
                                                              caller_steps=caller_steps,
                                                              start_method=start_method), 4)
    # The premises: made under "ignore", nothing would reach the caller
    # (until its filters reached the workers), and "always" shows each env's.
    assert expected["default"] and not expected["default, again"]
    assert len(expected["always"]) == 4 + 2 * 4
    assert got == expected


def test_pytest_warns_records_a_warning_the_worker_showed_before(made):
    envs = made()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        envs.reset(seed=0)  # shown once: the worker's registry remembers it
        envs.step(np.zeros(2, np.int64))
        assert [str(w.message) for w in record].count("every env, every step") == 1
    with pytest.warns(UserWarning, match="reset"):
        envs.reset(seed=0)
    with pytest.warns((UserWarning, DeprecationWarning)) as record:
        envs.step(np.zeros(2, np.int64))
    assert [str(w.message) for w in record].count("every env, every step") == 2  # pytest.warns shows every one


def test_in_async_mode_the_filters_reach_the_workers_with_a_reset(made):
    envs = made(4, num_workers=2, batch_size=2)
    for _ in range(2):
        with pytest.warns(UserWarning, match="reset") as record:
            envs.async_reset(seed=0)
            envs.recv()
            envs.recv()
        assert [str(w.message) for w in record].count("reset") == 4


def test_unchanged_filters_are_not_sent_again(made, monkeypatch):
    """A loop that steps inside a catch_warnings() of its own (a new list of
    the same filters every time) costs the step path nothing."""
    envs = made()
    warnings.simplefilter("ignore")  # (pytest's test filters make warnings errors)
    envs.reset(seed=0)
    posted = []
    post = envs._engine.transport.post
    monkeypatch.setattr(envs._engine.transport, "post",
                        lambda code, *args, **kwargs: posted.append(code) or post(code, *args, **kwargs))
    for _ in range(3):
        with warnings.catch_warnings():
            envs.step(np.zeros(2, np.int64))
    assert posted == []  # plain steps, posted natively
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        envs.step(np.zeros(2, np.int64))
        envs.step(np.zeros(2, np.int64))
    assert len(posted) == 1  # the first step under new filters took them


def test_changed_filters_go_ahead_of_a_request_sent_in_chunks(made):
    envs = made()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        envs.set_attr("payload", [bytes(200_000)] * 2)  # beyond the 64 KiB request area
        assert envs.get_attr("payload") == (bytes(200_000),) * 2
        assert [str(w.message) for w in record].count("env 1 called") == 0
        assert envs.call("hello") == (0, 1)
        assert [str(w.message) for w in record] == ["env 0 called", "env 1 called"]
        assert envs.call("first_filter") == ("always", "always")


def test_a_worker_restarted_under_other_filters_takes_the_callers_again(made):
    envs = made(restart_failed_workers=True)
    warnings.simplefilter("ignore")
    envs.reset(seed=0)  # the worker takes "ignore"
    os.kill(envs._engine.pool.processes[0].pid, signal.SIGKILL)
    envs._engine.pool.processes[0].join()
    envs.step_async(np.zeros(2, np.int64))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        envs.step_wait()  # the new worker starts here, under "always"
    assert envs._engine.restarts == 1
    # The caller's filters are again the list the old worker took; the new one must take it too.
    assert envs.call("first_filter") == ("ignore", "ignore")
