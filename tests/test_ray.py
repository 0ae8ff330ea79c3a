"""RayVecEnv on a local Ray cluster: the VectorEnv contract of ShmVecEnv
(SyncVectorEnv's results, in sync and async mode), fan-out of call/get_attr/
set_attr, actor death as WorkerDiedError, and close() releasing the actors."""

from __future__ import annotations

import functools
import math
import os
import pathlib
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable

from helpers import skip_unless_gymnasium

skip_unless_gymnasium("shmvec.ray (RayVecEnv)", "1.1")

import gymnasium as gym
import numpy as np
import pytest
from fault_envs import HANG, KILL, OK, RAISE, Boom, FaultEnv, actions_for, ctrl_c, wait_gone
from gymnasium import spaces
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from helpers import assert_same, init_local_ray, run_lockstep
from test_async import async_trajectories, row_info, sync_trajectories
from test_equivalence import ActionTypeEnv

import shmvec
from shmvec.testing import SpacesEnv, StragglerEnv

ray = pytest.importorskip("ray")

from shmvec.ray import RayVecEnv, actor_calls
from shmvec.ray.scheduler import AsyncScheduler

TESTS = pathlib.Path(__file__).resolve().parent

# Small and quick: no worker processes, each actor steps its envs itself.
FAST = {"start_method": "fork", "num_workers": 0}

DICT_TEXT = functools.partial(
    SpacesEnv,
    spaces.Dict({"x": spaces.Box(-1, 1, (2,), np.float32), "text": spaces.Text(5),
                 "id": spaces.Discrete(4)}),
    spaces.Discrete(3), max_steps=6, terminate_prob=0.1)


@pytest.fixture(scope="module", autouse=True)
def cluster(tmp_path_factory):
    # The workers start in tests/ (the actors import envs from there), not in
    # the repository root, whose source tree would shadow the installed shmvec.
    init_local_ray(tmp_path_factory, TESTS, num_cpus=2)
    yield
    ray.shutdown()


def cartpole():
    return gym.make("CartPole-v1")


@pytest.mark.parametrize("make, mode", [
    (cartpole, AutoresetMode.NEXT_STEP),
    pytest.param(DICT_TEXT, AutoresetMode.NEXT_STEP, marks=pytest.mark.heavy),
    (DICT_TEXT, AutoresetMode.SAME_STEP),
    pytest.param(DICT_TEXT, AutoresetMode.DISABLED, marks=pytest.mark.heavy),
], ids=["cartpole", "spaces-next", "spaces-same", "spaces-disabled"])
def test_matches_sync_vector_env(make, mode, closing):
    # 5 envs on 2 actors: uneven slices (3 and 2).
    envs = RayVecEnv([make] * 5, 2, autoreset_mode=mode, **FAST)
    ref = SyncVectorEnv([make] * 5, autoreset_mode=mode)
    closing(envs), closing(ref)
    assert envs.num_workers == [0, 0]
    run_lockstep(envs, ref, steps=60)
    obs, *_ = envs.step(ref.action_space.sample())
    for leaf in (obs,) if isinstance(obs, np.ndarray) else (obs["x"], obs["id"]):
        leaf += 1  # the caller owns its arrays (Ray hands back read-only ones)


@pytest.mark.heavy
def test_envs_get_the_python_scalars_of_a_list_batch(closing):
    # As under SyncVectorEnv (and ShmVecEnv): an env of a list batch gets a
    # Python int (or its own list), or the caller's item itself where no
    # array gives it back (tuples, mixed types), of an array batch a numpy
    # scalar (or array) of the array's dtype.
    cases = [(spaces.Discrete(3), ([0, 1, 2, 0, 1], np.array([2, 1, 0, 2, 1], np.int32), (1, 1, 0, 0, 2),
                                   [True, 1, 2, False, 0])),
             (spaces.Box(0, 1, (2,), np.float32), ([[k / 5, 0.5] for k in range(5)], np.full((5, 2), 0.25),
                                                   [(k / 5, 0.5) for k in range(5)]))]
    for space, batches in cases:
        make = functools.partial(ActionTypeEnv, space)
        envs, ref = RayVecEnv([make] * 5, 2, **FAST), SyncVectorEnv([make] * 5)
        closing(envs), closing(ref)
        assert_same(envs.reset(seed=0), ref.reset(seed=0), "reset")
        for batch in batches:
            assert_same(envs.step(batch), ref.step(batch), repr(batch))
        envs.close()  # (its actors hold the test cluster's CPUs)


def test_actor_workers_come_from_ray_cpu_grant(closing):
    envs = RayVecEnv([cartpole] * 4, 1, actor_options={"num_cpus": 2}, start_method="fork")
    assert envs.num_workers == [1]  # 2 CPUs: one worker, and the actor steps a slice itself
    envs.close()  # gives the CPUs back to the cluster
    async_envs = RayVecEnv([cartpole] * 4, 2, batch_size=2, start_method="fork")
    closing(async_envs)
    assert async_envs.num_workers == [1, 1]  # async: the actor only waits


def test_actor_envs_in_async_mode_step_no_envs_on_the_event_loop(monkeypatch):
    # recv() runs on the actor's event loop: with workers, the ShmVecEnv an
    # actor makes gives the caller no slice of its own (async mode's default
    # gives it one); with none, the caller steps every env, as asked.
    from shmvec.ray import actor

    monkeypatch.setattr(actor, "_granted_workers", lambda num_envs, caller_steps: 1)
    made = []
    monkeypatch.setattr(actor, "ShmVecEnv", lambda env_fns, batch_size, **kwargs: made.append(kwargs))
    actor.shmvec_env_for_grant([cartpole] * 4, 2, {})
    actor.shmvec_env_for_grant([cartpole] * 4, 2, {"num_workers": 0})
    actor.shmvec_env_for_grant([cartpole] * 4, None, {})
    assert [kwargs.get("caller_steps") for kwargs in made] == [False, None, None]
    assert [kwargs["num_workers"] for kwargs in made] == [1, 0, 1]


def test_actor_calls_that_come_after_its_close_are_quiet():
    """Ray runs an async actor's calls in any order: a send() or recv() the
    driver made before close() may run after it. They must return quietly:
    an error nobody fetches is logged by Ray as unhandled."""
    import asyncio

    from shmvec.ray.actor import SliceHost

    async def run():
        host = SliceHost()
        await host.start([cartpole] * 2, 1, {"num_workers": 0, "start_method": "fork"})
        await host.async_reset([0, 1], None, 1)
        await host.close()
        assert await host.send(np.zeros(1, dtype=np.int64), np.array([0]), 1) is None
        assert await host.recv(1) is None

    asyncio.run(run())


def assert_matches_sync(got: list, make, actions: np.ndarray, mode) -> None:
    """Each env's received steps are the first steps SyncVectorEnv gives it."""
    longest = max(len(t) for t in got)
    expected = sync_trajectories(make, len(got), actions[:, :longest], mode)
    for i, (mine, want) in enumerate(zip(got, expected)):
        for t, (step, ref) in enumerate(zip(mine, want)):
            assert_same(step[0], ref[0], f"env {i} step {t} obs")
            assert (float(step[1]), bool(step[2]), bool(step[3])) == (float(ref[1]), bool(ref[2]), bool(ref[3]))
            assert_same(step[4], ref[4], f"env {i} step {t} info")


SPACES_ENV = functools.partial(SpacesEnv, max_steps=5, terminate_prob=0.2)


@pytest.mark.parametrize("num_envs, batch, mode", [
    (6, 2, AutoresetMode.NEXT_STEP),
    (8, 3, AutoresetMode.SAME_STEP),  # batches that split an actor's results
], ids=["6x2-next", "8x3-same"])
def test_async_each_env_trajectory_matches_sync(num_envs, batch, mode, closing):
    rounds = 40
    actions = np.random.default_rng(0).integers(0, 3, size=(num_envs, rounds))
    envs = RayVecEnv([SPACES_ENV] * num_envs, 2, batch_size=batch, autoreset_mode=mode,
                     start_method="fork", num_workers=1)
    closing(envs)
    got, order = async_trajectories(envs, actions, rounds)  # asserts batch_size distinct ids per recv
    assert all(len(ids) == batch for ids in order)
    assert sum(len(t) for t in got) == rounds * batch
    assert_matches_sync(got, SPACES_ENV, actions, mode)


@pytest.mark.heavy
def test_async_caller_may_hold_envs_back(closing):
    # Envs held by the caller leave actors with fewer envs in flight than
    # they return at a time: recv() must ask for those and never wait forever.
    num_envs, batch, rounds = 8, 3, 60
    rng = np.random.default_rng(1)
    actions = rng.integers(0, 3, size=(num_envs, rounds))
    envs = RayVecEnv([SPACES_ENV] * num_envs, 2, batch_size=batch, start_method="fork", num_workers=1)
    closing(envs)
    got, held = [[] for _ in range(num_envs)], []
    envs.async_reset(seed=0)
    for _ in range(rounds):
        obs, rew, term, trunc, infos = envs.recv()
        ids = infos["env_id"]
        assert len(set(ids.tolist())) == batch
        for k, i in enumerate(ids):
            got[i].append((obs[k], rew[k], term[k], trunc[k], row_info(infos, k)))
        held += ids.tolist()
        rng.shuffle(held)
        # Send back some of the held envs, at least enough for the next recv().
        count = max(batch - (num_envs - len(held)), int(rng.integers(0, len(held) + 1)))
        sent, held = held[:count], held[count:]
        if sent:
            envs.send(np.array([actions[i, len(got[i]) - 1] for i in sent]), sent)
    assert_matches_sync(got, SPACES_ENV, actions, AutoresetMode.NEXT_STEP)


@pytest.mark.heavy
def test_slow_actor_does_not_stall_the_rest(closing):
    fast = functools.partial(StragglerEnv, base_ms=0.5, slow_prob=0)
    slow = functools.partial(StragglerEnv, base_ms=300, slow_prob=0)
    envs = RayVecEnv([fast] * 4 + [slow] * 4, 2, batch_size=2, start_method="fork", num_workers=1)
    closing(envs)
    envs.async_reset(seed=0)
    counts = np.zeros(8, dtype=int)
    for _ in range(40):
        _, _, _, _, infos = envs.recv()
        ids = infos["env_id"]
        counts[ids] += 1
        envs.send(np.zeros(len(ids), dtype=np.int64), ids)
    # Lock-step over both actors would hand out as many slow envs as fast
    # ones (and take 40 x 0.3 s); counts, not a wall-clock bound, so that a
    # busy machine cannot fail it.
    assert counts[:4].sum() > 3 * counts[4:].sum(), counts


def test_async_misuse_is_an_error(closing):
    envs = RayVecEnv([cartpole] * 4, 2, batch_size=2, start_method="fork", num_workers=1)
    closing(envs)
    with pytest.raises(RuntimeError, match="send"):
        envs.step(np.zeros(4, dtype=np.int64))
    with pytest.raises(RuntimeError, match="in flight"):
        envs.recv()
    with pytest.raises(ValueError, match="reset_mask"):  # async_reset() resets every env
        envs.async_reset(options={"reset_mask": np.array([True, False, True, False])})
    envs.async_reset(seed=0)
    with pytest.raises(ValueError, match="not yet received"):
        envs.send(np.zeros(1, dtype=np.int64), [0])
    ids = envs.recv()[4]["env_id"]
    with pytest.raises(ValueError, match="shape"):
        envs.send(np.zeros(3, dtype=np.int64), ids)
    with pytest.raises(ValueError, match="repeated"):
        envs.send(np.zeros(2, dtype=np.int64), [ids[0], ids[0]])
    with pytest.raises(TypeError, match="dtype"):
        envs.send(np.zeros(2, dtype=np.float64), ids)
    envs.send(np.zeros(2, dtype=np.int64), ids)
    with pytest.raises(ValueError, match="in flight"):
        envs.send(np.zeros(2, dtype=np.int64), ids)
    # The other two resets and the two steps, in the order they finished
    # (an actor's step may come before the other actor's reset): each once.
    rest = envs.recv()[4]["env_id"].tolist() + envs.recv()[4]["env_id"].tolist()
    assert sorted(rest) == sorted([e for e in range(4) if e not in ids] + ids.tolist())


@pytest.mark.heavy
def test_actors_waiting_for_cluster_resources_are_named(closing, monkeypatch):
    # Ray queues an actor without a word until the cluster has its CPUs: a
    # RayVecEnv whose actors wait says so (once), and starts when they free up.
    holder = RayVecEnv([cartpole] * 2, 2, **FAST)  # both of the test cluster's CPUs
    closing(holder)
    monkeypatch.setattr(actor_calls, "STARTUP_NOTICE_S", 0.5)
    release = threading.Timer(2.0, holder.close)
    release.start()
    try:
        with pytest.warns(RuntimeWarning, match=r"2 of 2 actors .* each asks for \{'CPU': 1\}, .* \{'CPU': 0(\.0)?\} free"):
            envs = RayVecEnv([cartpole] * 2, 2, **FAST)
    finally:
        release.join()
    closing(envs)
    assert envs.reset(seed=0)[0].shape == (2, 4)


def test_construction_errors():
    fns = [cartpole] * 4
    with pytest.raises(ValueError, match="num_actors"):
        RayVecEnv(fns, 5)
    with pytest.raises(ValueError, match="2 envs per actor"):
        RayVecEnv(fns, 3, batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        RayVecEnv(fns, 2, batch_size=0)
    with pytest.raises(TypeError, match="no_such_option"):  # raised by the actors' ShmVecEnv
        RayVecEnv(fns, 2, no_such_option=1)


def test_call_get_attr_set_attr_render(closing):
    make = functools.partial(SpacesEnv, render_mode="rgb_array")
    envs = RayVecEnv([make] * 5, 2, **FAST)
    ref = SyncVectorEnv([make] * 5)
    closing(envs), closing(ref)
    envs.reset(seed=3), ref.reset(seed=3)
    assert envs.np_random_seed == ref.np_random_seed == (3, 4, 5, 6, 7)
    assert envs.get_attr("max_steps") == (20,) * 5
    envs.set_attr("max_steps", [1, 2, 3, 4, 5])
    assert envs.get_attr("max_steps") == (1, 2, 3, 4, 5)
    envs.set_attr("terminate_prob", 0.0)
    assert envs.get_attr("terminate_prob") == (0.0,) * 5
    with pytest.raises(ValueError, match="length"):
        envs.set_attr("max_steps", [1, 2])
    frames = envs.render()
    assert len(frames) == 5 and frames[0].shape == (8, 8, 3)
    assert_same(envs.call("render"), ref.call("render"))
    assert envs.spec is None and envs.render_mode == "rgb_array"


class CtrlCAsTheSecondActorIsCalled:
    """Stands in for an actor's handle: a real Ctrl-C comes as its calls are made."""

    def __init__(self, actor):
        self._actor = actor

    def __getattr__(self, name):
        method = getattr(self._actor, name)

        class Method:
            def remote(self, *args, **kwargs):
                ctrl_c()
                return method.remote(*args, **kwargs)

        return Method()


def test_an_interrupted_set_attr_sets_every_env(closing, monkeypatch):
    # A Ctrl-C once the first actor has its envs' values: the second gets
    # its own too (not some envs set and others not).
    envs = RayVecEnv([SpacesEnv] * 4, 2, **FAST)
    closing(envs)
    monkeypatch.setattr(envs, "_actors", [envs._actors[0], CtrlCAsTheSecondActorIsCalled(envs._actors[1])])
    with pytest.raises(KeyboardInterrupt):
        envs.set_attr("max_steps", [1, 2, 3, 4])
    monkeypatch.undo()
    assert envs.get_attr("max_steps") == (1, 2, 3, 4)


def test_env_error_reaches_caller_and_reset_recovers(closing):
    envs = RayVecEnv([FaultEnv] * 4, 2, **FAST)
    closing(envs)
    envs.reset(seed=0)
    with pytest.raises(Boom):
        envs.step(actions_for(4, row=3, action=RAISE))
    with pytest.raises(RuntimeError, match="reset"):
        envs.step(actions_for(4))
    obs, _ = envs.reset(seed=0)
    assert obs.shape == (4, 2)
    envs.step(actions_for(4))


@pytest.mark.parametrize("batch_size", [None, 2], ids=["sync", "async"])
@pytest.mark.parametrize("vector_env", ["RayVecEnv", "ShmVecEnv"])
def test_env_error_in_a_reset_asks_for_a_full_reset_and_nothing_moves_meanwhile(vector_env, batch_size, closing):
    """After an env raised in a reset, the next step (send/recv in async
    mode) asks for a full reset, and no env steps or hands out a result in
    it, as ShmVecEnv does. RayVecEnv used to step the other actors' envs (or
    hand out their resets) before the error said so."""
    make = functools.partial(FaultEnv, fail_seed=103)  # env 3 of seed 100's: actor 1's second env
    if vector_env == "RayVecEnv":
        envs = RayVecEnv([make] * 4, 2, batch_size=batch_size, **FAST)
    else:
        envs = shmvec.ShmVecEnv([make] * 4, batch_size=batch_size, **FAST)
    closing(envs)
    ok = np.full(4, OK, dtype=np.int64)
    if batch_size is None:
        envs.reset(seed=0)
        with pytest.raises(Boom, match="reset failed"):
            envs.reset(seed=100)
        with pytest.raises(RuntimeError, match="reset"):
            envs.step(ok)
        assert envs.get_attr("t") == (0, 0, 0, 0)  # nobody stepped
        envs.reset(seed=0)
        envs.step(ok)
        assert envs.get_attr("t") == (1, 1, 1, 1)
        return
    envs.async_reset(seed=0)
    ids = envs.recv()[4]["env_id"]
    with pytest.raises(Boom, match="reset failed"):
        envs.async_reset(seed=100)
    with pytest.raises(RuntimeError, match="reset"):
        envs.recv()
    with pytest.raises(RuntimeError, match="reset"):
        envs.send(ok[:2], ids)
    envs.async_reset(seed=0)
    assert sorted(np.concatenate([envs.recv()[4]["env_id"] for _ in range(2)]).tolist()) == [0, 1, 2, 3]


def test_async_env_error_then_recv_asks_for_a_reset(closing):
    """Async mode: after an env raised, recv() says to reset, as send()
    does and as ShmVecEnv's recv() does (it ran into its own bookkeeping:
    a ValueError from a wait on no calls)."""
    envs = RayVecEnv([FaultEnv] * 4, 2, batch_size=2, **FAST)
    closing(envs)
    envs.async_reset(seed=0)
    ids = envs.recv()[4]["env_id"]
    actions = np.full(2, OK, dtype=np.int64)
    actions[0] = RAISE
    envs.send(actions, ids)
    with pytest.raises(Boom):
        while True:  # the other envs' reset results may come first
            envs.recv()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="reset"):
            envs.recv()
    with pytest.raises(RuntimeError, match="reset"):
        envs.send(np.full(1, OK, dtype=np.int64), ids[1:])
    envs.async_reset(seed=0)
    assert len(envs.recv()[4]["env_id"]) == 2


def test_async_env_error_reaches_caller_whichever_of_its_actors_calls_is_looked_at_first(closing, monkeypatch):
    """An actor with two recv calls in flight hands the env's error to one
    and "needs a reset" to the other. Ray may run an async actor's calls in
    another order than they were made, and the driver take whichever result
    it sees first (CI once saw the "needs a reset" first, and no Boom ever):
    here the driver always takes the last call made."""
    def last_call_made(scheduler):
        calls = list(scheduler._calls)
        ray.wait(calls, num_returns=len(calls))
        return scheduler._calls[calls[-1]][0], calls[-1]  # (in progress until done() or add())

    envs = RayVecEnv([FaultEnv] * 2, 1, batch_size=1, **FAST)
    closing(envs)
    envs.async_reset(seed=0)
    assert sorted(int(envs.recv()[4]["env_id"][0]) for _ in range(2)) == [0, 1]
    monkeypatch.setattr(AsyncScheduler, "next_finished", last_call_made)
    envs.send(np.array([RAISE, OK]), np.array([0, 1]))  # two recv calls of one env each
    with pytest.raises(Boom):
        envs.recv()
    with pytest.raises(RuntimeError, match="reset"):
        envs.recv()
    envs.async_reset(seed=0)
    assert len(envs.recv()[4]["env_id"]) == 1


@pytest.mark.parametrize("batch_size", [None, 2], ids=["sync", "async"])
def test_actor_death_raises_worker_died_error(batch_size, closing):
    # Without workers of its own, the env runs in the actor: KILL kills the actor.
    envs = RayVecEnv([FaultEnv] * 4, 2, batch_size=batch_size, start_method="fork",
                     num_workers=None if batch_size else 0, caller_steps=not batch_size)
    closing(envs)
    if batch_size is None:
        envs.reset(seed=0)
        call = functools.partial(envs.step, actions_for(4, row=3, action=KILL))
    else:
        envs.async_reset(seed=0)
        for _ in range(2):
            envs.recv()
        ray.kill(envs._actors[1])  # as a lost node would
        call = functools.partial(envs.send, actions_for(4)[:2], [2, 3])
        call()
        call = envs.recv
    start = time.monotonic()
    with pytest.raises(shmvec.WorkerDiedError, match=r"actor 1 \(envs 2\.\.3\) died") as info:
        call()
    assert time.monotonic() - start < 10
    assert info.value.worker == 1 and info.value.env_indices == range(2, 4)
    envs.close()  # quietly, the dead actor included


@pytest.mark.heavy
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=lambda m: m.value)
def test_dead_actor_is_restarted(mode, closing):
    envs = RayVecEnv([FaultEnv] * 4, 2, autoreset_mode=mode, restart_failed_workers=True, max_restarts=1, **FAST)
    closing(envs)
    envs.reset(seed=0)
    envs.step(actions_for(4))
    # FaultEnv observes the steps since its reset; KILL kills the actor that steps env 3.
    obs, rewards, terminations, truncations, infos = envs.step(actions_for(4, row=3, action=KILL))
    assert rewards.tolist() == [1, 1, 0, 0] and not terminations.any()
    assert truncations.tolist() == [False, False, True, True]
    assert infos["_shmvec_restarted"].tolist() == [False, False, True, True]
    if mode is AutoresetMode.SAME_STEP:  # reset at once; final_obs: the last observation the caller saw
        assert obs[:, 0].tolist() == [2, 2, 0, 0]
        assert [o[0] for o in infos["final_obs"][2:]] == [1, 1] and infos["_final_info"].tolist() == [0, 0, 1, 1]
        obs, *_ = envs.step(actions_for(4))
        assert obs[:, 0].tolist() == [3, 3, 1, 1]  # not reset again
    else:  # truncated at the last observation the caller saw; the next step autoresets
        assert obs[:, 0].tolist() == [2, 2, 1, 1]
        obs, rewards, terminations, truncations, infos = envs.step(actions_for(4))
        assert obs[:, 0].tolist() == [3, 3, 0, 0] and rewards.tolist() == [1, 1, 0, 0]
        assert not truncations.any() and "shmvec_restarted" not in infos
    with pytest.raises(shmvec.WorkerDiedError, match=r"actor 1 .*max_restarts=1"):
        envs.step(actions_for(4, row=2, action=KILL))


@pytest.mark.heavy
def test_max_restarts_counts_every_restart_of_the_vector_env(closing):
    # One budget for the whole RayVecEnv, as for a ShmVecEnv: not one per actor.
    envs = RayVecEnv([FaultEnv] * 4, 2, restart_failed_workers=True, max_restarts=1, **FAST)
    closing(envs)
    envs.reset(seed=0)
    envs.step(actions_for(4, row=0, action=KILL))  # actor 0: the one restart allowed
    with pytest.raises(shmvec.WorkerDiedError, match=r"actor 1 .*max_restarts=1"):
        envs.step(actions_for(4, row=3, action=KILL))


@pytest.mark.heavy
def test_async_dead_actor_is_restarted(closing):
    from test_restart import check_async_stream

    envs = RayVecEnv([FaultEnv] * 6, 2, batch_size=2, start_method="fork", num_workers=1,
                     restart_failed_workers=True)
    closing(envs)
    # A worker inside an actor: replaced by the actor's ShmVecEnv.
    reports = check_async_stream(envs, 40, fault_at=5, fault_env=4, fault=KILL, mode=AutoresetMode.NEXT_STEP,
                                 reports_due=3)
    assert reports == 3  # every env of actor 1's worker
    # The actor itself (as when its node is lost): Ray restarts it, and each
    # of its envs comes back once, truncated and flagged.
    ray.kill(envs._actors[0], no_restart=False)
    seen, deadline = [], time.monotonic() + 30
    while len(seen) < 3 and time.monotonic() < deadline:  # Ray takes a second or two to restart it
        obs, rewards, _, truncations, infos = envs.recv()
        ids = infos["env_id"]
        flagged = infos.get("_shmvec_restarted", np.zeros(len(ids), bool))
        assert truncations[flagged].all() and (rewards[flagged] == 0).all()
        seen += ids[flagged].tolist()
        envs.send(actions_for(len(ids)), ids)
    assert sorted(seen) == [0, 1, 2]
    assert envs.restarts == 2


def test_actor_death_is_blamed_on_its_actor(closing, monkeypatch):
    # Ray does not always say which actor died (actor_id None): the call it
    # came from does.
    envs = RayVecEnv([FaultEnv] * 4, 2, **FAST)
    closing(envs)
    envs.reset(seed=0)
    real_get = ray.get

    def get(refs, *args, **kwargs):
        try:
            return real_get(refs, *args, **kwargs)
        except ray.exceptions.RayActorError as exc:
            raise ray.exceptions.RayActorError(error_msg=str(exc)) from None  # no actor id

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(shmvec.WorkerDiedError, match=r"actor 1 \(envs 2\.\.3\)"):
        envs.step(actions_for(4, row=3, action=KILL))


def one_idle_actor(closing, env_fns: list, batch_size: int, **kwargs) -> tuple:
    """A RayVecEnv of one actor in async mode whose envs' reset results were
    all received (none is in flight): the actor, and the epoch of that reset."""
    envs = RayVecEnv(env_fns, 1, batch_size=batch_size, **kwargs)
    closing(envs)
    envs.async_reset(seed=0)
    for _ in range(len(env_fns) // batch_size):
        envs.recv()
    return envs._actors[0], envs._scheduler.epoch


@pytest.mark.heavy
def test_actor_stays_responsive_while_it_waits_for_envs(closing):
    # A recv() that waits inside an actor must not hold up that actor's sends.
    slow = functools.partial(FaultEnv, hang_s=3.0)
    actor, epoch = one_idle_actor(closing, [slow] * 4, 2, start_method="fork", num_workers=2)
    ray.get(actor.send.remote(np.array([HANG]), np.array([0]), epoch))  # env 0 takes 3 s
    waiting = actor.recv.remote(1)
    time.sleep(0.3)  # it waits in the actor now
    start = time.monotonic()
    ray.get(actor.send.remote(np.array([0]), np.array([2]), epoch))
    assert time.monotonic() - start < 2  # not queued behind the waiting recv
    ray.get(waiting)


def test_a_send_not_meant_for_the_actors_envs_now_is_dropped(closing):
    """Two sends the driver makes are not for the actor's envs as they are
    when Ray runs them, and are dropped: one that Ray runs after the
    async_reset() the driver made next (Ray runs an async actor's calls in
    any order), and one to an actor whose env raised in a recv() call the
    driver has not looked at yet (that call raises the error, then a reset
    is due). Nobody fetches a send()'s result: Ray would log its error as
    an unhandled one, or the envs would step on old actions."""
    actor, epoch = one_idle_actor(closing, [FaultEnv] * 2, 1, **FAST)
    ray.get(actor.async_reset.remote([0, 1], None, epoch + 1))  # the driver's next async_reset(), run first
    first = ray.get(actor.recv.remote(1))  # one env's reset result, received
    row = first.env_ids
    assert ray.get(actor.send.remote(np.array([OK]), row, epoch)) is None  # made before that reset: dropped
    ray.get(actor.send.remote(np.array([OK]), row, epoch + 1))  # "already in flight" had the old one stepped it
    second, third = (ray.get(actor.recv.remote(1)) for _ in range(2))
    assert second.env_ids != row and second.observations[0, 0] == 0  # the other env's reset result
    assert third.env_ids == row and third.observations[0, 0] == 1  # one step since the reset

    ray.get(actor.send.remote(np.array([RAISE]), row, epoch + 1))
    with pytest.raises(Boom):
        ray.get(actor.recv.remote(1))
    assert ray.get(actor.send.remote(np.array([OK]), second.env_ids, epoch + 1)) is None  # no error to log


@pytest.mark.heavy
def ray_restarts_slowly(monkeypatch, tries: float) -> list:
    """Makes the revival of a dead actor find it restarting (Ray's
    ActorUnavailableError) for its first `tries` calls (inf: always);
    returns the list of those calls."""
    from shmvec.ray import ActorDiedError

    unavailable = []
    real_revive = RayVecEnv._revive

    def revive(self, died):
        k = died.worker
        real_get = self._get

        def get(refs, actors):
            if len(unavailable) < tries:
                unavailable.append(refs)
                try:
                    raise ray.exceptions.ActorUnavailableError("The actor is restarting", None)
                except ray.exceptions.ActorUnavailableError as cause:
                    raise ActorDiedError(k, self.slices[k], "unavailable") from cause
            return real_get(refs, actors)

        self._get = get
        try:
            return real_revive(self, died)
        finally:
            del self._get

    monkeypatch.setattr(RayVecEnv, "_revive", revive)
    return unavailable


def ctrl_c_when(ready: Callable[[], bool]) -> threading.Thread:
    """A Ctrl-C to this process (its main thread raises it) once `ready()`."""
    def wait_then_interrupt():
        while not ready():
            time.sleep(0.01)
        ctrl_c()

    thread = threading.Thread(target=wait_then_interrupt, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("how", ["ctrl-c", "timeout"])
def test_an_interrupted_step_stays_pending_and_loses_nothing(how, closing):
    # As in ShmVecEnv: a step that a Ctrl-C (or step_wait's timeout) cuts
    # short stays pending, and step_wait() returns its results; no env steps
    # twice or is skipped, and nothing else may begin meanwhile.
    envs = RayVecEnv([functools.partial(FaultEnv, hang_s=1.5)] * 4, 2, **FAST)
    closing(envs)
    envs.reset(seed=0)
    envs.step(actions_for(4))
    slow = actions_for(4, row=1, action=HANG)  # env 1 takes 1.5 s
    if how == "ctrl-c":
        start = time.monotonic()
        interrupter = ctrl_c_when(lambda: time.monotonic() - start > 0.3)
        with pytest.raises(KeyboardInterrupt):
            envs.step(slow)
        interrupter.join()
    else:
        envs.step_async(slow)
        with pytest.raises(TimeoutError, match="still pending"):
            envs.step_wait(timeout=0.2)
    for call in (lambda: envs.step(actions_for(4)), envs.reset, lambda: envs.call("pid")):
        with pytest.raises(AlreadyPendingCallError):
            call()
    obs, rewards, terminations, truncations, _ = envs.step_wait()
    assert obs[:, 0].tolist() == [2, 2, 2, 2] and rewards.tolist() == [1, 1, 1, 1]
    with pytest.raises(NoAsyncCallError):
        envs.step_wait()
    assert envs.step(actions_for(4))[0][:, 0].tolist() == [3, 3, 3, 3]


def interrupt_next_ray_get(monkeypatch) -> None:
    """The next ray.get() raises KeyboardInterrupt (a Ctrl-C as it reads a result); later ones read."""
    real_get = ray.get

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(ray, "get", real_get)
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "get", interrupted)


def four_envs_received(closing) -> RayVecEnv:
    """4 FaultEnvs on 2 actors in async mode (batch_size=2), each reset and received."""
    envs = RayVecEnv([FaultEnv] * 4, 2, batch_size=2, **FAST)
    closing(envs)
    envs.async_reset(seed=0)
    assert sorted(envs.recv()[4]["env_id"].tolist() + envs.recv()[4]["env_id"].tolist()) == [0, 1, 2, 3]
    return envs


def assert_recv_returns_each_env_once(envs, steps: int) -> None:
    """Two recv()s of the 4 envs return each of them once, `steps` steps since its reset."""
    ids = []
    for _ in range(2):
        obs, rewards, *_, infos = envs.recv()
        assert obs[:, 0].tolist() == [steps, steps] and rewards.tolist() == [min(steps, 1)] * 2
        ids += infos["env_id"].tolist()
    assert sorted(ids) == [0, 1, 2, 3]


@pytest.mark.parametrize("where", ["gathering", "handing-out"])
def test_an_interrupted_recv_loses_no_env(where, closing, monkeypatch):
    # A Ctrl-C as recv() takes an actor's finished envs, or as it makes them
    # a batch: the next recv() returns them, each env once.
    envs = four_envs_received(closing)
    envs.send(actions_for(4), np.arange(4))
    if where == "gathering":
        interrupt_next_ray_get(monkeypatch)
    else:
        real_take = AsyncScheduler.take

        def take(self, count):
            monkeypatch.setattr(AsyncScheduler, "take", real_take)
            batch = real_take(self, count)
            ctrl_c()  # raised once recv() holds the batch
            return batch

        monkeypatch.setattr(AsyncScheduler, "take", take)
    with pytest.raises(KeyboardInterrupt):
        envs.recv()
    for env in range(4):  # each env is in flight, or finished and kept for the next recv(): not to be sent
        with pytest.raises(ValueError, match="already in flight|an interrupted recv"):
            envs.send(actions_for(1), [env])
    assert_recv_returns_each_env_once(envs, steps=1)


def test_an_interrupted_send_sends_every_env(closing, monkeypatch):
    # A Ctrl-C once the first actor has its envs' actions: the other actor
    # gets its own too, every env is marked in flight, and recv() returns
    # each once, stepped once.
    envs = four_envs_received(closing)
    batches = envs._scheduler._actions
    real_take = batches.take
    taken = []

    def take(*args):
        taken.append(1)
        if len(taken) == 2:  # the actions of the second actor's envs: the first actor's went
            ctrl_c()
        return real_take(*args)

    monkeypatch.setattr(batches, "take", take)
    with pytest.raises(KeyboardInterrupt):
        envs.send(actions_for(4), np.arange(4))
    monkeypatch.setattr(batches, "take", real_take)
    with pytest.raises(ValueError, match="already in flight"):
        envs.send(actions_for(4), np.arange(4))
    assert_recv_returns_each_env_once(envs, steps=1)


def test_an_interrupted_async_reset_asks_for_another(closing, monkeypatch):
    # Some actors may have reset and others not: send() and recv() refuse
    # until an async_reset() has reset them all.
    envs = four_envs_received(closing)
    interrupt_next_ray_get(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        envs.async_reset(seed=1)
    for call in (lambda: envs.send(actions_for(2), [0, 1]), envs.recv):
        with pytest.raises(RuntimeError, match="interrupted mid-batch; reset all envs"):
            call()
    envs.async_reset(seed=1)
    assert_recv_returns_each_env_once(envs, steps=0)


def test_an_interrupted_reset_asks_for_a_full_reset(closing, monkeypatch):
    # Some actors may have reset and others not: stepping on would mix them.
    envs = RayVecEnv([FaultEnv] * 4, 2, **FAST)
    closing(envs)
    envs.reset(seed=0)
    interrupt_next_ray_get(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        envs.reset(seed=1)
    with pytest.raises(RuntimeError, match="interrupted mid-batch; reset all envs"):
        envs.step(actions_for(4))
    envs.reset(seed=1)
    assert envs.step(actions_for(4))[0][:, 0].tolist() == [1, 1, 1, 1]


def test_a_ctrl_c_during_a_restart_ends_the_vector_env(closing, monkeypatch):
    # Ray may have restarted the actor, but its envs were not rebuilt: the
    # vector env cannot step on, and says so (no hang, no silent loss).
    envs = RayVecEnv([FaultEnv] * 4, 2, restart_failed_workers=True, max_restarts=5, **FAST)
    closing(envs)
    envs.reset(seed=0)
    unavailable = ray_restarts_slowly(monkeypatch, math.inf)  # "the actor is restarting", for good
    interrupter = ctrl_c_when(lambda: len(unavailable) >= 3)
    with pytest.raises(KeyboardInterrupt):
        envs.step(actions_for(4, row=3, action=KILL))
    interrupter.join()
    with pytest.raises(shmvec.ShmVecError, match="a Ctrl-C stopped the restart of shmvec Ray actor 1; close"):
        envs.step(actions_for(4))


def test_a_ctrl_c_once_an_actor_is_restarted_counts_its_restart_once(closing, monkeypatch):
    # A Ctrl-C after the revival, before the actor's step is made again: the
    # step stays pending, and gathering it revives the actor's envs again,
    # for the same death: the budget (max_restarts=1) counts one restart.
    envs = RayVecEnv([FaultEnv] * 4, 2, restart_failed_workers=True, max_restarts=1, **FAST)
    closing(envs)
    envs.reset(seed=0)
    real_revive = RayVecEnv._revive

    def revive(self, *args):
        monkeypatch.setattr(RayVecEnv, "_revive", real_revive)
        real_revive(self, *args)
        ctrl_c()

    monkeypatch.setattr(RayVecEnv, "_revive", revive)
    with pytest.raises(KeyboardInterrupt):
        envs.step(actions_for(4, row=3, action=KILL))
    obs, rewards, _, truncations, infos = envs.step_wait()
    assert obs[:, 0].tolist() == [1, 1, 0, 0] and infos["_shmvec_restarted"].tolist() == [False, False, True, True]
    assert rewards.tolist() == [1, 1, 0, 0] and truncations.tolist() == [False, False, True, True]
    assert envs.restarts == 1
    assert envs.step(actions_for(4))[0][:, 0].tolist() == [2, 2, 0, 0]


def test_restart_waits_while_ray_restarts_the_actor(closing, monkeypatch):
    # Until Ray has restarted a dead actor, calls to it fail with
    # ActorUnavailableError ("the actor is restarting"), for longer on a busy
    # machine (Ray runs actors at nice 15): the revival tries them again, and
    # does not take them for a spent restart budget; after STARTUP_NOTICE_S a
    # warning says, once, which actor is awaited and what it needs.
    envs = RayVecEnv([FaultEnv] * 4, 2, restart_failed_workers=True, max_restarts=1, **FAST)
    closing(envs)
    envs.reset(seed=0)
    monkeypatch.setattr(actor_calls, "STARTUP_NOTICE_S", 0.15)
    unavailable = ray_restarts_slowly(monkeypatch, 5)  # 0.1 s apart
    with pytest.warns(RuntimeWarning, match=r"Ray has not restarted actor 1 \(envs 2\.\.3\) after 0\.15 s; "
                                            r"each asks for \{'CPU': 1\}") as record:
        obs, *_, infos = envs.step(actions_for(4, row=3, action=KILL))
    assert len(record) == 1 and len(unavailable) == 5
    assert obs[:, 0].tolist() == [1, 1, 0, 0] and infos["_shmvec_restarted"].tolist() == [False, False, True, True]


def test_a_restart_ray_never_makes_ends_the_vector_env(closing, monkeypatch):
    # No hang: once REVIVE_TIMEOUT_S passes, the actor's death is raised, and
    # the vector env says to close it.
    envs = RayVecEnv([FaultEnv] * 4, 2, restart_failed_workers=True, max_restarts=5, **FAST)
    closing(envs)
    envs.reset(seed=0)
    monkeypatch.setattr(actor_calls, "REVIVE_TIMEOUT_S", 0.3)
    ray_restarts_slowly(monkeypatch, math.inf)
    start = time.monotonic()
    with pytest.raises(shmvec.WorkerDiedError, match=r"actor 1 \(envs 2\.\.3\) died.*Ray did not restart it"):
        envs.step(actions_for(4, row=3, action=KILL))
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match="Ray did not restart it; close this vector env"):
        envs.step(actions_for(4))


def actor_pids(envs) -> list[int]:
    return ray.get([actor.__ray_call__.remote(lambda _: os.getpid()) for actor in envs._actors])


@pytest.mark.parametrize("niceness", [15, 0])
def test_actors_run_at_the_niceness_they_are_given(niceness, closing):
    # The README's advice for a node that busy processes share: Ray runs its
    # actors at nice 15 (RAY_worker_niceness), and an actor's runtime_env can
    # give them another niceness, which shmvec's workers in the actor keep.
    envs = RayVecEnv([FaultEnv] * 4, 2, num_workers=1, start_method="fork", actor_options={
        "runtime_env": {"env_vars": {"RAY_worker_niceness": str(niceness)}}})
    closing(envs)
    pids = envs.call("pid")
    assert set(pids) - set(actor_pids(envs)), "no env steps in a worker of an actor"
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in pids} == {niceness}


def test_close_releases_actors():
    envs = RayVecEnv([cartpole] * 4, 2, start_method="fork", num_workers=1)
    actors, pids = list(envs._actors), actor_pids(envs)
    envs.reset(seed=0)
    envs.close()
    envs.close()  # idempotent
    with pytest.raises(ClosedEnvironmentError):
        envs.step(np.zeros(4, dtype=np.int64))
    # ray.kill is asynchronous: a call may still reach the actor (whose envs
    # are closed) for a moment; then the actor must be gone.
    deadline = time.monotonic() + 10
    while True:
        try:
            ray.get(actors[0].call.remote("spec", (), {}))
        except ray.exceptions.RayActorError:
            break
        except ray.exceptions.RayTaskError as exc:
            assert isinstance(exc.cause, ClosedEnvironmentError), exc
        assert time.monotonic() < deadline, "the actor was not released"
        time.sleep(0.1)
    assert wait_gone(pids, timeout=10) == []


def test_import_shmvec_does_not_import_ray():
    code = "import sys, shmvec; assert 'ray' not in sys.modules; import shmvec.ray; assert 'ray' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=TESTS)


def test_ray_front_end_without_ray_names_the_extra():
    code = ("import sys; sys.modules['ray'] = None\n"
            "try:\n    import shmvec.ray\nexcept ModuleNotFoundError as exc:\n    print(exc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=TESTS)
    assert "shmvec.ray needs Ray" in out.stdout, out
    assert 'pip install "shmvec[ray]"' in out.stdout, out


def test_ray_front_end_is_reached_from_import_shmvec_alone():
    code = "import shmvec; assert shmvec.ray.RayVecEnv.__name__ == 'RayVecEnv'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=TESTS)


# -- warnings the envs raise in the actors --------------------------------------


@pytest.mark.parametrize("workers", [FAST, {"start_method": "fork", "num_workers": 1, "caller_steps": False}],
                         ids=["actors-step", "actors-workers"])
def test_env_warnings_reach_the_driver_as_sync_vector_env_shows_them(workers):
    from test_worker_warnings import factories, warnings_of_a_run

    fns = factories(4)
    steps = [np.zeros(4, np.int64)] * 2
    expected = warnings_of_a_run(lambda: SyncVectorEnv(fns), steps)
    got = warnings_of_a_run(lambda: RayVecEnv(fns, 2, **workers), steps)
    assert expected["step 0"] and not expected["step 1"]  # the premise: each is shown once
    assert got == expected


def test_a_warning_before_an_env_error_reaches_the_driver_first(closing):
    from test_worker_warnings import WARN_THEN_RAISE, factories

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        envs = RayVecEnv(factories(4), 2, **FAST)
        closing(envs)
        envs.reset(seed=0)
        with pytest.raises(Boom, match="env 3"):
            envs.step(np.array([0, 0, 0, WARN_THEN_RAISE]))
        messages = [str(w.message) for w in record]
    assert "env 3 about to raise" in messages and "env 0 stepped" in messages


def test_async_mode_recv_shows_the_warnings_of_its_envs(closing):
    from test_worker_warnings import check_recv_shows_the_warnings_of_its_envs, factories

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the envs' warnings when made
        envs = RayVecEnv(factories(4), 2, batch_size=2, **FAST)
    closing(envs)
    check_recv_shows_the_warnings_of_its_envs(envs)
