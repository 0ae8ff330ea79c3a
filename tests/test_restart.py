"""restart_failed_workers=True: a worker that dies or hangs is replaced; the
failed step reports its envs as truncated and restarted, the others are
unaffected; a restart budget turns a crash loop into WorkerDiedError."""

from __future__ import annotations

import functools
import os
import signal
import time

import numpy as np
import pytest
from fault_envs import (GATE, HANG, KILL, OK, RAISE, Boom, ColumnInfoEnv, FailsOnceMarked, FaultEnv, actions_for, ctrl_c,
                        later, then_ctrl_c)
from gymnasium.vector import SyncVectorEnv
from helpers import (FINAL_OBS, MODES, SAME_STEP, assert_same, autoreset_kwargs, mode_id, needs_autoreset_modes,
                     sync_pair)

import shmvec
from shmvec._gym_compat import AutoresetMode
from shmvec.testing import SpacesEnv, StragglerEnv

MAKE = functools.partial(SpacesEnv, max_steps=1000, terminate_prob=0.0, infos=False)


# The default autoreset mode: NEXT_STEP on Gymnasium 1.x, same-step on 0.29.
DEFAULT_MODE = MODES[0]
# Async mode's modes: every autoresetting one.
ASYNC_MODES = [m for m in MODES if m is None or m is not AutoresetMode.DISABLED]


def restart_in_final_info(infos: dict, i: int) -> bool:
    """Whether env i's final_info says it was restarted (1.x nests final_info
    batched; 0.29 keeps one dict per env)."""
    final = infos["final_info"]
    if isinstance(final, dict):
        return bool(final.get("_shmvec_restarted", np.zeros(i + 1, bool))[i])
    return bool(final[i] and final[i].get("shmvec_restarted"))


def kill_worker(envs, w):
    os.kill(envs._engine.pool.processes[w].pid, signal.SIGKILL)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_killed_worker_is_replaced(mode):
    envs, ref = sync_pair([MAKE] * 6, mode, num_workers=2, caller_steps=True, start_method="fork",
                          restart_failed_workers=True)
    try:
        rows = list(envs._engine.worker_rows[1])  # envs 4, 5
        others = [i for i in range(6) if i not in rows]
        seen = envs.reset(seed=0)[0]
        ref.reset(seed=0)
        actions = np.zeros(6, dtype=np.int64)
        for _ in range(3):
            seen = envs.step(actions)[0]
            ref.step(actions)
        kill_worker(envs, 1)
        obs, rewards, terms, truncs, infos = envs.step(actions)
        expected = ref.step(actions)
        # The other envs are unaffected.
        assert_same(obs[others], expected[0][others])
        assert_same(rewards[others], expected[1][others])
        # The restarted ones: truncated, reward 0, flagged.
        assert truncs[rows].all() and not terms[rows].any() and (rewards[rows] == 0).all()
        assert infos["_shmvec_restarted"].tolist() == [i in rows for i in range(6)]
        assert envs._engine.restarts == 1
        if mode is SAME_STEP:
            # Reset at once; final_obs is the last observation the caller saw.
            assert envs.get_attr("t")[4:] == (0, 0)
            for i in rows:
                assert_same(infos[FINAL_OBS][i], seen[i])
            assert infos["_final_info"].tolist() == [i in rows for i in range(6)]
            assert [restart_in_final_info(infos, i) for i in range(6)] == [i in rows for i in range(6)]
            envs.step(actions)
            assert envs.get_attr("t")[4:] == (1, 1)  # not reset again
            return
        # NEXT_STEP and DISABLED: the truncation comes with the last
        # observation the caller saw, as for any truncated episode.
        assert_same(obs[rows], seen[rows])
        if mode is AutoresetMode.DISABLED:
            with pytest.raises(RuntimeError, match="reset"):
                envs.step(actions)
            # The caller resets them, and may seed them: reproducible again.
            mask = np.array([i in rows for i in range(6)])
            obs, _ = envs.reset(seed=[None] * 4 + [40, 41], options={"reset_mask": mask})
            fresh = SyncVectorEnv([MAKE] * 2)
            assert_same(obs[rows], fresh.reset(seed=[40, 41])[0])
            fresh.close()
            envs.step(actions)
            assert envs.get_attr("t")[4:] == (1, 1)
            return
        # NEXT_STEP: the next step is their autoreset step, as SyncVectorEnv
        # makes it after a truncation: action ignored, reset observation,
        # reward 0, flags False, the reset's info.
        obs, rewards, terms, truncs, infos = envs.step(actions)
        assert envs.get_attr("t")[4:] == (0, 0)
        assert (rewards[rows] == 0).all() and not truncs[rows].any() and not terms[rows].any()
        assert "shmvec_restarted" not in infos
        assert not np.array_equal(obs[rows], seen[rows])
        envs.step(actions)
        assert envs.get_attr("t")[4:] == (1, 1)
    finally:
        envs.close()
        ref.close()


def test_hung_worker_is_replaced_after_timeout():
    hang_once = functools.partial(StragglerEnv, base_ms=0.1, slow_ms=60_000, slow_prob=0.0)
    envs = shmvec.ShmVecEnv([hang_once] * 4, num_workers=2, caller_steps=False, start_method="fork",
                            timeout=1.0, restart_failed_workers=True)
    try:
        envs.reset(seed=0)
        envs.call("__setattr__", "slow_prob", 0.0)
        envs._engine.call("__setattr__", ("slow_prob", 1.0), rows=[3])  # env 3 will hang
        obs, rewards, terms, truncs, infos = envs.step(np.zeros(4, dtype=np.int64))
        assert truncs.tolist() == [False, False, True, True]
        assert infos["_shmvec_restarted"].tolist() == [False, False, True, True]
        envs.step(np.zeros(4, dtype=np.int64))  # the fresh env does not hang
    finally:
        envs.close()


def test_restart_budget_turns_a_crash_loop_into_an_error():
    envs = shmvec.ShmVecEnv([MAKE] * 2, num_workers=1, caller_steps=True, start_method="fork",
                            restart_failed_workers=True, max_restarts=1)
    try:
        envs.reset(seed=0)
        kill_worker(envs, 0)
        envs.step(np.zeros(2, dtype=np.int64))  # restarted once
        kill_worker(envs, 0)
        with pytest.raises(shmvec.WorkerDiedError, match="max_restarts=1") as info:
            envs.step(np.zeros(2, dtype=np.int64))
        assert "SIGKILL" in str(info.value) and "(envs 1..1)" in str(info.value)  # its envs, as any death's
        with pytest.raises(shmvec.ShmVecError):
            envs.step(np.zeros(2, dtype=np.int64))
    finally:
        envs.close()


def test_an_env_error_and_a_death_in_one_step_spend_one_restart():
    """Env 0 (worker 0) raises while worker 1 dies, in one step: the env
    error is raised, and worker 1 is replaced once. It was left dead,
    counted again by the next wait and replaced twice (the first reset()
    after raised multiprocessing's ValueError), and with max_restarts=1
    that one death would have spent the budget."""
    envs = shmvec.ShmVecEnv([FaultEnv] * 4, num_workers=2, caller_steps=False, start_method="fork",
                            restart_failed_workers=True, max_restarts=1)
    try:
        envs.reset(seed=0)
        with pytest.raises(Boom):
            envs.step(actions_for(4, 0, RAISE) + actions_for(4, 3, KILL))
        assert envs._engine.restarts == 1
        obs, _ = envs.reset(seed=2)
        assert obs[:, 0].tolist() == [0, 0, 0, 0]
        assert envs._engine.restarts == 1
        assert envs.step(actions_for(4))[0][:, 0].tolist() == [1, 1, 1, 1]
    finally:
        envs.close()


class DiesAtReset(FaultEnv):
    """A FaultEnv whose reset(options={"die": True}) kills its process."""

    def reset(self, *, seed=None, options=None):
        if options and options.get("die"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().reset(seed=seed, options=options)


@needs_autoreset_modes("options['reset_mask']")
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED], ids=mode_id)
def test_a_death_in_a_masked_reset_reports_the_envs_it_left_out_at_their_next_step(mode):
    """Worker 1 (envs 2 and 3) dies as env 2 resets, with env 3 left out of
    the mask: env 2 is reset again, and env 3, whose episode the death cut
    short, keeps the observation the caller saw and reports its restart at
    its next step, as after a death in a step. It was reset silently, mid-
    episode, and a learner would have bootstrapped across the cut."""
    envs = shmvec.ShmVecEnv([DiesAtReset] * 4, num_workers=2, caller_steps=False, start_method="fork",
                            restart_failed_workers=True, autoreset_mode=mode)
    try:
        envs.reset(seed=0)
        for _ in range(3):
            seen = envs.step(actions_for(4))[0]
        mask = np.array([False, False, True, False])
        obs, infos = envs.reset(options={"reset_mask": mask, "die": True})
        assert envs._engine.restarts == 1
        assert obs[:, 0].tolist() == [3, 3, 0, 3]
        assert_same(obs[3], seen[3])
        obs, rewards, terms, truncs, infos = envs.step(actions_for(4))
        assert obs[:, 0].tolist() == [4, 4, 1, 3]
        assert truncs.tolist() == [False, False, False, True] and not terms.any() and rewards[3] == 0
        assert infos["_shmvec_restarted"].tolist() == [False, False, False, True]
        if mode is AutoresetMode.DISABLED:
            with pytest.raises(RuntimeError, match="reset"):
                envs.step(actions_for(4))
            envs.reset(options={"reset_mask": truncs})
        assert envs.step(actions_for(4))[0][:, 0].tolist() == [5, 5, 2, 0 if mode is AutoresetMode.NEXT_STEP else 1]
    finally:
        envs.close()


def test_a_replacement_whose_envs_cannot_be_built_breaks_the_env(tmp_path):
    """The replacement's factory raises: the step raises that error, and the
    vector env says it is broken (only close() works) instead of asking for
    a reset that can never succeed."""
    marker = tmp_path / "fail"
    envs = shmvec.ShmVecEnv([functools.partial(FailsOnceMarked, str(marker))] * 4, num_workers=2,
                            caller_steps=False, start_method="fork", restart_failed_workers=True)
    try:
        envs.reset(seed=0)
        marker.touch()
        kill_worker(envs, 1)
        with pytest.raises(Boom, match="factory failed"):
            envs.step(np.zeros(4, dtype=np.int64))
        marker.unlink()  # a factory that works again does not bring the worker back
        for call in (lambda: envs.reset(seed=1), lambda: envs.step(np.zeros(4, dtype=np.int64))):
            with pytest.raises(shmvec.ShmVecError, match="could not be rebuilt.*close"):
                call()
    finally:
        envs.close()
    assert envs.closed


def test_death_during_call_restarts_and_reports():
    envs = shmvec.ShmVecEnv([MAKE] * 4, num_workers=2, caller_steps=False, start_method="fork",
                            restart_failed_workers=True)
    try:
        seen = envs.reset(seed=0)[0]
        with pytest.raises(shmvec.ShmVecError, match="restarted"):
            envs.call("__class__")  # warm-up is fine; now kill during a call:
            kill_worker(envs, 1)
            envs.call("render")
        assert envs.get_attr("t") == (0, 0, 0, 0)  # usable again
        # The next step reports the restarted envs, as if they had died in it.
        obs, rewards, terms, truncs, infos = envs.step(np.zeros(4, dtype=np.int64))
        assert truncs.tolist() == [False, False, True, True] and rewards[2:].tolist() == [0, 0]
        assert infos["_shmvec_restarted"].tolist() == [False, False, True, True]
        if DEFAULT_MODE is SAME_STEP:  # Gymnasium 0.29: reset at once, the last observation seen is final
            for i in (2, 3):
                assert_same(infos[FINAL_OBS][i], seen[i])
        else:  # truncated at the last observation the caller saw
            assert_same(obs[2:], seen[2:])
    finally:
        envs.close()


def check_async_stream(envs, steps: int, fault_at: int, fault_env: int, fault: int, mode,
                       reports_due: int = 0) -> int:
    """Drives async envs of FaultEnvs (observation: steps since reset) with
    OK actions, and `fault` for env `fault_env` once, after `fault_at` rounds,
    for `steps` rounds and until `reports_due` restart reports came (at most
    20 s). Checks every env's stream against the autoreset mode's rules,
    restarts included; returns how many restart reports came back."""
    last = {}  # env -> (obs, episode ended)
    reports = 0
    envs.async_reset(seed=0)
    deadline = time.monotonic() + 20
    k = -1
    while (k := k + 1) < steps or (reports < reports_due and time.monotonic() < deadline):
        obs, rewards, terms, truncs, infos = envs.recv()
        ids = infos["env_id"]
        restarted = infos.get("_shmvec_restarted", np.zeros(len(ids), bool))
        for j, i in enumerate(ids.tolist()):
            t = float(obs[j][0])
            if i not in last or (mode is AutoresetMode.NEXT_STEP and last[i][1]):
                assert (t, rewards[j], terms[j], truncs[j]) == (0, 0, False, False), (i, k)  # a reset
                assert not restarted[j]
            elif restarted[j]:
                reports += 1
                assert (rewards[j], terms[j], truncs[j]) == (0, False, True), (i, k)
                if mode is AutoresetMode.NEXT_STEP:
                    assert t == last[i][0]  # the last observation the caller saw
                else:
                    assert t == 0 and infos[FINAL_OBS][j][0] == last[i][0]
                    assert restart_in_final_info(infos, j)
            else:
                assert (t, rewards[j], truncs[j]) == (last[i][0] + 1, 1, False), (i, k)
            last[i] = (t, bool(terms[j] or truncs[j]))
        actions = np.zeros(len(ids), dtype=np.int64)
        if k == fault_at and fault_env in ids:
            actions[ids.tolist().index(fault_env)] = fault
            fault_at = -1
        elif k >= fault_at >= 0:
            fault_at += 1  # wait until the env comes back
        envs.send(actions, ids)
    return reports


@pytest.mark.parametrize("mode", ASYNC_MODES, ids=mode_id)
def test_async_dead_worker_is_replaced(mode):
    envs = shmvec.ShmVecEnv([FaultEnv] * 6, batch_size=2, num_workers=3, start_method="fork",
                            restart_failed_workers=True, **autoreset_kwargs(mode))
    try:
        reports = check_async_stream(envs, 60, fault_at=10, fault_env=2, fault=KILL, mode=mode, reports_due=2)
        assert envs._engine.restarts == 1
        assert reports == 2  # envs 2 and 3, worker 1's
    finally:
        envs.close()


def test_async_death_after_an_env_finished_keeps_its_result_and_infos(tmp_path):
    """Env 0 finished; its worker then dies stepping env 1. recv() hands out
    env 0's step, infos included, without asking the worker (its info
    columns' schema is in the arena), and the next recv() env 1's restart
    report. It asked the dead worker for the schema: WorkerDiedError, the
    vector env broken, restarts on or not."""
    gate = tmp_path / "gate"
    envs = shmvec.ShmVecEnv([functools.partial(ColumnInfoEnv, gate=str(gate), hang_s=30)] * 3, batch_size=1,
                            num_workers=1, caller_steps=False, start_method="fork", restart_failed_workers=True)
    try:
        envs.async_reset(seed=0)
        for _ in range(3):
            envs.recv()
        envs.send(np.array([OK, GATE]), [0, 1])  # env 1 waits for the gate, then kills the worker
        with later((0.5, gate.touch)):
            obs, rewards, terms, truncs, infos = envs.recv()
            gate.touch()
            assert infos["env_id"].tolist() == [0] and obs[0].tolist() == [1, 1] and rewards.tolist() == [1]
            assert infos["t"].tolist() == [1] and infos["_t"].tolist() == [True]
            obs, rewards, terms, truncs, infos = envs.recv()
        assert infos["env_id"].tolist() == [1] and truncs.tolist() == [True]
        assert infos["_shmvec_restarted"].tolist() == [True]
        assert envs._engine.restarts == 1
        envs.send(np.array([OK, OK]), [0, 1])  # both step on
        received = {int(envs.recv()[4]["env_id"][0]) for _ in range(2)}
        assert received == {0, 1}
    finally:
        envs.close()


def test_async_death_before_recv_fetched_a_large_record_reports_the_env(tmp_path):
    """Env 0 finished with an info too large for its record slot, which its
    worker keeps until recv() asks; the worker then dies stepping env 1.
    The record died with it: env 0 is sent again to the fresh worker and
    comes back with its restart report, as an env in flight does. recv()
    raised WorkerDiedError and the vector env was broken."""
    gate = tmp_path / "gate"
    make = functools.partial(ColumnInfoEnv, blob=20_000, gate=str(gate), hang_s=30)
    envs = shmvec.ShmVecEnv([make] * 3, batch_size=1, num_workers=1, caller_steps=False, start_method="fork",
                            restart_failed_workers=True)
    try:
        envs.async_reset(seed=0)
        for _ in range(3):
            envs.recv()
        envs.send(np.array([OK, GATE]), [0, 1])
        with later((0.5, gate.touch)):
            reports = {}
            for _ in range(2):
                obs, rewards, terms, truncs, infos = envs.recv()
                gate.touch()
                reports[int(infos["env_id"][0])] = (truncs.tolist(), infos["_shmvec_restarted"].tolist())
        assert reports == {0: ([True], [True]), 1: ([True], [True])}
        assert envs._engine.restarts == 1
        for _ in range(2):  # both step on (the first step may be their autoreset), large infos and all
            envs.send(np.array([OK, OK]), [0, 1])
            infos = [envs.recv()[4] for _ in range(2)]
        assert all(info["blob"][0] == "x" * 20_000 for info in infos)
    finally:
        envs.close()


def ctrl_c_as_worker_1_is_replaced(envs) -> list[int]:
    """Sends 4 FaultEnvs, env 2 to kill worker 1 (envs 2, 3); recv() replaces
    it and a Ctrl-C comes before it sends those envs again. Returns the
    envs recv() handed out before that."""
    envs.async_reset(seed=0)
    envs.recv(), envs.recv()
    envs.send(actions_for(4, row=2, action=KILL), [0, 1, 2, 3])
    engine = envs._engine
    engine.restart_failed = then_ctrl_c(engine.restart_failed)
    received = []
    with pytest.raises(KeyboardInterrupt):
        for _ in range(2):
            received += envs.recv()[4]["env_id"].tolist()
    del engine.restart_failed
    assert engine.restarts == 1
    return received


def test_async_ctrl_c_as_a_worker_is_replaced_loses_no_env():
    """A Ctrl-C as recv() replaces a dead worker, before it sent that
    worker's envs in flight again: the next recv() sends them and they come
    back with their reports. They were lost: recv() waited for them until
    its timeout (for ever without one)."""
    envs = shmvec.ShmVecEnv([FaultEnv] * 4, batch_size=2, num_workers=2, caller_steps=False, start_method="fork",
                            restart_failed_workers=True, timeout=10)
    try:
        received = ctrl_c_as_worker_1_is_replaced(envs)
        while len(received) < 4:
            obs, rewards, terms, truncs, infos = envs.recv()
            for j, i in enumerate(infos["env_id"].tolist()):
                received.append(i)
                if i in (2, 3):
                    assert truncs[j] and infos["_shmvec_restarted"][j]
        assert sorted(received) == [0, 1, 2, 3]
    finally:
        envs.close()


def test_async_reset_after_a_ctrl_c_as_a_worker_is_replaced_returns():
    """As above, but async_reset() comes next: it lets the envs in flight
    land before it resets, and those of the replaced worker never will. It
    waited for them until its timeout (for ever without one)."""
    envs = shmvec.ShmVecEnv([FaultEnv] * 4, batch_size=2, num_workers=2, caller_steps=False, start_method="fork",
                            restart_failed_workers=True, timeout=10)
    try:
        ctrl_c_as_worker_1_is_replaced(envs)
        envs.async_reset(seed=1)
        received = [i for _ in range(2) for i in envs.recv()[4]["env_id"].tolist()]
        assert sorted(received) == [0, 1, 2, 3]
    finally:
        envs.close()


def test_async_death_after_an_interrupted_record_fetch_is_a_restart():
    """A Ctrl-C while recv() waits for a worker to hand over a record too
    large for its slot; the worker then dies, and get_attr() waits that
    fetch out: the worker is replaced (get_attr() says call again) and its
    envs come back with their reports. The wait raised WorkerDiedError
    and broke the vector env, restarts on or not."""
    make = functools.partial(ColumnInfoEnv, blob=20_000, hang_s=1.0)
    envs = shmvec.ShmVecEnv([make] * 3, batch_size=1, num_workers=1, caller_steps=False, start_method="fork",
                            restart_failed_workers=True)
    try:
        envs.async_reset(seed=0)
        for _ in range(3):
            envs.recv()
        envs.send(np.array([OK, HANG]), [0, 1])  # the worker answers the fetch of env 0's record after env 1's step
        while not envs._engine.async_steps.wait_finished(1, 5.0):
            pass
        with later((0.3, ctrl_c)), pytest.raises(KeyboardInterrupt):
            envs.recv()
        kill_worker(envs, 0)
        with pytest.raises(shmvec.ShmVecError, match="restarted"):
            envs.get_attr("t")
        assert envs.get_attr("t") == (0, 0, 0) and envs._engine.restarts == 1
        for _ in range(2):
            truncs, infos = envs.recv()[3:]
            assert truncs.tolist() == [True] and infos["_shmvec_restarted"].tolist() == [True]
    finally:
        envs.close()


def test_async_hung_worker_is_replaced_after_timeout():
    envs = shmvec.ShmVecEnv([functools.partial(FaultEnv, hang_s=60)] * 4, batch_size=2, num_workers=2,
                            start_method="fork", timeout=1.0, restart_failed_workers=True)
    try:
        reports = check_async_stream(envs, 30, fault_at=5, fault_env=3, fault=HANG, mode=DEFAULT_MODE,
                                     reports_due=2)
        assert envs._engine.restarts == 1 and reports == 2
    finally:
        envs.close()


def test_async_restart_budget():
    envs = shmvec.ShmVecEnv([FaultEnv] * 4, batch_size=2, num_workers=2, start_method="fork",
                            restart_failed_workers=True, max_restarts=0)
    try:
        with pytest.raises(shmvec.WorkerDiedError, match="max_restarts=0"):
            check_async_stream(envs, 20, fault_at=2, fault_env=1, fault=KILL, mode=DEFAULT_MODE,
                               reports_due=1)
    finally:
        envs.close()


def test_sb3_front_end_reports_restarts():
    pytest.importorskip("stable_baselines3")
    from shmvec.sb3 import ShmVecEnv as Sb3ShmVecEnv

    envs = Sb3ShmVecEnv([MAKE] * 4, num_workers=1, start_method="fork", restart_failed_workers=True)
    try:
        seen = envs.reset()
        kill_worker(envs, 0)
        envs.step_async(np.zeros(4, dtype=np.int64))
        obs, rewards, dones, infos = envs.step_wait()
        rows = list(envs._engine.worker_rows[0])
        assert dones.tolist() == [i in rows for i in range(4)]
        for i in rows:
            assert infos[i]["TimeLimit.truncated"] and infos[i]["shmvec_restarted"]
            assert_same(infos[i]["terminal_observation"], seen[i])
    finally:
        envs.close()
