"""The command cycle (shmvec/_engine/cycle.py), the state machine every front
end's calls run through: its transitions and errors on their own, then as
ShmVecEnv and the SB3 front end drive it."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from fault_envs import OK, RAISE, Boom, FaultEnv
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError

import shmvec
from shmvec._engine.cycle import ENV_RAISED, INTERRUPTED, CommandCycle, Phase
from shmvec.errors import ShmVecError


def make_cycle(strict: bool = True) -> CommandCycle:
    return CommandCycle(lambda: ClosedEnvironmentError("closed"), strict=strict)


def test_a_call_waits_then_returns_to_where_it_began():
    cycle = make_cycle()
    cycle.begin(Phase.WAITING_STEP)
    assert cycle.waiting and cycle.phase is Phase.WAITING_STEP
    with pytest.raises(AlreadyPendingCallError, match="pending call to `step`"):
        cycle.check_idle("reset_async")
    with pytest.raises(NoAsyncCallError, match="reset_wait"):
        cycle.check_waiting(Phase.WAITING_RESET)
    cycle.check_waiting(Phase.WAITING_STEP)
    cycle.finish()
    assert cycle.phase is Phase.IDLE


def test_a_half_done_batch_needs_a_full_reset_before_a_step():
    cycle = make_cycle()
    cycle.begin(Phase.WAITING_STEP)
    cycle.half_done(ENV_RAISED)
    assert cycle.phase is Phase.NEEDS_RESET
    with pytest.raises(RuntimeError, match="reset all envs"):
        cycle.check_steppable()
    cycle.begin(Phase.WAITING_CALL)  # calls may run, and come back to NEEDS_RESET
    cycle.finish()
    assert cycle.phase is Phase.NEEDS_RESET
    cycle.begin(Phase.WAITING_RESET)
    cycle.finish()
    cycle.reset_done()
    assert cycle.phase is Phase.IDLE
    cycle.check_steppable()


def test_a_cycle_that_is_not_strict_steps_on_after_a_half_done_batch():
    cycle = make_cycle(strict=False)  # SB3's, as DummyVecEnv
    cycle.begin(Phase.WAITING_STEP)
    cycle.half_done(INTERRUPTED)
    assert cycle.phase is Phase.IDLE


def test_broken_and_closed_refuse_everything_with_their_own_errors():
    cycle = make_cycle()
    cycle.break_("a worker died; close this vector env")
    for check in (cycle.check_usable, cycle.check_steppable, lambda: cycle.check_idle("call_async")):
        with pytest.raises(ShmVecError, match="a worker died"):
            check()
    assert cycle.close() is Phase.BROKEN
    cycle.break_("too late")  # a closed cycle stays closed
    for check in (cycle.check_usable, cycle.check_steppable, lambda: cycle.check_waiting(Phase.WAITING_STEP)):
        with pytest.raises(ClosedEnvironmentError):
            check()


def test_shmvec_env_moves_its_cycle(closing):
    envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 2, num_workers=1)
    closing(envs)
    cycle = envs._cycle
    envs.reset(seed=0)
    envs.step_async(np.zeros(2, dtype=np.int64))
    assert cycle.phase is Phase.WAITING_STEP
    envs.step_wait()
    assert cycle.phase is Phase.IDLE
    envs.close()
    assert cycle.phase is Phase.CLOSED


def test_an_env_error_in_a_step_needs_a_reset_under_gymnasium_not_under_sb3(closing):
    pytest.importorskip("stable_baselines3")
    from shmvec.sb3 import ShmVecEnv as SB3ShmVecEnv

    gym_envs = shmvec.ShmVecEnv([FaultEnv] * 2, num_workers=1)
    closing(gym_envs)
    gym_envs.reset(seed=0)
    with pytest.raises(Boom):
        gym_envs.step(np.array([OK, RAISE]))
    assert gym_envs._cycle.phase is Phase.NEEDS_RESET

    sb3_envs = SB3ShmVecEnv([FaultEnv] * 2, num_workers=1)
    closing(sb3_envs)
    sb3_envs.reset()
    sb3_envs.step_async(np.array([OK, RAISE]))
    with pytest.raises(Boom):
        sb3_envs.step_wait()
    assert sb3_envs._engine.cycle.phase is Phase.IDLE
    sb3_envs.step_async(np.array([OK, OK]))  # steps on, as DummyVecEnv
    sb3_envs.step_wait()
