"""restart_failed_workers=True: a worker that dies or hangs is replaced; the
failed step reports its envs as truncated and restarted, the others are
unaffected; a restart budget turns a crash loop into WorkerDiedError."""

from __future__ import annotations

import functools
import os
import signal

import numpy as np
import pytest
from helpers import FINAL_OBS, MODES, SAME_STEP, assert_same, mode_id, sync_pair

import shmvec
from shmvec._gym_compat import AutoresetMode
from shmvec.testing import SpacesEnv, StragglerEnv

MAKE = functools.partial(SpacesEnv, max_steps=1000, terminate_prob=0.0, infos=False)


def kill_worker(envs, w):
    os.kill(envs._engine._processes[w].pid, signal.SIGKILL)


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
        # The restarted ones: reset, truncated, flagged.
        assert truncs[rows].all() and not terms[rows].any() and (rewards[rows] == 0).all()
        assert infos["_shmvec_restarted"].tolist() == [i in rows for i in range(6)]
        assert envs.get_attr("t")[4:] == (0, 0)
        if mode is SAME_STEP:
            for i in rows:
                assert_same(infos[FINAL_OBS][i], seen[i])
        # Not reset again on the next step (NEXT_STEP): their episodes go on.
        if mode is AutoresetMode.DISABLED:
            envs.reset(options={"reset_mask": np.array([i in rows for i in range(6)])})
        envs.step(actions)
        assert envs.get_attr("t")[4:] == (1, 1)
        assert envs._engine.restarts == 1
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
        assert "SIGKILL" in str(info.value)
        with pytest.raises(shmvec.ShmVecError):
            envs.step(np.zeros(2, dtype=np.int64))
    finally:
        envs.close()


def test_death_during_call_restarts_and_reports():
    envs = shmvec.ShmVecEnv([MAKE] * 4, num_workers=2, caller_steps=False, start_method="fork",
                            restart_failed_workers=True)
    try:
        envs.reset(seed=0)
        with pytest.raises(shmvec.ShmVecError, match="restarted"):
            envs.call("__class__")  # warm-up is fine; now kill during a call:
            kill_worker(envs, 1)
            envs.call("render")
        assert envs.get_attr("t") == (0, 0, 0, 0)  # usable again
        envs.step(np.zeros(4, dtype=np.int64))
    finally:
        envs.close()


def test_async_mode_refuses_restarts():
    with pytest.raises(ValueError, match="async"):
        shmvec.ShmVecEnv([MAKE] * 4, batch_size=2, restart_failed_workers=True)


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
