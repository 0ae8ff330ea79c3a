"""Async send/recv against lock-step stepping of the same envs, same run:
the straggler profile (most steps 0.5 ms, 5% of steps 20 ms; the env sleeps)
with 32 envs on 8 workers and with shmvec's default workers (on 2 CPUs one
worker and the caller's own slice: async mode's recv() steps the caller's
envs where lock-step's step() does), CartPole-v1 with batch_size = num_envs // 2, and
CartPole-v1 x256 without workers (a busy machine's default) in batches of 32:
there the caller steps every env either way, so async mode's ratio is what
its per-batch bookkeeping costs.

And a PPO-shaped loop in async mode (needs torch and MuJoCo): 8
HalfCheetahs in batches of 4, 256-256 MLPs choosing the actions, and an
update after each rollout that runs faster at torch's own threads, against
SyncVectorEnv stepping the same loop in lock-step, and against async mode
with torch held at the one CPU its default workers leave throughout
(``torch_threads=1``: what shmvec did for the updates too before it foresaw
them in async mode). The row "shmvec-async-recv-update" runs the
update between a rollout's last recv() and its send() instead of after the
send() (shmvec foresaw only the latter before 2026-11-29)."""

import functools
import time

import numpy as np
import pytest
from benchlib import record

from shmvec import ShmVecEnv
from shmvec.bench.peers import env_factory
from shmvec.testing import StragglerEnv

SECONDS = 3.0

CASES = {
    # case -> (factory, num_envs, num_workers, batch_size)
    "straggler-32": (functools.partial(StragglerEnv, base_ms=0.5, slow_ms=20, slow_prob=0.05), 32, 8, 8),
    "straggler-32-default-workers": (functools.partial(StragglerEnv, base_ms=0.5, slow_ms=20, slow_prob=0.05), 32,
                                     None, 8),
    "cartpole-async-64": (env_factory("CartPole-v1"), 64, None, 32),
    "cartpole-async-256-no-workers": (env_factory("CartPole-v1"), 256, 0, 32),
}


def lockstep_rate(envs, seconds):
    envs.reset(seed=0)
    actions = np.zeros(envs.num_envs, dtype=np.int64)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        envs.step(actions)
        steps += envs.num_envs
    return steps / (time.perf_counter() - start)


def async_rate(envs, seconds):
    envs.async_reset(seed=0)
    actions = np.zeros(envs.batch_size, dtype=np.int64)
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        env_ids = envs.recv()[4]["env_id"]
        envs.send(actions, env_ids)
        steps += len(env_ids)
    return steps / (time.perf_counter() - start)


@pytest.mark.parametrize("mode", ["lockstep", "async"])
@pytest.mark.parametrize("case", CASES)
def test_async_vs_lockstep(benchmark, case, mode):
    make, num_envs, workers, batch = CASES[case]
    kwargs = {"num_workers": workers} if workers is not None else {}
    if mode == "async":
        envs = ShmVecEnv([make] * num_envs, batch_size=batch, **kwargs)
        run = async_rate
    else:
        envs = ShmVecEnv([make] * num_envs, **kwargs)
        run = lockstep_rate
    try:
        benchmark.group = case
        rate = benchmark.pedantic(run, args=(envs, SECONDS), rounds=1, iterations=1)
        record(benchmark, case, f"shmvec-{mode}", rate, "steps_per_s")
    finally:
        envs.close()


# The PPO-shaped loop: rollouts of ROLLOUT batches of 8 envs' steps, each
# followed by an update (EPOCHS passes over the rollout's samples, as one
# minibatch). UPDATES_WARM rollouts come first: two show the updates' period
# (three with the update after a recv(), whose first comes one step later),
# six are torch_threads' trials, the rest follow its choice.
PPO_ENVS, PPO_BATCH, ROLLOUT, EPOCHS = 8, 4, 256, 10
UPDATES_WARM, UPDATES_TIMED = 10, 6


def ppo_shaped_rate(who: str) -> float:
    """Steps/s of UPDATES_TIMED rollouts and their updates (see above),
    torch at its own threads unless shmvec holds them."""
    torch = pytest.importorskip("torch")
    import gymnasium as gym

    def mlp(inputs, outputs):
        return torch.nn.Sequential(torch.nn.Linear(inputs, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                   torch.nn.Tanh(), torch.nn.Linear(256, outputs))

    torch.manual_seed(0)
    make = env_factory("HalfCheetah-v5")
    if who == "sync":
        envs = gym.vector.SyncVectorEnv([make] * PPO_ENVS)
    else:
        # "held": torch at the one thread "auto" holds it to beside async mode's default workers
        # (one per CPU but one), for the updates too.
        held = {"torch_threads": 1} if who.endswith("held") else {}
        envs = ShmVecEnv([make] * PPO_ENVS, batch_size=PPO_BATCH, **held)
    obs_size, act_size = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    policy, value = mlp(obs_size, act_size), mlp(obs_size, 1)
    optimizer = torch.optim.Adam([*policy.parameters(), *value.parameters()], lr=3e-4)
    samples = torch.randn(ROLLOUT * PPO_ENVS, obs_size)

    def act(obs):
        with torch.no_grad():
            return policy(torch.as_tensor(obs, dtype=torch.float32)).clamp(-1, 1).numpy()

    obs = None  # lock-step's observations between rollouts

    def update():
        for _ in range(EPOCHS):
            loss = policy(samples).pow(2).mean() + value(samples).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def lock_step_cycle():
        nonlocal obs
        for _ in range(ROLLOUT):
            obs = envs.step(act(obs))[0]
        update()

    def async_cycle():
        batches = ROLLOUT * PPO_ENVS // PPO_BATCH
        for k in range(batches):
            batch, *_, infos = envs.recv()
            if k == batches - 1 and who.endswith("recv-update"):
                update()
            envs.send(act(batch), infos["env_id"])
        if not who.endswith("recv-update"):
            update()

    try:
        if who == "sync":
            obs = envs.reset(seed=0)[0]
            cycle = lock_step_cycle
        else:
            envs.async_reset(seed=0)
            cycle = async_cycle
        for _ in range(UPDATES_WARM):
            cycle()
        start = time.perf_counter()
        for _ in range(UPDATES_TIMED):
            cycle()
        return UPDATES_TIMED * ROLLOUT * PPO_ENVS / (time.perf_counter() - start)
    finally:
        envs.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("who", ["sync", "shmvec-async", "shmvec-async-recv-update", "shmvec-async-held"])
def test_async_ppo_shaped_loop(benchmark, who):
    pytest.importorskip("mujoco")
    case = f"async-ppo-mujoco-{PPO_ENVS}"
    benchmark.group = case
    rate = benchmark.pedantic(ppo_shaped_rate, args=(who,), rounds=1, iterations=1)
    record(benchmark, case, who, rate, "steps_per_s")
