"""SB3 on CartPole through DummyVecEnv, SubprocVecEnv and shmvec.sb3.ShmVecEnv:
PPO's wall time per 100k steps (the policy's time between steps included),
and stepping alone (step_async/step_wait with fixed actions).

And PPO with its CnnPolicy on 8 Pongs (rl-zoo's Atari settings; needs
ale-py, from the ``bench-real`` extra), and with 256-256 MLPs on 8
HalfCheetahs (needs MuJoCo, the same extra), and SAC with its defaults on
4 HalfCheetahs (a gradient step after every step), torch at its default
threads, as users run them: steps/s of the whole loop, the updates included.

Sizes are set by environment variables, so that a smoke run is quick:
``SHMVEC_BENCH_SB3_PPO_STEPS`` (PPO steps per run, default 100000),
``SHMVEC_BENCH_SB3_ATARI_STEPS`` (default 4096),
``SHMVEC_BENCH_SB3_MUJOCO_STEPS`` (default 16384),
``SHMVEC_BENCH_SB3_SAC_STEPS`` (default 4000) and
``SHMVEC_BENCH_SB3_STEPS`` (env steps per timed round of stepping alone,
default 100000; ``SHMVEC_BENCH_SB3_ROUNDS`` rounds, default 3).

    SHMVEC_BENCH_SB3_PPO_STEPS=2048 SHMVEC_BENCH_SB3_ATARI_STEPS=1024 SHMVEC_BENCH_SB3_MUJOCO_STEPS=4096 \
        SHMVEC_BENCH_SB3_SAC_STEPS=1000 SHMVEC_BENCH_SB3_STEPS=5000 pytest bench/test_bench_sb3.py
"""

from __future__ import annotations

import functools
import os

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("stable_baselines3")

import torch
from benchlib import record
from stable_baselines3 import PPO
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

from shmvec.sb3 import ShmVecEnv

PPO_STEPS = int(os.environ.get("SHMVEC_BENCH_SB3_PPO_STEPS", "100000"))
TORCH_THREADS = torch.get_num_threads()  # torch's own count, before any test holds it
ATARI_STEPS = int(os.environ.get("SHMVEC_BENCH_SB3_ATARI_STEPS", "4096"))
MUJOCO_STEPS = int(os.environ.get("SHMVEC_BENCH_SB3_MUJOCO_STEPS", "16384"))
SAC_STEPS = int(os.environ.get("SHMVEC_BENCH_SB3_SAC_STEPS", "4000"))
STEPS = int(os.environ.get("SHMVEC_BENCH_SB3_STEPS", "100000"))
ROUNDS = int(os.environ.get("SHMVEC_BENCH_SB3_ROUNDS", "3"))
SIZES = [8, 64]

VEC_ENVS = {
    "dummy": DummyVecEnv,
    # fork: 64 processes that each import SB3 and torch would take minutes to start
    "subproc": functools.partial(SubprocVecEnv, start_method="fork"),
    "shmvec": ShmVecEnv,
}


def ppo(venv) -> PPO:
    """PPO with rl-zoo's CartPole settings, logging nowhere (by default SB3
    makes a folder in the system's temp dir for every learn())."""
    model = PPO("MlpPolicy", venv, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
                ent_coef=0.0, learning_rate=1e-3, seed=0, device="cpu")
    model.set_logger(Logger(folder=None, output_formats=[]))
    return model


@pytest.fixture(scope="module")
def torch_ready():
    """One torch thread (the envs' processes get the other cores, and idle
    OpenMP threads do not spin against them), and torch's first-use costs
    paid before any clock starts rather than by whichever run comes first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    venv = DummyVecEnv([functools.partial(gym.make, "CartPole-v1")] * 8)
    ppo(venv).learn(2048)
    venv.close()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def vec_env():
    built = []

    def make(who: str, num_envs: int):
        built.append(VEC_ENVS[who]([functools.partial(gym.make, "CartPole-v1")] * num_envs))
        return built[-1]

    yield make
    for venv in built:
        venv.close()


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("who", list(VEC_ENVS))
@pytest.mark.parametrize("num_envs", SIZES)
def test_ppo_wall_time(benchmark, torch_ready, vec_env, num_envs, who):
    """One PPO run; seconds per 100k steps."""
    model = ppo(vec_env(who, num_envs))
    benchmark.group = f"sb3-ppo-{num_envs}"
    benchmark.pedantic(model.learn, args=(PPO_STEPS,), rounds=1, iterations=1)
    if not benchmark.disabled:  # else nothing was timed
        record(benchmark, f"sb3-ppo-{num_envs}", who, benchmark.stats.stats.median * 100_000 / PPO_STEPS, "seconds")


def learn_at_torch_threads(benchmark, group: str, who: str, make_venv, make_model, warm_up: int, steps: int) -> None:
    """Times `steps` of a model's learn() (after `warm_up` steps) with torch at
    its own threads (not torch_ready's one), as users run it; records
    `who`'s steps/s under `group`."""
    held = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    venv = None
    try:
        venv = make_venv()
        model = make_model(venv)
        model.set_logger(Logger(folder=None, output_formats=[]))
        model.learn(warm_up)
        benchmark.group = group
        # (SAC's learning_starts counts from the first learn())
        benchmark.pedantic(model.learn, args=(steps,), kwargs={"reset_num_timesteps": False}, rounds=1, iterations=1)
        if not benchmark.disabled:  # else nothing was timed
            record(benchmark, group, who, steps / benchmark.stats.stats.median, "steps_per_s")
    finally:
        if venv is not None:
            venv.close()
        torch.set_num_threads(held)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("who", list(VEC_ENVS))
def test_ppo_atari_steps_per_s(benchmark, who):
    """PPO with its CnnPolicy on 8 Pongs: a large policy, whose forward pass
    and update need torch's threads (shmvec's torch_threads gives them back
    once it has timed the caller's gaps between steps)."""
    pytest.importorskip("ale_py")
    from stable_baselines3.common.env_util import make_atari_env
    from stable_baselines3.common.vec_env import VecFrameStack

    learn_at_torch_threads(
        benchmark, "sb3-ppo-atari-8", who,
        # "ale_py:" makes each worker import ale-py, which registers the ids.
        lambda: VecFrameStack(make_atari_env("ale_py:PongNoFrameskip-v4", n_envs=8, seed=0,
                                             vec_env_cls=VEC_ENVS[who]), n_stack=4),
        lambda venv: PPO("CnnPolicy", venv, n_steps=128, n_epochs=4, batch_size=256, learning_rate=2.5e-4,
                         clip_range=0.1, vf_coef=0.5, ent_coef=0.01, seed=0, device="cpu"),
        warm_up=1024,  # a rollout and its update, shmvec's timing of the gaps included
        steps=ATARI_STEPS)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("who", list(VEC_ENVS))
def test_ppo_mujoco_steps_per_s(benchmark, who):
    """PPO on 8 HalfCheetahs with 256-256 MLPs (rl-zoo's HalfCheetah
    settings, but minibatches of 2048): a policy quick between steps whose
    update needs torch's threads (shmvec's torch_threads holds them while
    the workers step and gives them back for the updates it foresees, once
    it has timed both ways)."""
    pytest.importorskip("mujoco")
    from torch import nn
    from stable_baselines3.common.vec_env import VecNormalize

    learn_at_torch_threads(
        benchmark, "sb3-ppo-mujoco-8", who,
        lambda: VecNormalize(VEC_ENVS[who]([functools.partial(gym.make, "HalfCheetah-v5")] * 8), gamma=0.98),
        lambda venv: PPO("MlpPolicy", venv, n_steps=512, batch_size=2048, gamma=0.98, learning_rate=2.0633e-05,
                         ent_coef=0.000401762, clip_range=0.1, n_epochs=20, gae_lambda=0.92, max_grad_norm=0.8,
                         vf_coef=0.58096, seed=0, device="cpu",
                         policy_kwargs=dict(log_std_init=-2, ortho_init=False, activation_fn=nn.ReLU,
                                            net_arch=dict(pi=[256, 256], vf=[256, 256]))),
        # Nine rollouts: two updates show their period, six are timed both ways (torch_threads' trials).
        warm_up=9 * 512 * 8,
        steps=MUJOCO_STEPS)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("who", list(VEC_ENVS))
def test_sac_mujoco_steps_per_s(benchmark, who):
    """SAC with SB3's defaults on 4 HalfCheetahs: random actions until
    `learning_starts`, then a gradient step (256-256 MLPs, batches of 256)
    after every step, about 10 ms on 2 vCPUs against the envs' 0.2 ms. The
    workers sleep through each gap, so every step pays their wake-up; shmvec
    has little to gain here and must not lose."""
    pytest.importorskip("mujoco")
    from stable_baselines3 import SAC

    learn_at_torch_threads(
        benchmark, "sb3-sac-mujoco-4", who,
        lambda: VEC_ENVS[who]([functools.partial(gym.make, "HalfCheetah-v5")] * 4),
        lambda venv: SAC("MlpPolicy", venv, learning_starts=1000, seed=0, device="cpu"),
        warm_up=3000,  # learning_starts, then enough updates for torch_threads' trials
        steps=SAC_STEPS)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("who", list(VEC_ENVS))
@pytest.mark.parametrize("num_envs", SIZES)
def test_step_alone(benchmark, vec_env, num_envs, who):
    """step_async/step_wait with fixed actions, made beforehand."""
    venv = vec_env(who, num_envs)
    rng = np.random.default_rng(0)
    actions = [rng.integers(0, 2, num_envs) for _ in range(64)]
    batches = max(1, STEPS // num_envs)

    def run(count: int) -> None:
        for k in range(count):
            venv.step_async(actions[k % len(actions)])
            venv.step_wait()

    venv.reset()
    run(max(1, batches // 10))  # warm-up: caches, spin budgets, lazy imports
    benchmark.group = f"sb3-step-{num_envs}"
    benchmark.pedantic(run, args=(batches,), rounds=ROUNDS, iterations=1)
    if not benchmark.disabled:  # else nothing was timed
        record(benchmark, f"sb3-step-{num_envs}", who, batches * num_envs / benchmark.stats.stats.median, "steps_per_s")
