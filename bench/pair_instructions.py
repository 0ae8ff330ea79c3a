"""A fixed number of async ``recv()``/``send()`` pairs, to count what the
caller runs per pair. Instructions do not drift the way a VM's timings do:

    export OPENBLAS_NUM_THREADS=1 PYTHONHASHSEED=0
    valgrind --tool=callgrind --callgrind-out-file=cg.500 python bench/pair_instructions.py infos --pairs 500
    valgrind --tool=callgrind --callgrind-out-file=cg.2500 python bench/pair_instructions.py infos --pairs 2500
    callgrind_annotate cg.500 | grep TOTALS; callgrind_annotate cg.2500 | grep TOTALS

A pair costs (the second total - the first) / 2000. Valgrind follows the
caller only; its one worker runs natively, far ahead of it, so the caller
never waits. Envs (each step takes next to nothing): ``noop``
(``shmvec.testing.NoopEnv``, a ``Discrete`` action, no infos), ``box`` (a
``Box(6,)`` float32 action, no infos) and ``infos`` (the same, returning
HalfCheetah's four float infos every step, as MuJoCo envs do).
"""

from __future__ import annotations

import argparse
import functools

import gymnasium as gym
import numpy as np
from gymnasium import spaces

import shmvec
from shmvec.testing import NoopEnv, SpacesEnv

BOX_ACTION = spaces.Box(-1, 1, (6,), np.float32)


class InfoEveryStepEnv(gym.Env):
    """HalfCheetah's shapes and step infos, and nothing else."""

    observation_space = spaces.Box(-np.inf, np.inf, (17,), np.float64)
    action_space = BOX_ACTION

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.obs = np.zeros(17)
        return self.obs, {}

    def step(self, action):
        info = {"x_position": 0.1, "x_velocity": 0.2, "reward_forward": 0.3, "reward_ctrl": -0.1}
        return self.obs, 0.5, False, False, info


ENVS = {
    "noop": NoopEnv,
    "box": functools.partial(SpacesEnv, action_space=BOX_ACTION, infos=False, max_steps=10**9, terminate_prob=0.0),
    "infos": InfoEveryStepEnv,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env", nargs="?", choices=sorted(ENVS), default="noop")
    parser.add_argument("--num-envs", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=500)
    args = parser.parse_args()

    envs = shmvec.ShmVecEnv([ENVS[args.env]] * args.num_envs, num_workers=1, caller_steps=False,
                            batch_size=args.batch_size)  # the worker steps every env
    try:
        envs.async_reset(seed=0)
        space = envs.single_action_space
        actions = np.zeros((args.batch_size, *space.shape), space.dtype)
        for _ in range(args.pairs):
            env_ids = envs.recv()[4]["env_id"]
            envs.send(actions, env_ids)
    finally:
        envs.close()


if __name__ == "__main__":
    main()
