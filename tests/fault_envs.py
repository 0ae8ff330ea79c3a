"""Small envs that fail on purpose, for the fault and bad-input tests, a
wrapper that records which processes stepped an env, and helpers that
inspect this process's children, fds and mappings.

Everything here is importable in worker processes under every start method
(tests/ is on sys.path of the test process, which spawn and forkserver
children inherit)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

# -- envs ---------------------------------------------------------------------

# FaultEnv actions: what an env does when it gets that action in step().
OK, RAISE, EXIT, KILL, HANG, GATE = range(6)


class Boom(Exception):
    """The exception the fault envs raise (a type of our own, so that a test
    can tell it reached the caller as itself)."""


class FaultEnv(gym.Env):
    """Observation: the number of steps since the last reset, in both entries.
    The action decides what step() does: OK steps; RAISE raises Boom; EXIT
    calls os._exit(3); KILL SIGKILLs its own process; HANG sleeps `hang_s`;
    GATE waits (up to `hang_s`) until the file `gate` exists, then steps.
    reset(options={"fail": True}) raises Boom, as does reset(seed=s) for
    s == `fail_seed`; so do explode() and, with `fail_factory`, the constructor."""

    observation_space = spaces.Box(-1e6, 1e6, (2,), np.float32)
    action_space = spaces.Discrete(6)

    def __init__(self, gate: str | None = None, hang_s: float = 60.0, fail_factory: bool = False,
                 fail_seed: int | None = None):
        if fail_factory:
            raise Boom("factory failed")
        self.fail_seed = fail_seed
        self.gate = gate
        self.hang_s = hang_s
        self.t = 0

    def _obs(self) -> np.ndarray:
        return np.full(2, self.t, dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if (options and options.get("fail")) or (seed is not None and seed == self.fail_seed):
            raise Boom("reset failed")
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        action = int(action)
        if action == RAISE:
            raise Boom("step failed")
        if action == EXIT:
            os._exit(3)
        if action == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        if action == HANG:
            time.sleep(self.hang_s)
        if action == GATE:
            deadline = time.monotonic() + self.hang_s
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        self.t += 1
        return self._obs(), 1.0, False, False, {}

    def pid(self) -> int:
        return os.getpid()

    def explode(self):
        raise Boom("call failed")

    def exit_now(self):
        os._exit(3)

    def hang(self):
        time.sleep(self.hang_s)


def failing_factory():
    raise Boom("factory failed")


class FailsOnceMarked(FaultEnv):
    """A FaultEnv whose constructor raises Boom while the file `marker`
    exists (a factory that fails when a worker is rebuilt)."""

    def __init__(self, marker: str):
        if os.path.exists(marker):
            raise Boom("factory failed")
        super().__init__()


class CloseRecorder(FaultEnv):
    """A FaultEnv whose close() takes `close_s`, then writes the file
    `marker` (so a test sees which envs finished closing); with `fail_close`
    it raises Boom instead."""

    def __init__(self, marker: str, close_s: float = 0.0, fail_close: bool = False):
        super().__init__()
        self.marker = marker
        self.close_s = close_s
        self.fail_close = fail_close

    def close(self):
        if self.fail_close:
            raise Boom("close failed")
        time.sleep(self.close_s)
        with open(self.marker, "w") as f:
            f.write(str(os.getpid()))


class ColumnInfoEnv(FaultEnv):
    """A FaultEnv whose steps return an info of numbers, {"t": steps since
    reset}, which travels in the arena's info columns; with `blob`, also a
    string of that many characters, and the info travels by pickle in a
    record (fetched from the worker when larger than its slot). Its GATE
    action SIGKILLs its process once the gate opens: a worker that dies
    while an env it stepped earlier waits for recv()."""

    def __init__(self, blob: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.blob = blob

    def step(self, action):
        if int(action) == GATE:
            obs, *_ = super().step(GATE)
            os.kill(os.getpid(), signal.SIGKILL)
        obs, reward, terminated, truncated, _ = super().step(action)
        info = {"t": self.t, "blob": "x" * self.blob} if self.blob else {"t": self.t}
        return obs, reward, terminated, truncated, info


def actions_for(num_envs: int, row: int | None = None, action: int = OK) -> np.ndarray:
    """OK for every env, `action` for env `row`."""
    a = np.full(num_envs, OK, dtype=np.int64)
    if row is not None:
        a[row] = action
    return a


def ctrl_c() -> None:
    """SIGINT to this process, as a terminal's Ctrl-C (workers ignore it)."""
    os.kill(os.getpid(), signal.SIGINT)


def then_ctrl_c(fn: Callable) -> Callable:
    """`fn`, followed by a Ctrl-C before its result can be stored: SIGINT to
    this process as `fn` returns (a KeyboardInterrupt at the caller's next
    bytecode, unless the caller holds Ctrl-C)."""

    def call(*args, **kwargs):
        result = fn(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return result

    return call


@contextlib.contextmanager
def later(*events: tuple[float, Callable[[], Any]]):
    """Runs each (delay, fn) that many seconds after entering, on timers; on
    exit, those not yet run never run (a test that fails early must not be
    hit by a Ctrl-C meant for later)."""
    timers = [threading.Timer(delay, fn) for delay, fn in events]
    for timer in timers:
        timer.start()
    try:
        yield
    finally:
        for timer in timers:
            timer.cancel()
            timer.join()


class ContractEnv(gym.Env):
    """Env `bad_row` of the batch breaks its contract in the way `kind` says,
    from its first step (or reset, for the reset_* kinds); the others behave.
    Observations depend on the step count and the env's row, episodes are
    truncated every 4 steps."""

    action_space = spaces.Discrete(2)

    def __init__(self, row: int, bad_row: int, kind: str, observation_space: spaces.Space | None = None):
        self.observation_space = observation_space or spaces.Box(-10, 10, (3,), np.float32)
        self.row, self.bad_row, self.kind = row, bad_row, kind
        self.t = 0

    def _obs(self, dtype=None, shape=None) -> np.ndarray:
        space = self.observation_space
        return np.full(space.shape if shape is None else shape, self.t + 0.25 * self.row,
                       dtype=space.dtype if dtype is None else dtype)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        if self.row == self.bad_row:
            if self.kind == "reset_three_values":
                return self._obs(), {}, 1
            if self.kind == "reset_obs_shape":
                return self._obs(shape=(4,)), {}
            if self.kind == "reset_info_none":
                return self._obs(), None
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        obs, reward, terminated, truncated, info = self._obs(), 1.0, False, self.t % 4 == 0, {}
        if self.row != self.bad_row:
            return obs, reward, terminated, truncated, info
        k = self.kind
        if k == "four_values":
            return obs, reward, terminated, info
        if k == "six_values":
            return obs, reward, terminated, truncated, info, None
        if k == "returns_none":
            return None
        if k == "obs_shape":
            obs = self._obs(shape=(4,))
        elif k == "obs_shape_2d":
            obs = self._obs(shape=(3, 1))
        elif k == "obs_scalar":
            obs = 1.0
        elif k == "obs_complex":
            obs = self._obs(dtype=np.complex128)
        elif k == "obs_str":
            obs = np.array(["a", "b", "c"])
        elif k == "obs_float_for_int":  # for an integer Box: float -> int is not a same-kind cast
            obs = self._obs(dtype=np.float64)
        elif k == "reward_none":
            reward = None
        elif k == "reward_str":
            reward = "one"
        elif k == "reward_array":
            reward = np.array([1.0, 2.0])
        elif k == "flags_array":
            terminated = np.array([True, False])
        elif k == "info_none":
            info = None
        elif k == "info_list":  # falsy, and not a mapping
            info = []
        return obs, reward, terminated, truncated, info


class CastEnv(gym.Env):
    """Returns values of other types than its spaces promise, all of them
    ones SyncVectorEnv casts: `obs_dtype` (numpy dtype, or "list" for a
    Python list) for the observation, `reward` and the flags of the given
    Python/numpy types. Episodes end (terminated) every 3 steps, so the
    autoreset paths write observations too."""

    action_space = spaces.Discrete(3)

    def __init__(self, row: int, space_dtype, obs_dtype, reward_type=float, flag_type=bool):
        self.observation_space = spaces.Box(-100, 100, (2, 2), space_dtype)
        self.row = row
        self.obs_dtype = obs_dtype
        self.reward_type = reward_type
        self.flag_type = flag_type
        self.t = 0

    def _obs(self) -> Any:
        values = np.array([[self.t, self.row], [self.t * 0.5 + 0.25, -self.t]], dtype=np.float64)
        if self.obs_dtype == "list":
            return values.tolist()
        return values.astype(self.obs_dtype)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        reward = self.reward_type(self.t + int(action))
        terminated = self.flag_type(self.t % 3 == 0)
        truncated = self.flag_type(0)
        return self._obs(), reward, terminated, truncated, {}


class StepRecorder(gym.Wrapper):
    """Remembers the pids of the processes that stepped it: where an env
    really ran, whichever front end built it (read with ``get_attr``)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.stepped_by: set[int] = set()

    def step(self, action):
        self.stepped_by.add(os.getpid())
        return self.env.step(action)


def recorded_cartpole(config: dict) -> gym.Env:
    """CartPole under a StepRecorder, made from RLlib's ``env_config``."""
    return StepRecorder(gym.make("CartPole-v1", **config))


# -- process, fd and mapping inspection ---------------------------------------


def children(pid: int | None = None) -> list[int]:
    """Direct children of a process (this one by default), zombies included."""
    pid = os.getpid() if pid is None else pid
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return sorted(set(out))


def descendants(pid: int | None = None) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return sorted(out)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie (an exited process
    that nobody has reaped yet holds no resources but its pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids, timeout: float = 5.0) -> list[int]:
    """Waits until none of `pids` runs; returns those still running."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if running(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


# multiprocessing's helpers, which live as long as the process that started them
# (one fork server for start_method="forkserver", one resource tracker for
# forkserver and spawn); they are not shmvec's and stay after close().
MP_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def is_mp_helper(pid: int) -> bool:
    return any(h in cmdline(pid) for h in MP_HELPERS)


def open_fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the fd listdir itself used
            pass
    return out


def arena_mappings() -> list[str]:
    """Lines of /proc/self/maps that map a shmvec arena (or any memfd)."""
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if "shmvec-arena" in line or "/memfd:" in line]


def dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def worker_pids(envs) -> set[int]:
    """Pids of the processes that step `envs` (FaultEnv only), not the caller."""
    return set(envs.call("pid")) - {os.getpid()}


def lock_is_free(path: str) -> bool:
    """Whether nobody holds the flock of a CPU reservation file."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
