"""The Gymnasium front end: ``shmvec.ShmVecEnv``, a drop-in
``gymnasium.vector.VectorEnv`` whose envs step in shared-memory workers.
What differs between Gymnasium 0.29.1, 1.0 and 1.1+ is in ``shmvec._gym_compat``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from gymnasium import Env, Space, logger
from gymnasium.error import ClosedEnvironmentError
from gymnasium.vector.utils import batch_space

from shmvec import _gym_compat as compat
from shmvec._gym_compat import AutoresetMode, VectorEnv
from shmvec._engine.batch_io import BatchIO
from shmvec._engine.cycle import IDLE, WAITING_CALL, WAITING_RESET, WAITING_STEP, CommandCycle
from shmvec._engine.engine import CLOSE_GRACE_S, Engine
from shmvec._engine.env_slice import AUTORESET_CODES, COPY_FINAL_INFO_ARRAYS
from shmvec.contract import AttributesByCall, check_sync, check_wait, checked_reset_mask, seeds_for
from shmvec.errors import ShmVecTimeoutError, not_picklable
from shmvec.send_recv import SendRecv
from shmvec.step_infos import vectorize

__all__ = ["ShmVecEnv"]


def _check_max_concurrency(value: Any) -> int | None:
    """AsyncVectorEnv's max_concurrency (Gymnasium 1.4), checked as it checks
    it, with its errors."""
    if value is None:
        return None
    if not isinstance(value, (int, np.integer)):
        raise ValueError(f"`max_concurrency` must be an integer or None, got {type(value)}.")
    if value < 1:
        raise ValueError(f"`max_concurrency` must be a positive or None, got {value}.")
    return int(value)


def _check_observation_mode(mode: Any) -> str | tuple[Space, Space]:
    """SyncVectorEnv's observation_mode: "same", "different", or a pair
    (batched space, single space)."""
    if isinstance(mode, tuple) and len(mode) == 2:
        compat.require_gymnasium("observation_mode=(batched space, single space)", "1.0")
        if not isinstance(mode[0], Space) or not isinstance(mode[1], Space):
            raise TypeError(
                f"Expected both elements of observation_mode to be Spaces, got {type(mode[0])} and {type(mode[1])}"
            )
        return mode
    if isinstance(mode, str) and mode in ("same", "different"):
        if mode == "different":
            compat.require_gymnasium("observation_mode='different'", "1.0")
        return mode
    raise ValueError(
        "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single and batch "
        f"observation space, actual got {mode}"
    )


class ShmVecEnv(SendRecv, AttributesByCall, VectorEnv):
    """Steps many Gymnasium envs in parallel worker processes that exchange
    actions, observations, rewards and flags through shared memory.

    It honours the ``gymnasium.vector.VectorEnv`` contract exactly as
    ``SyncVectorEnv`` does: same seeds and actions give the same results.

    Args:
        env_fns: callables that each make one env (lambdas and closures work).
        num_workers: worker processes; by default one per usable CPU, less one
            when the caller steps a slice itself. CPUs that other programs
            keep busy when the env is made are left out: with one idle, the
            caller steps every env itself; with none, one worker.
        caller_steps: the calling process steps one slice of envs itself while
            the workers step the rest, instead of idling (best on few cores).
            Left unset, it does when envs and a usable CPU remain besides one
            per worker. In async mode ``recv()`` steps the caller's envs while
            too few envs have finished. With ``num_workers=0`` every env
            steps in the caller.
        pin_workers: ``"auto"`` (pin each worker to its own CPU when every
            worker gets one that no other shmvec env, of this program or
            another, holds, leaving one for the caller if it steps a slice
            or runs the policy in async mode; where other programs keep every
            CPU busy, lock-step workers run on the caller's CPU instead, moved
            whenever it moves), ``True`` (pin, sharing CPUs if too few are
            free), ``False``, or a list of CPU ids.
        start_method: ``"forkserver"`` (default, with numpy and gymnasium
            preloaded), ``"fork"`` or ``"spawn"``.
        autoreset_mode: an ``AutoresetMode`` or its value as a string
            (Gymnasium 1.1+; ``NEXT_STEP`` by default). Under Gymnasium 1.0
            envs always reset in the step after the one that ends their
            episode; under 0.29 in the step that ends it, with
            ``infos["final_observation"]`` and ``infos["final_info"]``.
        copy: return observations the caller owns (``True``) or views into
            shared memory that the next step overwrites (``False``).
        timeout: seconds any wait for workers may take before ``TimeoutError``.
        batch_size: below ``num_envs``, EnvPool-style async stepping:
            ``async_reset()``, then ``recv()`` returns the first ``batch_size``
            envs to finish and ``send(actions, env_ids)`` steps them again.
        restart_failed_workers: replace a worker that dies or hangs past
            ``timeout`` (sync and async mode); each of its envs reports its
            episode cut short at its next step (truncated, reward 0, flagged in
            ``infos["shmvec_restarted"]``), as its autoreset mode reports any
            truncation (see the README).
        max_restarts: workers replaced over the life of the vector env, at
            most; beyond it, ``WorkerDiedError``.
        torch_threads: ``"auto"``: if torch is imported here (when the env
            is made, or by a ``reset()``) and runs more intra-op threads
            than the CPUs the workers leave free, shmvec lowers them to
            that number while this env is open (close() restores them) and
            says so once, and gives them back where timings say a policy
            runs faster with them; with torch's deterministic mode on, it
            counts an idle machine's workers and times no update both ways
            (the same numbers in every run); an int: that many while open;
            ``None``: leave torch alone (``SyncVectorEnv``'s numbers).
        observation_space, action_space: Gymnasium 0.29's ``SyncVectorEnv``
            and ``AsyncVectorEnv`` keywords (1.x has none): each env's space
            must equal the one given, else ``RuntimeError``.
        context, shared_memory, daemon, max_concurrency: AsyncVectorEnv's.
            ``context`` is the start method; ``shared_memory`` is accepted
            (shmvec always uses shared memory); ``daemon=False`` lets envs
            start processes of their own; ``max_concurrency`` caps the envs
            stepping at once, that is the stepping processes (each steps its
            envs one at a time), the caller counting while it steps.

    Example:
        >>> import gymnasium as gym
        >>> import shmvec
        >>> envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")] * 4, num_workers=1)
        >>> obs, infos = envs.reset(seed=42)
        >>> obs.shape, obs.dtype
        ((4, 4), dtype('float32'))
        >>> obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())
        >>> rewards
        array([1., 1., 1., 1.])
        >>> envs.close()
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Env]],
        *,
        num_workers: int | None = None,
        caller_steps: bool | None = None,
        pin_workers: bool | str | Sequence[int] = "auto",
        start_method: str | None = None,
        autoreset_mode: str | AutoresetMode | None = None,
        copy: bool = True,
        timeout: float | None = None,
        batch_size: int | None = None,
        restart_failed_workers: bool = False,
        max_restarts: int = 10,
        observation_mode: str | tuple[Space, Space] = "same",
        torch_threads: str | int | None = "auto",
        context: str | None = None,
        shared_memory: bool = True,
        daemon: bool = True,
        worker: Any = None,
        max_concurrency: int | None = None,
        observation_space: Space | None = None,
        action_space: Space | None = None,
    ):
        super().__init__()
        self.closed = True  # until the engine is up, so __del__/close have nothing to do
        # Every call runs through this state machine (shmvec._engine.cycle).
        self._cycle = CommandCycle(lambda: ClosedEnvironmentError("this ShmVecEnv is closed; create a new one"))
        self.autoreset_mode = compat.autoreset_mode(autoreset_mode)
        compat.check_space_keywords(observation_space, action_space)
        if worker is not None:
            raise ValueError(
                "shmvec.ShmVecEnv does not take AsyncVectorEnv's `worker`: its workers step envs in "
                "native code over shared memory, so a Python worker function has nothing to replace; "
                "wrap the env instead (gymnasium.Wrapper) to change what a step does"
            )
        if context is not None:
            if start_method is not None and start_method != context:
                raise ValueError(f"start_method={start_method!r} and context={context!r} disagree; pass one")
            start_method = context
        self.shared_memory = bool(shared_memory)  # always shared memory; kept for AsyncVectorEnv's code
        self.daemon = bool(daemon)  # False: envs may start processes; workers end with the vector env either way
        self.max_concurrency = _check_max_concurrency(max_concurrency)
        self.observation_mode = _check_observation_mode(observation_mode)
        try:
            env_fns = list(env_fns)
        except TypeError:
            raise TypeError(f"env_fns must be a list of callables that make envs, got {env_fns!r}") from None
        if not env_fns:
            raise ValueError("env_fns is empty: pass at least one env factory")
        self.env_fns = env_fns
        self.copy = bool(copy)
        num_envs = len(env_fns)
        if batch_size is None:
            batch_size = num_envs
        if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) or not 1 <= batch_size <= num_envs:
            raise ValueError(f"batch_size must be an int in [1, num_envs={num_envs}], got {batch_size!r}")
        self.batch_size = int(batch_size)
        async_mode = self._async_mode = self.batch_size < num_envs
        if async_mode and self.autoreset_mode is AutoresetMode.DISABLED:
            raise ValueError("autoreset_mode DISABLED is not supported with batch_size < num_envs (async mode)")
        autoreset_code = AUTORESET_CODES[self.autoreset_mode.value]
        if compat.AUTORESET_MODES and self.autoreset_mode is AutoresetMode.SAME_STEP:
            autoreset_code |= COPY_FINAL_INFO_ARRAYS  # 1.1+ batches the ended episode's info before the reset
        self._engine = Engine(
            env_fns,
            cycle=self._cycle,
            num_workers=num_workers,
            caller_steps=caller_steps,
            pin_workers=pin_workers,
            start_method=start_method,
            autoreset_code=autoreset_code,
            reset_call=compat.RESET_CALL,
            timeout=timeout,
            async_mode=async_mode,
            restart_failed_workers=restart_failed_workers,
            max_restarts=max_restarts,
            observation_mode=self.observation_mode,
            torch_threads=torch_threads,
            daemon=self.daemon,
            max_concurrency=self.max_concurrency,
        )
        self.closed = False
        engine = self._engine
        self.num_envs = engine.num_envs
        self.num_workers = engine.num_workers
        description = engine.description
        self.metadata = compat.vector_metadata(description["metadata"], self.autoreset_mode)
        self.render_mode = description["render_mode"]
        try:
            compat.check_given_spaces(observation_space, action_space, description["observation_space"],
                                      description["action_space"])
        except RuntimeError:
            self.close()
            raise
        self.single_observation_space = description["observation_space"]
        self.single_action_space = description["action_space"]
        if self.observation_mode == "same":
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        elif self.observation_mode == "different":
            self.observation_space = description["batched_observation_space"]
        else:
            self.observation_space = self.observation_mode[0]
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        if async_mode:
            unshaped = [leaf.name() for leaf in engine.layout.action_leaves if not leaf.fixed]
            if unshaped:
                self.close()
                raise NotImplementedError(
                    f"async mode (batch_size < num_envs) needs action spaces whose leaves have fixed shapes; "
                    f"action leaves {unshaped} of {self.single_action_space} have none (use batch_size=num_envs)")

        self._io = BatchIO(engine, copy=self.copy)
        self._restarts = engine.restart_failed_workers  # keep what the caller saw (see BatchIO.remember)
        # Under DISABLED autoreset: envs whose episode ended, to reset before a step.
        self._disabled = self.autoreset_mode is AutoresetMode.DISABLED
        self._autoreset_envs = np.zeros(self.num_envs, dtype=np.bool_)
        self._reset_mask: np.ndarray | None = None  # of the pending reset
        self._init_send_recv()

    # -- stepping -----------------------------------------------------------
    # Each call is a *_async that starts it and a *_wait that collects it, as
    # in AsyncVectorEnv; reset(), step() and call() do both.

    def reset(
        self,
        *,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Resets every env (or those in ``options["reset_mask"]``) and returns
        the batched observations and infos, as ``SyncVectorEnv`` does."""
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(
        self,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """Starts resetting the envs; ``reset_wait()`` returns the results."""
        self._cycle.check_usable()
        check_sync(self, "reset", "async_reset")
        seeds = seeds_for(seed, self.num_envs)
        self._cycle.check_idle("reset_async")
        mask = None
        if options is not None:
            if not isinstance(options, dict):
                raise TypeError(f"options must be a dict or None, got {type(options).__name__}")
            if "reset_mask" in options:
                compat.require_gymnasium("options['reset_mask']", "1.1")
                # The caller's dict keeps its mask, where SyncVectorEnv pops it: Gymnasium's
                # RecordEpisodeStatistics reads it after the reset (tests/test_vector_wrappers.py).
                options = dict(options)
                mask = checked_reset_mask(options.pop("reset_mask"), self.num_envs)
        self._engine.begin_reset(seeds, options, mask)
        self._reset_mask = mask

    def reset_wait(self, timeout: float | None = None, seed: Any = None,
                   options: Any = None) -> tuple[Any, dict[str, Any]]:
        """The results of ``reset_async()``: batched observations and infos.
        After `timeout` seconds, ``TimeoutError`` (the reset stays pending).
        `seed` and `options` are ignored, as by AsyncVectorEnv of Gymnasium
        0.29 (whose ``VectorEnv.reset`` passes them on): give them to
        ``reset_async()``."""
        if self._cycle.phase is not WAITING_RESET:
            check_wait(self, WAITING_RESET, "async_reset")
        records = self._finish(timeout)
        mask = self._reset_mask
        if mask is None:
            self._autoreset_envs[:] = False
            self._cycle.reset_done()
        else:
            self._autoreset_envs[mask] = False
            left_out = [row for row in self._engine.restarted_rows if not mask[row]]
            if left_out:  # restarted meanwhile, not reset: their next step reports it, at what the caller saw
                self._io.restore(left_out)
        infos = vectorize(self, self._io, records)  # first: it stores observation leaves without a fixed shape
        if self._restarts:
            self._io.remember()
        return self._io.observations(), infos

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Steps every env with its action; returns batched (observations,
        rewards, terminations, truncations, infos)."""
        self.step_async(actions)
        result = self._wait_step(None)
        self._engine.handed_out = None  # returned (the last act: see Engine.finish)
        return result

    def step_async(self, actions: Any) -> None:
        """Hands every env its action and returns at once (the caller's own
        slice of envs, if any, steps in ``step_wait()``)."""
        if self._cycle.phase is not IDLE:
            self._cycle.check_steppable()
        if self._async_mode:
            check_sync(self, "step", "send/recv")
        if self._disabled and self._autoreset_envs.any():
            ended = np.flatnonzero(self._autoreset_envs).tolist()
            raise RuntimeError(
                f"envs {ended} ended their episodes and autoreset_mode is DISABLED: reset them "
                "with reset(options={'reset_mask': mask}) before stepping again"
            )
        self._engine.begin_step(self._io.write_actions(actions))

    def step_wait(self, timeout: float | None = None) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The results of ``step_async()``. After `timeout` seconds,
        ``TimeoutError`` (the step stays pending: call ``step_wait()`` again)."""
        result = self._wait_step(timeout)
        self._engine.handed_out = None  # returned (the last act: see Engine.finish)
        return result

    def _wait_step(self, timeout: float | None) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        if self._cycle.phase is not WAITING_STEP:
            unreturned = self._engine.unreturned_step()
            if unreturned is not None:  # a Ctrl-C came as the last step() returned it
                return unreturned
            check_wait(self, WAITING_STEP, "send/recv")
        # (No step in async mode: nothing to send again.) The batch is made
        # with Ctrl-C held: one then leaves it for the next step_wait().
        return self._engine.finish(timeout, build=self._step_results)

    def _step_results(self, records: list) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """The batch step_wait() returns, from the arena and the step's records."""
        io = self._io
        if self._engine.restarted_rows and self.autoreset_mode is not AutoresetMode.SAME_STEP:
            # Truncated at the last observation the caller saw (their
            # restart reports leave the arena as it is: restore it).
            io.restore(self._engine.restarted_rows)
        if self._disabled:
            np.logical_or(io.terminations, io.truncations, out=self._autoreset_envs)
        # Straight from the info columns when every env's info is there (no
        # per-env work), else env by env.
        infos = self._engine.info_columns.batch() if not records else None
        if infos is None:
            infos = vectorize(self, self._io, records, self._engine.info_columns)
        if self._restarts:
            io.remember()
        return (
            io.observations(),
            io.rewards.copy(),
            io.terminations.copy(),
            io.truncations.copy(),
            infos,
        )

    def _restarted(self, last_observations: Any) -> None:
        """For RayVecEnv, after Ray rebuilt the actor this env lives in:
        `last_observations` (a batch; None if none was handed out) are the
        ones the caller was last handed; every env's next step reports its
        restart."""
        if last_observations is not None:
            self._io.write_observations(last_observations)
            self._io.remember()
        self._engine.mark_restarted()

    def _finish(self, timeout: float | None = None) -> Any:
        """Collects the waiting call (the engine moves the cycle on: see
        shmvec._engine.cycle); in async mode, envs that restarted workers
        had in flight are sent again."""
        try:
            return self._engine.finish(timeout)
        finally:
            if self._async_mode:
                self._send_lost()

    # -- the rest of the contract ---------------------------------------------

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Calls method `name` of every env (or reads the attribute)."""
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def call_async(self, name: str, /, *args: Any, **kwargs: Any) -> None:
        """Starts calling method `name` of every env; ``call_wait()`` returns the results."""
        self._cycle.check_idle("call_async")
        self._land_own_envs()
        self._engine.begin_call(name, args, kwargs)

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The results of ``call_async()``, one per env. After `timeout`
        seconds, ``TimeoutError`` (the call stays pending)."""
        self._cycle.check_waiting(WAITING_CALL)
        return tuple(self._finish(timeout))

    def _set_attr(self, name: str, values: list[Any]) -> None:
        """set_attr() (of AttributesByCall), with one value per env."""
        self._cycle.check_idle("set_attr")
        self._land_own_envs()
        try:
            self._engine.set_attr(name, values)
        finally:
            self._send_lost()

    def _land_own_envs(self) -> None:
        """Async mode: the caller's own envs in flight take their steps
        before a call reaches them, as a worker's do (see AsyncSteps.land_own)."""
        if self._async_mode and self._in_flight.any():
            self._engine.async_steps.land_own()

    def close_extras(self, timeout: float | None = None, terminate: bool = False, **kwargs: Any) -> None:
        """Closes the envs and the workers. A pending call is waited for up
        to `timeout` seconds (5 by default) first, with a warning, as in
        AsyncVectorEnv;
        ``terminate=True`` kills workers at once (e.g. when an env hangs)."""
        engine = getattr(self, "_engine", None)
        try:
            if engine is not None and self._cycle.waiting:
                logger.warn(f"Calling `close` while waiting for a pending call to `{self._cycle.phase.value}` "
                            "to complete.")
                if not terminate and engine.in_flight:
                    try:
                        engine.abandon(CLOSE_GRACE_S if timeout is None else timeout)  # bounded, even if an env hangs
                    except ShmVecTimeoutError:
                        terminate = True
                    except Exception:
                        pass  # its error belongs to the call nobody collected; close anyway
        finally:  # even if the warning is an error (-W error)
            self._io = None  # its views would keep the arena mapped
            try:
                if engine is not None:
                    engine.close(terminate=terminate)
            finally:
                # Closed even if an env's close() raised: the engine closed
                # every other env and ended the workers before raising it.
                self.closed = True

    def __reduce__(self):
        raise not_picklable(self)

    def _check_open(self) -> None:
        self._cycle.check_usable()
