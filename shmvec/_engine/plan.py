"""How the envs are laid out before anything starts: how many workers, which
contiguous slice of envs each steps (and the caller's own), and checks of the
options and spaces that decide the arena's layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from shmvec._engine.layout import leaves_of
from shmvec._engine.system import allowed_cpu_ids, usable_cpus

__all__ = ["START_METHODS", "FOLLOW_MIN_ENVS", "check_options", "caller_cpus", "default_num_workers",
           "first_env_space",
           "no_cpu_idle", "workers_may_follow", "workers_follow_caller", "busy_cpus_note", "plan_slices", "split_slices",
           "check_pin_workers", "check_observation_spaces"]

START_METHODS = ("fork", "forkserver", "spawn")


def caller_cpus(caller_steps: bool, async_mode: bool) -> int:
    """The CPUs the caller itself keeps busy: one where it steps a slice or,
    in async mode, runs the user's policy while the workers step."""
    return 1 if caller_steps or async_mode else 0


def no_cpu_idle(busy_cpus: int) -> bool:
    """Other programs keep every usable CPU busy (and there are two or more:
    on one CPU there is nowhere else to run)."""
    return usable_cpus() >= 2 and busy_cpus >= usable_cpus()


def workers_may_follow(async_mode: bool, pin_workers: Any, stepping: int) -> bool:
    """Whether lock-step workers may run on the caller's CPU, when other
    programs keep every CPU busy (now or later: cpus.WorkerPlacement
    watches): pinning left to shmvec ("auto"), two or more usable CPUs and
    no CPU quota below them (the other CPUs' load says nothing of ours
    there, as for system.cpus_busy_elsewhere), and at most two `stepping`
    processes (the workers, and the caller if it steps a slice). On one CPU
    they get that CPU's time at most; two share it well (below), and more
    beside the busy CPUs of a larger machine are unmeasured."""
    return (not async_mode and pin_workers == "auto" and stepping <= 2
            and usable_cpus() >= 2 and usable_cpus() == len(allowed_cpu_ids()))


def workers_follow_caller(async_mode: bool, pin_workers: Any, busy_cpus: int) -> bool:
    """Whether lock-step workers start on the CPU the caller runs on, moved
    there whenever the caller moves (cpus.WorkerPlacement): where other programs
    keep every usable CPU busy when the env is made, and pinning is left to
    shmvec ("auto"): workers_may_follow's conditions for the default's two
    stepping processes (the caller and one worker; the engine checks an
    explicit count again once it is planned).

    Spread over the CPUs, each of shmvec's processes shares one with another
    program's thread, and every handoff of a step waits for that thread's
    turn. On the caller's CPU they hand off without waiting for anyone else,
    and as runnable threads of their own they still hold their share of the
    CPUs. CartPole beside two CPU hogs on 2 CPUs (`shmvec bench --num-envs
    64,256 --busy 2 --workers N --backends shmvec,sync --passes 3 --seconds
    2`, two runs of each build, x SyncVectorEnv at 64 / 256 envs):
    num_workers=1 1.55x / 1.60x and 0.91x / 1.53x spread (single passes down
    to 0.8x), 1.43x / 1.48x and 1.44x / 1.50x on the caller's CPU (at 64
    envs, of 26 passes there one ran 36k steps/s, unexplained, and the
    others 132k-201k, where SyncVectorEnv ran 120k-146k);
    num_workers=2 (the caller stepping none) 1.22x / 1.18x and 1.33x / 1.50x
    spread, 1.44x / 1.54x and 1.46x / 1.47x on the caller's CPU. Async
    mode's processes do not wait for each other at every step: there a
    worker spread over the CPUs ran as fast as one on the caller's CPU
    (202k-208k steps/s against 189k-204k, fresh processes)."""
    return no_cpu_idle(busy_cpus) and workers_may_follow(async_mode, pin_workers, stepping=2)


# With no CPU idle, lock-step's default starts its one worker (on the caller's
# CPU) only from this many envs: with fewer, a batch's work is too short for
# two handoffs a step on a CPU that a hog may share (see default_num_workers).
FOLLOW_MIN_ENVS = 16


def default_num_workers(num_envs: int, caller_steps: bool, async_mode: bool = False, busy_cpus: int = 0,
                        follows: bool = False, shares_with_busy: bool = False) -> int:
    """One stepping process per usable CPU that other programs leave idle
    (`busy_cpus`: those they keep busy, from system.cpus_busy_elsewhere),
    the caller counting as one: it steps a slice itself, or in async mode it
    runs the user's policy while the workers step (CartPole x64, a torch MLP,
    2 CPUs: one worker beside the caller made 95k steps/s, two 73k, medians of
    4 fresh processes). With one CPU idle, no worker: the caller steps every
    env itself, one process and no handoffs, as SyncVectorEnv. With none
    idle, one worker all the same, in async mode or where it runs on the
    caller's CPU (`follows`, see workers_follow_caller), if the busy CPUs'
    threads share this process's scheduling group (`shares_with_busy`, see
    system.busy_threads_share_our_group): two runnable processes then hold
    two threads' share of the busy CPUs where the caller alone holds one.
    (Beside threads of other sessions, where the kernel groups by session,
    shmvec's processes together hold one session's share: CartPole x64
    beside two hogs in sessions of their own, `shmvec bench --num-envs 64,256
    --busy 2 --busy-apart --async-batch 32 --backends shmvec,shmvec-async,sync
    --passes 3 --seconds 2`: lock-step 1.17x / 1.08x SyncVectorEnv without a
    worker, 0.69x / 1.15x with one; async mode 1.17x / 1.02x and 0.90x /
    0.91x.) CartPole beside two CPU hogs on 2 CPUs (`shmvec bench
    --num-envs 64,256 --busy 2 --async-batch 32 --backends
    shmvec,shmvec-async,sync --passes 3 --seconds 2`, two runs of each
    build, x SyncVectorEnv at 64 / 256 envs): lock-step 1.15x / 1.19x and
    1.12x / 1.16x without the worker, 1.29x / 1.20x and 1.44x / 1.19x with
    it; async mode in batches of 32 1.05x / 1.07x and 1.09x / 1.01x without,
    1.45x / 1.43x and 1.45x / 1.48x with it. In lock-step only from
    FOLLOW_MIN_ENVS envs: two hogs running when the env was made, CartPole,
    1 s after 0.25 s of warm-up, six fresh processes each (ad hoc,
    2026-11-28), steps/s median (min-max) with the worker, without it and
    of SyncVectorEnv: 4 envs 94.0k (44.8k-113.5k), 102.5k (89.6k-113.7k),
    100.8k; 8 envs 104.1k (78.8k-135.7k), 133.5k (128.7k-150.2k), 112.3k;
    16 envs 162.0k (84.5k-175.6k), 139.6k (132.1k-148.3k), 116.1k; 32 envs
    170.6k (140.5k-196.5k), 142.1k (127.9k-148.9k), 111.4k; 64 envs 177.4k
    (104.4k-200.7k), 143.8k (124.3k-156.5k), 130.7k.
    `caller_steps` False: the caller may not step, so at least one worker."""
    worker_pays = async_mode or (follows and num_envs >= FOLLOW_MIN_ENVS)
    if no_cpu_idle(busy_cpus) and shares_with_busy and worker_pays:
        return min(1, num_envs - 1) if caller_steps else 1
    slots = usable_cpus() - busy_cpus - caller_cpus(caller_steps, async_mode)
    cap = num_envs - (1 if caller_steps else 0)
    return max(0, min(slots, cap)) if caller_steps else max(1, min(slots, cap))


def busy_cpus_note(num_envs: int, requested: int | None, num_workers: int, caller_steps: bool, async_mode: bool,
                   busy_cpus: int, follows: bool = False, shares_with_busy: bool = False) -> str | None:
    """What to tell the user when CPUs kept busy by other programs decide
    how fast this env can run (None if they do not). Left to shmvec
    (`requested` None), the default ran fewer workers than an idle machine
    would get: a choice otherwise invisible, lasting for the env's life. An
    explicit count stands, but if it is more than the idle CPUs hold, its
    processes wait for each other's turns at every step (CartPole x64 beside
    two CPU hogs on 2 CPUs, medians of 6 fresh processes: num_workers=1 ran
    at 0.72x SyncVectorEnv, 0.65-1.35 per process, the default 1.07x,
    1.04-1.21; see docs/performance-history.md), unless they run on the
    caller's CPU (`follows`, see workers_follow_caller), for as long as no
    CPU is idle (cpus.WorkerPlacement)."""
    if not busy_cpus:
        return None
    found = f"shmvec found {busy_cpus} of this process's {usable_cpus()} CPUs kept busy by other programs"
    on_callers_cpu = ("its workers run on the CPU the caller runs on, moved there whenever it moves, where they "
                      "take turns with it instead of each waiting for another program's turn at every step, "
                      "for as long as no CPU is idle (it looks again five times a second while stepping)")
    if requested is None:
        idle_default = default_num_workers(num_envs, caller_steps, async_mode)
        if follows:
            return (f"{found}, so {on_callers_cpu}. Its number of workers was chosen once, when the env "
                    f"was made; pass num_workers={idle_default}, pin_workers=True to give workers CPUs of "
                    "their own anyway.")
        if num_workers >= idle_default:
            return None
        return (f"{found}, so it runs {num_workers} worker processes instead of {idle_default} "
                f"({_stepping(num_workers)}): processes beyond the idle CPUs wait for each other at every step. "
                f"It looked once, when the env was made; pass num_workers={idle_default} to run them anyway.")
    if num_workers + caller_cpus(caller_steps, async_mode) <= usable_cpus() - busy_cpus:
        return None
    if follows:
        return (f"{found}: num_workers={num_workers} runs more processes than the CPUs left idle, "
                f"so {on_callers_cpu}.")
    chosen, _ = plan_slices(num_envs, None, None, async_mode, busy_cpus, follows, shares_with_busy)
    caller = (" (the caller counts as one: it runs the policy)" if async_mode
              else " (the caller counts as one: it steps a slice)" if caller_steps else "")
    return (f"{found}: num_workers={num_workers} runs more processes than the CPUs left idle{caller}, "
            f"and each then waits for the others' turns at every step. With num_workers unset, shmvec "
            f"runs {chosen} worker processes here ({_stepping(chosen)}). It looked once, when the env was made.")


def _stepping(num_workers: int) -> str:
    return "the caller steps every env itself" if num_workers == 0 else "the caller steps a slice beside them"


def plan_slices(num_envs: int, num_workers: int | None, caller_steps: bool | None, async_mode: bool,
                busy_cpus: int = 0, follows: bool = False, shares_with_busy: bool = False,
                max_concurrency: int | None = None) -> tuple[int, bool]:
    """(num_workers, caller_steps) for `num_envs` envs.

    Left to shmvec (``None``): one stepping process per idle CPU, the caller
    counting as one: it steps a slice (it would idle otherwise). In async
    mode its CPU runs the user's policy too: send() returns at once, and
    recv() steps the caller's envs only while too few have finished, where
    it would otherwise wait (CartPole x64 with a torch MLP in batches of 32
    on 2 CPUs: the caller waited 55% of each batch for its one worker).
    With an explicit `num_workers`, every worker gets at least one env, and
    the caller steps a slice of its own only if envs and a usable CPU are
    left after that (unless told otherwise). `follows`: lock-step workers
    will run on the caller's CPU (workers_follow_caller); `shares_with_busy`:
    the busy CPUs' threads share this process's scheduling group.
    `max_concurrency` (AsyncVectorEnv's): the most envs stepping at once.
    Each process steps its envs one at a time, so it caps the stepping
    processes, the caller counting while it steps; shmvec's own choices
    give way to it, and explicit ones beyond it are a ValueError."""
    caller_chosen = caller_steps is None
    if num_workers is not None and num_workers > num_envs:
        raise ValueError(f"num_workers={num_workers} is more than the {num_envs} envs: "
                         "each worker needs at least one env")
    if async_mode:
        if num_workers is None:
            num_workers = _capped(default_num_workers(num_envs, caller_steps is not False, async_mode, busy_cpus,
                                                      shares_with_busy=shares_with_busy),
                                  caller_steps is not False, max_concurrency)
        if caller_steps is None:  # as in lock-step: with an env and a usable CPU left for it
            caller_steps = num_workers < min(num_envs, usable_cpus())
    elif caller_steps is None:
        # A slice for the caller only with a CPU left for it: one stepping
        # process more than the CPUs makes every batch wait for turns
        # (CartPole x64, num_workers=2 on 2 CPUs: 1.43x SyncVectorEnv with
        # the caller stepping, 1.96x without; beside two CPU hogs 0.74x and
        # 1.09x; medians of 6 fresh processes).
        caller_steps = num_workers is None or num_workers < min(num_envs, usable_cpus())
    if num_workers is None:
        num_workers = _capped(default_num_workers(num_envs, caller_steps, async_mode, busy_cpus, follows,
                                                  shares_with_busy), caller_steps, max_concurrency)
    if max_concurrency is not None and num_workers + caller_steps > max_concurrency:
        if not (caller_chosen and num_workers <= max_concurrency):
            raise ValueError(f"num_workers={num_workers}{' and the caller' if caller_steps else ''} would step "
                             f"{num_workers + caller_steps} envs at once, more than max_concurrency={max_concurrency}")
        caller_steps = False
    if caller_steps and num_workers >= num_envs:
        raise ValueError(f"caller_steps=True needs an env for the caller besides one per worker: "
                         f"{num_envs} envs for num_workers={num_workers}")
    if num_workers == 0 and not caller_steps:
        raise ValueError("num_workers=0 needs caller_steps=True (someone has to step the envs)")
    return int(num_workers), bool(caller_steps)


def _capped(num_workers: int, caller_steps: bool, max_concurrency: int | None) -> int:
    """shmvec's choice of workers within `max_concurrency` stepping processes
    (see plan_slices): at least one where the caller steps none."""
    if max_concurrency is None:
        return num_workers
    return min(num_workers, max(max_concurrency - caller_steps, 0 if caller_steps else 1))


def split_slices(num_envs: int, num_slices: int) -> list[range]:
    """Contiguous slices whose sizes differ by at most one, the larger ones
    last (the caller's slice, the first, is never the larger: it also runs
    the front end and the user's loop)."""
    base, extra = divmod(num_envs, num_slices)
    out, start = [], 0
    for k in range(num_slices):
        size = base + (1 if k >= num_slices - extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def check_pin_workers(pin: Any) -> None:
    if isinstance(pin, bool) or pin == "auto":
        return
    if not isinstance(pin, Sequence) or isinstance(pin, str):
        raise TypeError(f"pin_workers must be \"auto\", False, True or a list of CPU ids, got {pin!r}")
    allowed = set(allowed_cpu_ids())
    for cpu in pin:
        if isinstance(cpu, bool) or not isinstance(cpu, (int, np.integer)):
            raise TypeError(f"pin_workers must list CPU ids (ints), got {cpu!r}")
        if cpu not in allowed:
            raise ValueError(f"pin_workers lists CPU {cpu}, but this process may only run on CPUs {sorted(allowed)}")


def first_env_space(spaces: list, what: str) -> Any:
    """Env 0's space, as DummyVecEnv takes it (it checks none); the others'
    need only its leaves' shapes and dtypes, for one arena to serve all."""
    def layout(space):
        return [(leaf.path, leaf.shape, leaf.dtype) for leaf in leaves_of(space)]

    first = layout(spaces[0])
    for row, space in enumerate(spaces):
        if layout(space) != first:
            raise RuntimeError(f"env {row}'s {what} space {space} does not have the shapes and dtypes of env 0's, "
                               f"{spaces[0]}: their values cannot be batched")
    return spaces[0]


def check_observation_spaces(spaces: list, observation_mode: Any) -> tuple[Any, Any]:
    """(The single observation space the arena is laid out for, the batched
    space for "different" or None), after checking the envs' spaces as
    SyncVectorEnv does for `observation_mode` ("same", "different", or a
    (batched, single) pair of spaces)."""
    if observation_mode == "same":
        single = spaces[0]
        for row, space in enumerate(spaces):
            if space != single:
                raise RuntimeError(
                    "ShmVecEnv(..., observation_mode='same') however the sub-environments observation spaces "
                    f"are not equivalent. single_observation_space={single}, sub-environment {row} "
                    f"observation_space={space}. If this is intentional, use `observation_mode='different'` instead."
                )
        return single, None
    # Gymnasium 1.x only, as observation_mode (the front end refuses it on 0.29)
    from gymnasium.spaces.utils import is_space_dtype_shape_equiv

    batched = None
    if observation_mode == "different":
        from gymnasium.vector.utils import batch_differing_spaces

        batched = batch_differing_spaces(spaces)  # raises first where SyncVectorEnv's does (spaces of other types)
    single = spaces[0] if observation_mode == "different" else observation_mode[1]
    for row, space in enumerate(spaces):
        if not is_space_dtype_shape_equiv(space, single):
            raise RuntimeError(
                "ShmVecEnv(..., observation_mode='different' or custom space) however the sub-environments "
                f"observation spaces do not share a common shape and dtype, single_observation_space={single}, "
                f"sub-environment {row} observation space={space}"
            )
    return single, batched


def check_options(env_fns: Sequence, num_workers: Any, caller_steps: Any, async_mode: bool, timeout: Any,
                  start_method: str | None, pin_workers: Any, max_restarts: Any) -> tuple[list, float, str]:
    """Checks the engine's options; returns (env_fns as a list, the timeout in
    seconds, < 0 for none, the start method)."""
    env_fns = list(env_fns)
    if not env_fns:
        raise ValueError("env_fns is empty: pass at least one env factory")
    if not all(callable(fn) for fn in env_fns):
        raise TypeError("env_fns must be callables that each return a gymnasium.Env")
    if num_workers is not None and (not isinstance(num_workers, (int, np.integer)) or isinstance(num_workers, bool)):
        raise TypeError(f"num_workers must be an int or None, got {num_workers!r}")
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)):
            raise TypeError(f"timeout must be a number of seconds or None, got {timeout!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    start_method = start_method or "forkserver"
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
    check_pin_workers(pin_workers)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, (int, np.integer)) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    seconds = -1.0 if timeout is None or timeout == float("inf") else float(timeout)
    return env_fns, seconds, start_method
