"""The vector envs that ``shmvec bench`` and ``bench/`` compare: shmvec and
its peers, each built the same way from one env spec.

An env spec is a registered Gymnasium id (``"CartPole-v1"``, or
``"module:EnvId"`` whose module registers it) or a ``"module:callable"``
that returns an env (``"shmvec.testing:NoopEnv"``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from shmvec._system import usable_cpus

__all__ = ["Peer", "PEERS", "PROCESS_PER_ENV_CAP", "env_factory", "build", "single_action_space"]

# Peers that start one process per env take minutes and gigabytes beyond this.
PROCESS_PER_ENV_CAP = 128


def env_factory(spec: str) -> Callable[[], gym.Env]:
    """A picklable callable that makes one env of `spec`; raises ValueError
    with a clear message for a spec that names nothing."""
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
    return functools.partial(gym.make, spec)


def _shmvec(spec: str, num_envs: int, start_method: str | None, **options):
    from shmvec import ShmVecEnv

    return ShmVecEnv([env_factory(spec)] * num_envs, start_method=start_method, **options)


def _sync(spec: str, num_envs: int, start_method: str | None):
    return gym.vector.SyncVectorEnv([env_factory(spec)] * num_envs)


def _async(spec: str, num_envs: int, start_method: str | None):
    return gym.vector.AsyncVectorEnv([env_factory(spec)] * num_envs, shared_memory=True,
                                     context=start_method or "fork")


def _dummy(spec: str, num_envs: int, start_method: str | None):
    from stable_baselines3.common.vec_env import DummyVecEnv

    return DummyVecEnv([env_factory(spec)] * num_envs)


def _subproc(spec: str, num_envs: int, start_method: str | None):
    from stable_baselines3.common.vec_env import SubprocVecEnv

    return SubprocVecEnv([env_factory(spec)] * num_envs, start_method=start_method or "fork")


def _envpool(spec: str, num_envs: int, start_method: str | None):
    import envpool

    # Its spaces, made on first use, have float64 bounds that gymnasium warns about.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = envpool.make(spec, env_type="gymnasium", num_envs=num_envs, num_threads=usable_cpus())
        envs.observation_space, envs.action_space  # noqa: B018  (made and cached now)
    return envs


def _envpool_lacks(spec: str) -> str | None:
    if ":" in spec:
        return "envpool runs only its own C++ envs"
    import envpool

    if spec not in envpool.list_all_envs():
        return f"envpool has no built-in {spec} (it runs only its own C++ envs)"
    return None


@dataclass(frozen=True)
class Peer:
    name: str
    label: str
    make: Callable[..., Any]  # (spec, num_envs, start_method, **options)
    requires: str | None = None  # an optional package it needs, and how to install it
    install: str = ""
    max_envs: int | None = None
    lacks: Callable[[str], str | None] | None = None  # why it cannot run an env spec

    def unavailable(self, spec: str) -> str | None:
        """Why this peer cannot run `spec` here, or None."""
        if self.requires and importlib.util.find_spec(self.requires) is None:
            return f"{self.name}: {self.requires} is not installed ({self.install})"
        reason = self.lacks(spec) if self.lacks else None
        return f"{self.name}: {reason}" if reason else None


_SB3 = {"requires": "stable_baselines3", "install": "pip install stable-baselines3"}

PEERS: dict[str, Peer] = {p.name: p for p in [
    Peer("shmvec", "shmvec ShmVecEnv", _shmvec),
    Peer("sync", "gymnasium SyncVectorEnv", _sync),
    Peer("async", "gymnasium AsyncVectorEnv", _async, max_envs=PROCESS_PER_ENV_CAP),
    Peer("dummy", "SB3 DummyVecEnv", _dummy, **_SB3),
    Peer("subproc", "SB3 SubprocVecEnv", _subproc, **_SB3, max_envs=PROCESS_PER_ENV_CAP),
    Peer("envpool", "EnvPool (own C++ envs)", _envpool, requires="envpool", install="pip install envpool",
         lacks=_envpool_lacks),
]}


def build(peer: str, spec: str, num_envs: int, *, start_method: str | None = None, **options) -> Any:
    """A vector env of `num_envs` envs of `spec` from `peer` (a key of PEERS).

    `start_method` applies to peers that start processes; those with a
    process per env default to fork, which starts them fast and does not
    change how they step. `options` go to ``ShmVecEnv`` (``num_workers``,
    ``caller_steps``, ...); other peers take none.
    """
    if options and peer != "shmvec":
        raise TypeError(f"{peer} takes no options, got {sorted(options)}")
    return PEERS[peer].make(spec, num_envs, start_method, **options)


def single_action_space(envs: Any) -> gym.Space:
    """One env's action space, whichever API `envs` follows (SB3 calls it
    `action_space`)."""
    return getattr(envs, "single_action_space", None) or envs.action_space
