"""The Stable-Baselines3 front end: ``shmvec.sb3.ShmVecEnv``, a drop-in
``VecEnv`` (in place of ``DummyVecEnv`` or ``SubprocVecEnv``) over the same
engine as ``shmvec.ShmVecEnv``. ``import shmvec`` never imports SB3 or
torch: this module does, on first use of ``shmvec.sb3``."""

from __future__ import annotations

import copy
import operator
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from shmvec import _sb3_env
from shmvec._engine.batch_io import BatchIO
from shmvec._engine.cycle import IDLE, WAITING_STEP, CommandCycle
from shmvec._engine.engine import FIRST_ENV_SPACES, Engine
from shmvec._engine.env_slice import AUTORESET_CODES
from shmvec.errors import import_extra, not_picklable

import_extra("stable_baselines3", "shmvec.sb3", "Stable-Baselines3", "sb3")

from stable_baselines3.common.vec_env.base_vec_env import (  # noqa: E402
    VecEnv,
    VecEnvIndices,
    VecEnvObs,
    VecEnvStepReturn,
)

__all__ = ["ShmVecEnv"]

# Options of shmvec.ShmVecEnv that would break SB3's contract, and why.
_REFUSED = {
    "autoreset_mode": "SB3 needs same-step autoreset (terminal_observation in the infos), always used here",
    "copy": "SB3 keeps the previous batch of observations, so they are always fresh arrays",
    "batch_size": "SB3 steps every env at every step",
}


class ShmVecEnv(VecEnv):
    """Steps SB3's envs in parallel worker processes through shared memory.

    Outputs are those of ``DummyVecEnv`` (float32 rewards, bool dones, a list
    of fresh info dicts with ``TimeLimit.truncated`` and, at an episode end,
    ``terminal_observation``); env errors reach the caller with their own
    type. Same seeds and actions give the same results as ``DummyVecEnv``
    (differences: README, "Stable-Baselines3 and CleanRL").

    Args:
        env_fns: callables that each make one env (lambdas and closures work).
        num_workers: worker processes; by default one per usable CPU, less one
            when the caller steps a slice itself, leaving out CPUs that other
            programs keep busy (as for ``shmvec.ShmVecEnv``).
        caller_steps: the calling process steps one slice of envs itself while
            the workers step the rest (best on few cores). Left unset, it does
            when envs and a usable CPU remain besides one per worker.
        pin_workers: ``"auto"`` (default), ``False``, ``True`` or a list of CPU ids
            (as for ``shmvec.ShmVecEnv``).
        start_method: ``"forkserver"`` (default), ``"fork"`` or ``"spawn"``;
            the one argument besides ``env_fns`` that may be positional, as in
            ``SubprocVecEnv``.
        timeout: seconds any wait for workers may take before ``TimeoutError``.
        torch_threads: ``"auto"`` (default), an int or ``None``: torch's
            intra-op threads while this env is open (as for ``shmvec.ShmVecEnv``).
            A different thread count can change how torch rounds some ops
            (matmuls, convolutions): to train bit for bit as beside
            ``DummyVecEnv`` with torch's own count, pass ``None``.

    Example:
        >>> import gymnasium as gym
        >>> from stable_baselines3.common.env_util import make_vec_env
        >>> from shmvec.sb3 import ShmVecEnv
        >>> venv = make_vec_env("CartPole-v1", n_envs=4, vec_env_cls=ShmVecEnv,
        ...                     vec_env_kwargs={"num_workers": 1})
        >>> obs = venv.reset()
        >>> obs.shape, obs.dtype
        ((4, 4), dtype('float32'))
        >>> obs, rewards, dones, infos = venv.step(np.zeros(4, dtype=np.int64))
        >>> rewards, dones.dtype, infos[0]["TimeLimit.truncated"]
        (array([1., 1., 1., 1.], dtype=float32), dtype('bool'), False)
        >>> venv.close()
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        start_method: str | None = None,  # second, as in SubprocVecEnv(env_fns, start_method)
        *,
        num_workers: int | None = None,
        caller_steps: bool | None = None,
        pin_workers: bool | str | Sequence[int] = "auto",
        timeout: float | None = None,
        restart_failed_workers: bool = False,
        max_restarts: int = 10,
        torch_threads: str | int | None = "auto",
        **refused: Any,
    ):
        for key in refused:
            if key in _REFUSED:
                raise TypeError(f"shmvec.sb3.ShmVecEnv does not take {key!r}: {_REFUSED[key]}")
            raise TypeError(f"shmvec.sb3.ShmVecEnv got an unexpected keyword argument {key!r}")
        self.closed = True  # until the engine is up
        owner = uuid.uuid4().hex
        self._engine = Engine(
            [_sb3_env.EnvFactory(fn, owner) for fn in env_fns],
            # Not strict: after an env error the envs step on, as in DummyVecEnv.
            cycle=CommandCycle(lambda: RuntimeError("this shmvec.sb3.ShmVecEnv is closed; create a new one"),
                               strict=False),
            num_workers=num_workers,
            caller_steps=caller_steps,
            pin_workers=pin_workers,
            start_method=start_method,
            autoreset_code=AUTORESET_CODES["SameStep"],
            reset_call="seed-and-set-options",  # as DummyVecEnv calls reset()
            timeout=timeout,
            restart_failed_workers=restart_failed_workers,
            max_restarts=max_restarts,
            observation_mode=FIRST_ENV_SPACES,
            torch_threads=torch_threads,
        )
        self.closed = False
        self.num_workers = self._engine.num_workers
        self._io = BatchIO(self._engine, copy=True)
        self._object_actions: list | None = None
        self._waiting = False
        description = self._engine.description
        try:
            super().__init__(self._engine.num_envs, description["observation_space"], description["action_space"])
        except BaseException:
            self.close()
            raise
        self.metadata = dict(description["metadata"])  # as DummyVecEnv: the envs' own

    # -- stepping -----------------------------------------------------------

    def reset(self) -> VecEnvObs:
        """Resets every env with the seeds and options set by ``seed()`` and
        ``set_options()`` (then forgets them); fills ``reset_infos``."""
        self._check_open()
        self._waiting = False
        self._finish_interrupted()
        per_env = list(self._options)
        if len(per_env) < self.num_envs:  # (SB3's own fail at reset too, with some envs reset)
            raise IndexError(f"set_options() gave options for {len(per_env)} envs, but there are "
                             f"{self.num_envs}; no env was reset")
        # The engine passes one options dict to the envs it resets: one reset
        # per distinct dict, as DummyVecEnv passes each env its own (the first
        # num_envs of a longer list, as it does).
        groups: dict[int | None, list[int]] = {}
        for row, options in enumerate(per_env[:self.num_envs]):
            groups.setdefault(id(options) if options else None, []).append(row)
        self.reset_infos = [{} for _ in range(self.num_envs)]
        error = None
        for rows in groups.values():
            options = per_env[rows[0]] or None
            mask = None
            if len(groups) > 1:
                mask = np.zeros(self.num_envs, dtype=np.bool_)
                mask[rows] = True
            try:
                records = self._engine.reset(list(self._seeds), options, mask)
            except Exception as exc:
                # An env raised: the other groups are reset all the same, as
                # the other processes' envs are; the first error is raised
                # after them. A timeout (still pending) or a dead worker stops here.
                if self._engine.cycle.phase is not IDLE:
                    raise
                error = error or exc
                continue
            for record in records:
                self._io.update_objects(record.row, record.objects)
                self.reset_infos[record.row] = record.info or {}
        if error is not None:
            raise error
        self._reset_seeds()
        self._reset_options()
        self._remember()
        return self._io.observations()

    def step_async(self, actions: np.ndarray) -> None:
        """Checks the actions (``ValueError`` for a wrong shape or count) and
        writes them to shared memory; ``step_wait`` steps."""
        self._check_open()
        self._finish_interrupted()  # before its workers could read the new actions
        self._object_actions = self._io.write_actions(self._batched(actions))
        self._waiting = True

    def _batched(self, actions: Any) -> Any:
        """SB3 indexes actions by env (``DummyVecEnv`` steps env i with
        ``actions[i]``): for Dict and Tuple action spaces a list of per-env
        actions becomes the batch the arena takes."""
        space = self.action_space
        per_env = (isinstance(space, gym.spaces.Dict) and not isinstance(actions, Mapping)) or (
            isinstance(space, gym.spaces.Tuple) and isinstance(actions, (list, np.ndarray)))
        if not per_env:
            return actions
        items = list(actions)
        if len(items) != self.num_envs:
            raise ValueError(f"got {len(items)} actions for {self.num_envs} envs")
        return concatenate(space, items, create_empty_array(space, self.num_envs))

    def step_wait(self) -> VecEnvStepReturn:
        """Steps every env; returns fresh (observations, float32 rewards,
        bool dones, a list of info dicts), resetting ended episodes at once."""
        self._check_open()
        # The batch is made with Ctrl-C held: one then leaves it for the next step_wait().
        engine = self._engine
        if self._waiting and engine.cycle.phase is not WAITING_STEP:
            engine.begin_step(self._object_actions)  # (Ctrl-C before the workers got it: it never began)
        if engine.cycle.phase is WAITING_STEP:  # begun, here or by a step_wait() Ctrl-C interrupted
            self._waiting = False
            result = engine.finish(build=self._step_results)
        else:
            result = engine.unreturned_step()  # (a Ctrl-C came as the last step_wait() returned it)
            if result is None:
                raise RuntimeError("step_wait() needs a step_async(actions) first")
        engine.handed_out = None  # returned (the last act: see Engine.finish)
        return result

    def _step_results(self, records: list) -> VecEnvStepReturn:
        """The batch step_wait() returns, from the arena and the step's records."""
        io = self._io
        timeouts = (io.truncations & ~io.terminations).tolist()
        infos: list[dict[str, Any]] = [{"TimeLimit.truncated": t} for t in timeouts]
        columns = self._engine.info_columns
        for row in columns.rows().tolist():  # infos that came as columns: fresh dicts already
            infos[row] = {**columns.row(row), "TimeLimit.truncated": timeouts[row]}
        for record in records:
            row, info = record.row, record.info
            if info is None and columns.flags[row]:
                info = columns.row(row)  # its reset info, after an episode end
            io.update_objects(row, record.objects)
            step_info = record.final_info if record.ended else info
            # Fresh dicts, as DummyVecEnv's deepcopy: an env may reuse its own.
            out = copy.deepcopy(step_info) if step_info else {}
            out["TimeLimit.truncated"] = timeouts[row]
            if record.ended:  # a restart report (shmvec_restarted) as any episode end
                out["terminal_observation"] = io.final_obs(row, record.final_obs)
                self.reset_infos[row] = info or {}
            infos[row] = out
        self._remember()
        dones = np.logical_or(io.terminations, io.truncations)
        return io.observations(), io.rewards.astype(np.float32), dones, infos

    def _finish_interrupted(self) -> None:
        """A call that Ctrl-C interrupted while it waited for the workers is
        still in flight: finishes it (its results are dropped), so that SB3's
        loop goes on with the next call, as it does with SubprocVecEnv."""
        if self._engine.in_flight:
            self._engine.finish()

    def _remember(self) -> None:
        """With restarts, a restarted env's terminal_observation is the last
        observation SB3 saw: keep a copy (one per step)."""
        if self._engine.restart_failed_workers:
            self._io.remember()

    # -- the envs' attributes and methods -------------------------------------

    def _on_envs(self, fn: Callable[..., Any], *args: Any, indices: VecEnvIndices = None) -> list[Any]:
        """``fn(env, *args)`` for the envs in `indices`, in their order."""
        self._check_open()
        self._finish_interrupted()
        return self._engine.call(_sb3_env.HOOK, (fn, *args), None, self._rows(indices))

    def _rows(self, indices: VecEnvIndices) -> list[int]:
        if indices is None:
            return list(range(self.num_envs))
        if isinstance(indices, (int, np.integer)):
            indices = [indices]
        rows = []
        for index in indices:
            index = operator.index(index)
            if not -self.num_envs <= index < self.num_envs:
                raise IndexError(f"env index {index} is out of range for {self.num_envs} envs")
            rows.append(index % self.num_envs)  # negative counts from the end, as in a list
        return rows

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """The attribute of each env (found through its wrappers), never called."""
        return self._on_envs(_sb3_env.get_attr, attr_name, indices=indices)

    def has_attr(self, attr_name: str) -> bool:
        """Whether every env has the attribute (its value does not travel)."""
        return all(self._on_envs(_sb3_env.has_attr, attr_name))

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Sets the attribute on each env's outermost wrapper, as DummyVecEnv does."""
        self._on_envs(setattr, attr_name, value, indices=indices)

    def env_method(self, method_name: str, *method_args, indices: VecEnvIndices = None,
                   **method_kwargs) -> list[Any]:
        """Calls a method of each env (found through its wrappers)."""
        return self._on_envs(_sb3_env.call_method, method_name, method_args, method_kwargs, indices=indices)

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        """Whether each env has a wrapper of `wrapper_class` (e.g. ``Monitor``)."""
        return self._on_envs(_sb3_env.is_wrapped, wrapper_class, indices=indices)

    def get_images(self) -> Sequence[np.ndarray | None]:
        """Each env's frame (``render_mode="rgb_array"`` only, as DummyVecEnv)."""
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is `rgb_array` to obtain images."
            )
            return [None] * self.num_envs
        return self.env_method("render")

    def __reduce__(self):
        raise not_picklable(self)

    # -- shutdown -------------------------------------------------------------

    def close(self, terminate: bool = False) -> None:
        """Closes the envs and the workers; idempotent. ``terminate=True``
        kills workers at once (e.g. when an env hangs)."""
        if self.closed:
            return
        self.closed = True
        self._io = None  # its views would keep the arena mapped
        self._engine.close(terminate=terminate)

    def _check_open(self) -> None:
        self._engine.cycle.check_usable()
