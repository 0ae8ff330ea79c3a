"""Small deterministic envs for tests and benchmarks: any space, varied
infos, episode ends, optional delays. Importable in worker processes."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = ["SpacesEnv", "NoopEnv", "ImageEnv", "StragglerEnv", "digest"]


def digest(value: Any) -> float:
    """A number that depends on every part of a (nested) action, so that an
    action delivered wrongly changes the trajectory."""
    if isinstance(value, dict):
        return sum((k + 1) * digest(v) for k, v in enumerate(value.values()))
    if isinstance(value, (tuple, list)):
        return sum((k + 1) * digest(v) for k, v in enumerate(value))
    if isinstance(value, str):
        return float(sum(map(ord, value)))
    if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
        return float(np.sum(value.astype(np.float64) * (1 + np.arange(value.size).reshape(value.shape))))
    if isinstance(value, (int, float, np.number, np.bool_)):
        return float(value)
    if hasattr(value, "nodes"):  # GraphInstance
        return digest(value.nodes) + digest(value.edges if value.edges is not None else 0)
    return 0.0


class SpacesEnv(gym.Env):
    """Observations sampled from any space with the env's own RNG; rewards
    depend on the actions; random terminations, truncation after
    `max_steps`; infos of several kinds on some steps."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, observation_space: spaces.Space | None = None, action_space: spaces.Space | None = None,
                 max_steps: int = 20, terminate_prob: float = 0.05, infos: bool = True,
                 render_mode: str | None = None):
        self.observation_space = observation_space or spaces.Box(-1, 1, (3,), np.float32)
        self.action_space = action_space or spaces.Discrete(3)
        self.max_steps = max_steps
        self.terminate_prob = terminate_prob
        self.infos = infos
        self.render_mode = render_mode
        self.t = 0
        self.total = 0.0

    def _obs(self):
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        return self.observation_space.sample()

    def _info(self, kind: int) -> dict:
        if not self.infos:
            return {}
        r = self.np_random.random()
        if r < 0.5:
            return {}
        if r < 0.7:
            return {"t": self.t, "total": float(self.total)}
        if r < 0.85:
            return {"vec": np.full(2, self.t, dtype=np.int32), "flag": bool(kind)}
        return {"nested": {"depth": np.float32(self.total), "name": f"s{self.t}"}, "t": self.t}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.total = 0.0
        if options and "start" in options:
            self.total = float(options["start"])
        return self._obs(), self._info(0)

    def step(self, action):
        self.t += 1
        value = digest(action)
        self.total += value
        reward = float(self.np_random.normal()) + 1e-3 * value
        terminated = bool(self.np_random.random() < self.terminate_prob)
        truncated = self.t >= self.max_steps
        return self._obs(), reward, terminated, truncated, self._info(1)

    def render(self):
        frame = np.zeros((8, 8, 3), dtype=np.uint8)
        frame[..., 0] = self.t % 256
        return frame


class NoopEnv(gym.Env):
    """An env whose step does nothing: the pure overhead of vectorization."""

    observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self):
        self._obs = np.zeros(4, dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self._obs, {}

    def step(self, action):
        return self._obs, 0.0, False, False, {}


class ImageEnv(gym.Env):
    """84x84x4 uint8 frames (Atari-sized) that change every step."""

    observation_space = spaces.Box(0, 255, (84, 84, 4), np.uint8)
    action_space = spaces.Discrete(4)

    def __init__(self, max_steps: int = 1000):
        self.max_steps = max_steps
        self._frame = np.zeros((84, 84, 4), dtype=np.uint8)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self._frame[:] = self.np_random.integers(0, 255, dtype=np.uint8)
        return self._frame.copy(), {}

    def step(self, action):
        self.t += 1
        self._frame[self.t % 84] = (self.t + int(action)) % 256
        return self._frame.copy(), 1.0, False, self.t >= self.max_steps, {}


class StragglerEnv(gym.Env):
    """Sleeps `base_ms` most steps and `slow_ms` with probability `slow_prob`
    (the env waits, it does not burn CPU), like a simulator with hiccups."""

    observation_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, base_ms: float = 0.5, slow_ms: float = 20.0, slow_prob: float = 0.05,
                 max_steps: int = 200):
        self.base_s = base_ms / 1000
        self.slow_s = slow_ms / 1000
        self.slow_prob = slow_prob
        self.max_steps = max_steps
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        slow = self.np_random.random() < self.slow_prob
        time.sleep(self.slow_s if slow else self.base_s)
        obs = np.full(4, self.t, dtype=np.float32)
        return obs, 1.0, False, self.t >= self.max_steps, {}
