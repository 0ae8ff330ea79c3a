"""The envs of one slice and everything that can be done to them. A worker
process runs one; a caller that steps envs itself (``caller_steps=True``)
runs one in-process, through the same native stepper."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import gymnasium as gym
import numpy as np

from shmvec import _core
from shmvec._gym_compat import set_wrapper_attr
from shmvec._engine.caller_state import CallerRegistrations
from shmvec._engine.info_columns import INFO_STORAGE
from shmvec._engine.layout import (
    ACTION_AS_GIVEN, ACTION_AS_PYTHON, DataLayout, flattener, is_single_fixed_leaf, unflattener, write_leaf_fallback,
)

__all__ = ["EnvSlice", "AUTORESET_CODES", "COPY_FINAL_INFO_ARRAYS", "RESET_CALLS"]

# AutoresetMode -> the code the native stepper uses.
AUTORESET_CODES = {"NextStep": 0, "SameStep": 1, "Disabled": 2}
# Set on SameStep's code where the ended episode's info is batched before
# the env's reset, as Gymnasium 1.1+ does: the arrays it holds are copied
# then (kCopyFinalInfoArrays in csrc/stepper.hpp). SB3's VecEnvs and
# Gymnasium 0.29 keep the info itself.
COPY_FINAL_INFO_ARRAYS = 0x10

# The keywords each front end's peer passes to an env's reset() when asked to
# reset it (autoresets pass none, in the native stepper as in the peers). They
# differ, and an env whose reset() takes fewer than Gymnasium 1.x's
# (`def reset(self, seed=None)`) works only where they are the same:
# - "seed-and-options": Gymnasium 1.x's vector envs, both always;
# - "given": Gymnasium 0.29's, each only when it is not None;
# - "seed-and-set-options": SB3's VecEnvs, the seed always, options only when
#   set (a non-empty dict).
RESET_CALLS = {
    "seed-and-options": lambda seed, options: {"seed": seed, "options": options},
    "given": lambda seed, options: {name: value for name, value in (("seed", seed), ("options", options))
                                    if value is not None},
    "seed-and-set-options": lambda seed, options: {"seed": seed, "options": options} if options else {"seed": seed},
}


def _action_builder(action_space, action_views, action_codes):
    """Builds one env's action from the arena and `objects` (the values that
    travel beside it), for structured action spaces (Dict, Tuple, non-fixed
    leaves); single fixed leaves are done natively.
    `action_views` has each fixed leaf's views by dtype code; `action_codes`
    says which one holds the current batch, per leaf."""
    unflatten = unflattener(action_space)

    def build(row: int, objects: list[Any] | None) -> Any:
        extra = iter(objects or ())
        values = []
        for views, code in zip(action_views, action_codes.tolist()):
            if views is None or code & ACTION_AS_GIVEN:
                values.append(next(extra))
                continue
            view = views[code & ~ACTION_AS_PYTHON]
            if code & ACTION_AS_PYTHON:
                values.append(view[row].tolist())
            elif view.ndim > 1:
                values.append(view[row].copy())  # the arena row is overwritten next step
            else:
                values.append(view[row])
        return unflatten(values)

    return build


def make_envs(factories, first_row: int, registrations: CallerRegistrations | None = None) -> list:
    """Calls each factory; an error names the env it was making. In a
    worker, a factory that misses an id gets the caller's `registrations`."""
    envs = []
    for row, make in enumerate(factories, start=first_row):
        try:
            env = _make(make, registrations)
        except BaseException as exc:
            exc.shmvec_row = row  # where it failed, for the error report
            raise
        if not isinstance(env, gym.Env):
            raise TypeError(f"env_fns[{row}] returned {type(env).__name__}, not a gymnasium.Env")
        envs.append(env)
    return envs


def _make(make, registrations: CallerRegistrations | None):
    try:
        return make()
    except gym.error.UnregisteredEnv:
        if registrations is None or not registrations.add_missing():
            raise
    return make()  # an id that the caller registered at run time: found now


class EnvSlice:
    """In the caller's process, `enter` and `leave` bracket every use of the
    envs (a step, reset or call), and `close_when_free` closes them only
    outside one, as a worker process, which runs one thing at a time, does:
    a close() from another thread, or from a signal handler inside an env's
    step, must not close an env under its step."""

    def __init__(self, envs: list, first_row: int):
        self.envs = envs
        self.first_row = first_row
        self.rows = range(first_row, first_row + len(envs))
        self.stepper: _core.Stepper | None = None
        self._flatten_obs = None
        # The handoff between a use and close(), without a lock (a signal
        # handler's close() may run inside a use, in the same thread): each
        # side writes its flag, then reads the other's, so at least one of
        # them sees that it must close the envs, and the one that pops the
        # token does.
        self._user: int | None = None  # the thread inside a use
        self._closing = False
        self._left_to_user = False  # close() returned; the use closes the envs as it ends
        self._close_token = [True]

    def enter(self) -> bool:
        """A use begins in this thread; False (and no use) once close() has begun."""
        self._user = threading.get_ident()
        if self._closing:
            self.leave()
            return False
        return True

    def leave(self) -> None:
        """The use ends; if close() left the envs to it, it closes them
        (their errors become warnings: close() has returned)."""
        self._user = None
        if self._left_to_user and self._take_close_token():
            try:
                self.close()
            except Exception as exc:
                warnings.warn(f"shmvec: env {self.failed_row}'s close() raised {exc!r} (it was closed after its "
                              "step, which was under way when close() returned)", RuntimeWarning, stacklevel=2)

    def close_when_free(self, grace_s: float) -> None:
        """Closes the envs (raising the first env's error), waiting up to
        `grace_s` for a use in another thread to end. Where the use goes on
        (past the grace, or in this thread: a signal handler inside it), it
        closes them as it ends instead."""
        self._closing = True
        me, deadline = threading.get_ident(), time.monotonic() + grace_s
        while self._user not in (None, me) and time.monotonic() < deadline:
            time.sleep(0.001)
        if self._user is not None:
            self._left_to_user = True
            if self._user is not None:  # (read again: it may have ended before it could see the flag)
                return
        if self._take_close_token():
            self.close()

    def _take_close_token(self) -> bool:
        try:
            return self._close_token.pop()  # atomic: one taker only
        except IndexError:
            return False

    def describe(self) -> dict[str, Any]:
        """Every env's spaces, and the first env's metadata; the engine checks
        that the spaces can be batched."""
        first = self.envs[0]
        return {
            "observation_spaces": [env.observation_space for env in self.envs],
            "action_spaces": [env.action_space for env in self.envs],
            "metadata": dict(first.metadata),
            "render_mode": first.render_mode,
        }

    def attach(self, layout: DataLayout, buffer: Any, observation_space, action_space,
               autoreset_code: int, reset_call: str) -> None:
        self._reset_kwargs = RESET_CALLS[reset_call]
        views = layout.views(buffer)
        single_action = is_single_fixed_leaf(action_space)
        single_obs = is_single_fixed_leaf(observation_space)
        self._flatten_obs = None if single_obs else flattener(observation_space)
        self.stepper = _core.Stepper(
            envs=list(self.envs),
            first_row=self.first_row,
            action_leaves=views["action_views"],
            action_codes=views["action_dtypes"],
            action_builder=None if single_action else _action_builder(
                action_space, views["action_views"], views["action_dtypes"]),
            obs_leaves=views["observations"],
            obs_flattener=self._flatten_obs,
            rewards=views["rewards"],
            terminations=views["terminations"],
            truncations=views["truncations"],
            autoreset_mode=autoreset_code,
            write_fallback=write_leaf_fallback,
        )
        self.stepper.attach_info_columns(views["info_values"], views["info_flags"], INFO_STORAGE,
                                         views["info_schemas"][layout.slice_starts.index(self.first_row)])

    def step(self, object_actions: list | None = None):
        try:
            return self.stepper.step(object_actions)
        except BaseException:
            self.failed_row = self.stepper.failed_row
            raise

    def reset(self, seeds: list, options: dict | None, mask: np.ndarray | None):
        """Resets the envs (those in `mask`, if given); returns records like step's."""
        records = []
        for k, (row, env) in enumerate(zip(self.rows, self.envs)):
            if mask is not None and not mask[k]:
                continue
            self.failed_row = row
            result = env.reset(**self._reset_kwargs(seeds[k], options))
            if not isinstance(result, tuple) or len(result) != 2:
                raise ValueError(f"env {row}: reset() must return (obs, info), got {type(result).__name__}")
            obs, info = result
            _core.check_info(row, info, "reset")
            objects = self.stepper.write_observation(row, obs)
            self.stepper.reset_done(row)
            if info or objects is not None:
                records.append((row, info if info else None, False, None, objects, None))
        self.failed_row = -1
        return records or None

    def mark_restarted(self) -> None:
        """Every env is new (rebuilt after its process died): its next step
        reports the restart (see Stepper.mark_restarted)."""
        for row in self.rows:
            self.stepper.mark_restarted(row)

    def call(self, name: str, args: tuple, kwargs: dict, rows: list[int] | None) -> list:
        """`name` called (or read) on this slice's envs among `rows` (all by
        default), as often as each is named there and in that order."""
        out = []
        for row in self.rows if rows is None else [r for r in rows if r in self.rows]:
            env = self.envs[row - self.rows.start]
            self.failed_row = row
            attr = env.get_wrapper_attr(name)
            out.append(attr(*args, **kwargs) if callable(attr) else attr)
        self.failed_row = -1
        return out

    def set_attr(self, name: str, values: list) -> None:
        for row, env, value in zip(self.rows, self.envs, values):
            self.failed_row = row
            set_wrapper_attr(env, name, value)
        self.failed_row = -1

    def close(self) -> None:
        errors = []
        for row, env in zip(self.rows, self.envs):
            try:
                env.close()
            except Exception as exc:  # close every env even if one fails
                if not errors:
                    self.failed_row = row
                errors.append(exc)
        self.envs = []
        self.stepper = None
        if errors:
            raise errors[0]

    # The row of the env whose call raised last (-1: none).
    failed_row = -1
