"""The vector envs that ``shmvec bench`` and ``bench/`` compare: shmvec and
its peers, each built the same way from one env spec.

An env spec is a registered Gymnasium id (``"CartPole-v1"``, or
``"module:EnvId"`` whose module registers it; ``"ALE/..."`` ids register
ale-py's envs first) or a ``"module:callable"`` that returns an env
(``"shmvec.testing:NoopEnv"``). ``atari=True`` wraps each env of an ALE id in
Gymnasium's standard Atari pipeline (see `atari_env`), which the native
Atari peers (ale-py's vector env, EnvPool) do in C++.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from shmvec._engine.system import usable_cpus
from shmvec.bench.printed import made_printing_apart

__all__ = ["Peer", "PEERS", "PROCESS_PER_ENV_CAP", "REAL_INSTALL", "env_factory", "atari_env", "make_env",
           "workload_missing", "build", "single_action_space"]

# Peers that start one process per env take minutes and gigabytes beyond this.
PROCESS_PER_ENV_CAP = 128

REAL_INSTALL = 'pip install "shmvec[bench-real]"'  # Atari and MuJoCo workloads and their native peers


def _register_ale() -> None:
    """Gymnasium 1.x finds ALE ids only once ale-py registered them, in each process."""
    import ale_py

    gym.register_envs(ale_py)


def make_env(spec_id: str) -> gym.Env:
    """`gym.make(spec_id)`, registering ale-py's ids first when it names one
    (worker processes start without them)."""
    if spec_id.startswith("ALE/"):
        _register_ale()
    return gym.make(spec_id)


def atari_env(spec_id: str) -> gym.Env:
    """Gymnasium's standard Atari pipeline, as in its docs and CleanRL:
    no frame skip in the emulator, then AtariPreprocessing (4 frames max-pooled,
    84x84 grayscale, up to 30 no-ops at reset) and a stack of 4 frames."""
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    _register_ale()
    env = gym.make(spec_id, frameskip=1)
    env = AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True)
    return FrameStackObservation(env, 4)


def workload_missing(spec: str, atari: bool = False) -> str | None:
    """What an optional package a workload needs is missing, as a note, or None."""
    if (atari or spec.startswith("ALE/")) and importlib.util.find_spec("ale_py") is None:
        return f"{spec}: ale-py is not installed ({REAL_INSTALL})"
    if atari and importlib.util.find_spec("cv2") is None:
        return f"{spec}: AtariPreprocessing needs OpenCV, which is not installed ({REAL_INSTALL})"
    if ":" not in spec and not spec.startswith("ALE/") and importlib.util.find_spec("mujoco") is None:
        try:
            entry_point = str(gym.spec(spec).entry_point)
        except gym.error.Error:
            return None
        if "mujoco" in entry_point:
            return f"{spec}: mujoco is not installed ({REAL_INSTALL})"
    return None


def env_factory(spec: str, atari: bool = False) -> Callable[[], gym.Env]:
    """A picklable callable that makes one env of `spec` (in Gymnasium's
    Atari pipeline when `atari`); raises ValueError with a clear message for
    a spec that names nothing. Under the bench's measuring processes, each
    process that makes one prints into a file of its own (see `printed`)."""
    return made_printing_apart(_factory(spec, atari))


def _factory(spec: str, atari: bool) -> Callable[[], gym.Env]:
    if spec.startswith("ALE/") or atari:
        if importlib.util.find_spec("ale_py") is None:
            raise ValueError(f"{spec!r} needs ale-py, which is not installed ({REAL_INSTALL})")
        _register_ale()
    if atari:
        if ":" in spec or not gym.spec(spec).id.startswith("ALE/"):
            raise ValueError(f"--atari takes ALE ids (such as ALE/Pong-v5), got {spec!r}")
        return functools.partial(atari_env, spec)
    module_name, _, name = spec.rpartition(":")
    if module_name:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"cannot import {module_name!r} for {spec!r}: {exc}") from None
        factory = getattr(module, name, None)
        if callable(factory):
            return factory
    try:  # gymnasium's own "module:EnvId" too, whose module registers the id
        gym.spec(name)
    except gym.error.Error as exc:
        if module_name:
            raise ValueError(f"{module_name} has no callable {name!r} and registers no env id {name!r}") from None
        raise ValueError(f"{spec!r} is not a registered gymnasium env id ({exc})") from None
    return functools.partial(make_env, spec)


def _shmvec(spec: str, num_envs: int, start_method: str | None, atari: bool, **options):
    from shmvec import ShmVecEnv

    return ShmVecEnv([env_factory(spec, atari)] * num_envs, start_method=start_method, **options)


def _sync(spec: str, num_envs: int, start_method: str | None, atari: bool):
    return gym.vector.SyncVectorEnv([env_factory(spec, atari)] * num_envs)


def _async(spec: str, num_envs: int, start_method: str | None, atari: bool):
    return gym.vector.AsyncVectorEnv([env_factory(spec, atari)] * num_envs, shared_memory=True,
                                     context=start_method or "fork")


def _dummy(spec: str, num_envs: int, start_method: str | None, atari: bool):
    from stable_baselines3.common.vec_env import DummyVecEnv

    return DummyVecEnv([env_factory(spec, atari)] * num_envs)


def _subproc(spec: str, num_envs: int, start_method: str | None, atari: bool):
    from stable_baselines3.common.vec_env import SubprocVecEnv

    return SubprocVecEnv([env_factory(spec, atari)] * num_envs, start_method=start_method or "fork")


def _envpool_id(spec: str) -> str:
    return spec.removeprefix("ALE/")  # EnvPool names Atari games without the namespace


def _envpool(spec: str, num_envs: int, start_method: str | None, atari: bool):
    import envpool

    # Its spaces, made on first use, have float64 bounds that gymnasium warns about.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = envpool.make(_envpool_id(spec), env_type="gymnasium", num_envs=num_envs, num_threads=usable_cpus())
        envs.observation_space, envs.action_space  # noqa: B018  (made and cached now)
    return envs


def _envpool_lacks(spec: str, atari: bool) -> str | None:
    if ":" in spec:
        return "envpool runs only its own C++ envs"
    if spec.startswith("ALE/") and not atari:
        return f"envpool preprocesses Atari frames itself: compare it on {spec} with --atari"
    import envpool

    if _envpool_id(spec) not in envpool.list_all_envs():
        return f"envpool has no built-in {spec} (it runs only its own C++ envs)"
    return None


def _ale_game(spec: str) -> str:
    """ale-py's ROM name of an ALE id: "ALE/SpaceInvaders-v5" -> "space_invaders"."""
    name = spec.removeprefix("ALE/").split("-v")[0]
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _ale(spec: str, num_envs: int, start_method: str | None, atari: bool):
    """ale-py's own vector env, with the settings that match Gymnasium's
    Atari pipeline and ALE/*-v5 (sticky actions 0.25, no reward clipping, no
    fire reset, no episodic life); its threads preprocess the frames in C++."""
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv(_ale_game(spec), num_envs, num_threads=usable_cpus(), frameskip=4,
                          img_height=84, img_width=84, grayscale=True, stack_num=4, maxpool=True, noop_max=30,
                          episodic_life=False, reward_clipping=False, use_fire_reset=False,
                          repeat_action_probability=0.25)


def _ale_lacks(spec: str, atari: bool) -> str | None:
    if not (atari and spec.startswith("ALE/")):
        return "ale runs ALE ids with --atari only (its C++ preprocessing is Gymnasium's Atari pipeline)"
    return None


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    make: Callable[..., Any]  # (spec, num_envs, start_method, **options)
    requires: str | None = None  # an optional package it needs, and how to install it
    install: str = ""
    max_envs: int | None = None
    lacks: Callable[[str, bool], str | None] | None = None  # why it cannot run (spec, atari)
    takes_options: bool = False  # ShmVecEnv's keyword arguments
    is_vector_env: bool = True  # False: plain loops measured by measure.concurrent_limit, not build()

    def unavailable(self, spec: str, atari: bool = False) -> str | None:
        """Why this peer cannot run `spec` here, or None."""
        if self.requires and importlib.util.find_spec(self.requires) is None:
            return f"{self.name}: {self.requires} is not installed ({self.install})"
        reason = self.lacks(spec, atari) if self.lacks else None
        return f"{self.name}: {reason}" if reason else None


def _uncoupled(spec: str, num_envs: int, start_method: str | None, atari: bool):
    raise TypeError("uncoupled is not a vector env: the bench measures it with measure.concurrent_limit")


_SB3 = {"requires": "stable_baselines3", "install": "pip install stable-baselines3"}

PEERS: dict[str, Peer] = {p.name: p for p in [
    Peer("shmvec", "shmvec ShmVecEnv", _shmvec, takes_options=True),
    # async send/recv, batch_size < num_envs (the bench passes it)
    Peer("shmvec-async", "shmvec ShmVecEnv, async recv/send", _shmvec, takes_options=True),
    # pin_workers=False beside the default "auto" in one run (the bench passes it)
    Peer("shmvec-unpinned", "shmvec ShmVecEnv, workers unpinned", _shmvec, takes_options=True),
    Peer("sync", "gymnasium SyncVectorEnv", _sync),
    Peer("async", "gymnasium AsyncVectorEnv", _async, max_envs=PROCESS_PER_ENV_CAP),
    Peer("dummy", "SB3 DummyVecEnv", _dummy, **_SB3),
    Peer("subproc", "SB3 SubprocVecEnv", _subproc, **_SB3, max_envs=PROCESS_PER_ENV_CAP),
    Peer("envpool", "EnvPool (own C++ envs)", _envpool, requires="envpool", install="pip install envpool",
         lacks=_envpool_lacks),
    Peer("ale", "ale-py AtariVectorEnv (C++ preprocessing)", _ale, requires="ale_py", install=REAL_INSTALL,
         lacks=_ale_lacks),
    # Not a vector env: one plain loop per usable CPU over a fixed share of
    # the envs, none waiting for another (only when named; see concurrent_limit).
    Peer("uncoupled", "plain loops over fixed shares of the envs, none waiting", _uncoupled, is_vector_env=False),
]}


def build(peer: str, spec: str, num_envs: int, *, start_method: str | None = None, atari: bool = False,
          **options) -> Any:
    """A vector env of `num_envs` envs of `spec` from `peer` (a key of PEERS).

    `start_method` applies to peers that start processes; those with a
    process per env default to fork, which starts them fast and does not
    change how they step. `atari`: Gymnasium's Atari pipeline around each
    env (native peers do their own). `options` go to ``ShmVecEnv``
    (``num_workers``, ``caller_steps``, ``batch_size``, ...); other peers take none.
    """
    if options and not PEERS[peer].takes_options:
        raise TypeError(f"{peer} takes no options, got {sorted(options)}")
    return PEERS[peer].make(spec, num_envs, start_method, atari, **options)


def single_action_space(envs: Any) -> gym.Space:
    """One env's action space, whichever API `envs` follows (SB3 calls it
    `action_space`)."""
    return getattr(envs, "single_action_space", None) or envs.action_space
