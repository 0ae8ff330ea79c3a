"""How the benchmarks measure: stepping loops timed with actions made
beforehand or chosen by a small torch policy, async recv/send loops, the
machine's limit (one plain single-env loop per usable CPU, all at once),
CPU hogs that load the machine as a learner's other work would, fresh
processes that keep one measurement from disturbing the next, and the memory
of a process tree (read from /proc, so Linux only)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from gymnasium.vector.utils import batch_space

from shmvec._engine.plan import split_slices
from shmvec._engine.system import usable_cpus
from shmvec.bench.peers import env_factory, single_action_space
from shmvec.bench.printed import PrintedFolder

__all__ = ["action_batches", "plain_envs", "step_for", "warmup_seconds", "vector_rate", "async_rate", "mlp_policy",
           "cnn_policy", "plain_step", "single_env_rate", "concurrent_limit", "Hogs", "tree_memory", "proc_field",
           "FreshProcess", "isolated"]

# Actions are made beforehand and cycled through, so that making them costs
# nothing in the timed loop. The cycle is long: a short one (it was 64
# batches) drives each env into a gait of its own, and some HalfCheetahs
# then stepped 10% slower than others for the whole run (see "The bench's
# actions" in docs/performance.md). Very large batches get fewer, to bound
# the memory (never under 64).
ACTION_BATCHES = 4096
ACTION_BYTES = 4 << 20


def action_batches(space, num_envs: int | None, count: int | None = None, seed: int = 0) -> list:
    """`count` seeded samples of `space` batched `num_envs` times (single
    actions when `num_envs` is None); by default ACTION_BATCHES, or as many
    as fit in ACTION_BYTES."""
    space = space if num_envs is None else batch_space(space, num_envs)
    space.seed(seed)
    first = space.sample()
    if count is None:
        count = max(64, min(ACTION_BATCHES, ACTION_BYTES // max(1, _nbytes(first))))
    return [first] + [space.sample() for _ in range(count - 1)]


def _nbytes(value: Any) -> int:
    """The bytes of a sample's arrays (dicts and tuples of them too)."""
    if isinstance(value, dict):
        return sum(map(_nbytes, value.values()))
    if isinstance(value, tuple):
        return sum(map(_nbytes, value))
    return getattr(value, "nbytes", 8)


def step_for(step: Callable[[Any], Any], actions: list, seconds: float) -> tuple[int, float]:
    """Calls `step` with each of `actions` in turn for `seconds`; returns the
    number of calls and the time they took."""
    calls = 0
    start = now = time.perf_counter()
    end = start + seconds
    while now < end:
        step(actions[calls % len(actions)])
        calls += 1
        now = time.perf_counter()
    return calls, now - start


def warmup_seconds(seconds: float) -> float:
    """Stepping before the clock starts: caches, spin budgets, lazy imports."""
    return min(1.0, seconds / 4)


def _obs(reset_result):
    """The observations of a reset, Gymnasium's (obs, infos) or SB3's obs."""
    return reset_result[0] if isinstance(reset_result, tuple) and len(reset_result) == 2 else reset_result


def vector_rate(envs, num_envs: int, seconds: float, policy: Callable | None = None,
                after_warmup: Callable[[], Any] = lambda: None) -> float:
    """Env steps per second of a vector env over `seconds`, after a warm-up
    (and then `after_warmup()`); with a `policy` (observations -> actions),
    it picks every batch's actions inside the timed loop, as in training."""
    obs = [_obs(envs.reset())]  # no seed: SB3's reset takes none
    if policy is None:
        step, actions = envs.step, action_batches(single_action_space(envs), num_envs)
    else:
        def step(_) -> None:
            obs[0] = envs.step(policy(obs[0]))[0]

        actions = [None]
    step_for(step, actions, warmup_seconds(seconds))
    after_warmup()
    calls, elapsed = step_for(step, actions, seconds)
    return calls * num_envs / elapsed


def async_rate(envs, seconds: float, policy: Callable | None = None,
               after_warmup: Callable[[], Any] = lambda: None) -> float:
    """Env steps per second of a ShmVecEnv in async mode (``batch_size`` below
    ``num_envs``): ``recv()`` the first envs to finish, ``send()`` them
    actions; after a warm-up and `after_warmup()`, as vector_rate."""
    envs.async_reset(seed=0)
    batches = action_batches(envs.single_action_space, envs.batch_size)
    steps = [0]

    def step(actions) -> None:
        obs, *_, infos = envs.recv()
        env_ids = infos["env_id"]
        envs.send(actions if policy is None else policy(obs), env_ids)
        steps[0] += len(env_ids)

    step_for(step, batches, warmup_seconds(seconds))
    after_warmup()
    steps[0] = 0
    _, elapsed = step_for(step, batches, seconds)
    return steps[0] / elapsed


def mlp_policy(observation_space, action_space, hidden: int = 64, device: str = "cpu") -> Callable[[Any], Any]:
    """A small torch MLP (obs -> 64 -> 64 -> actions, tanh, like CleanRL's PPO
    agent) that picks a batch of actions from a batch of observations:
    sampled from its logits (Discrete), or its mean plus unit noise, clipped
    (Box). Torch keeps its default threads: that is what users run, and
    those threads compete with the envs' processes. On another `device`
    (a GPU) the observations go to it and the actions come back each batch."""
    import numpy as np
    import torch

    from gymnasium import spaces

    if not isinstance(observation_space, spaces.Box):
        raise ValueError(f"--policy mlp needs a Box observation space, got {observation_space}")
    size = int(np.prod(observation_space.shape))
    if isinstance(action_space, spaces.Discrete):
        outputs = int(action_space.n)
    elif isinstance(action_space, spaces.Box):
        outputs = int(np.prod(action_space.shape))
        low = torch.as_tensor(action_space.low, dtype=torch.float32, device=device).flatten()
        high = torch.as_tensor(action_space.high, dtype=torch.float32, device=device).flatten()
    else:
        raise ValueError(f"--policy mlp needs a Discrete or Box action space, got {action_space}")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(size, hidden), torch.nn.Tanh(),
                              torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                              torch.nn.Linear(hidden, outputs)).to(device)

    @torch.inference_mode()
    def policy(obs):
        x = torch.as_tensor(np.asarray(obs), dtype=torch.float32, device=device).reshape(len(obs), size)
        out = net(x)
        if isinstance(action_space, spaces.Discrete):
            return torch.multinomial(torch.softmax(out, dim=-1), 1).squeeze(1).cpu().numpy()
        actions = torch.clamp(out + torch.randn_like(out), low, high)
        return actions.reshape(len(obs), *action_space.shape).cpu().numpy().astype(action_space.dtype)

    return policy


def cnn_policy(observation_space, action_space, device: str = "cpu") -> Callable[[Any], Any]:
    """CleanRL's Atari agent (ppo_atari.py: the Nature DQN convolutions, then
    512 units, on observations / 255) picking a batch of actions, sampled
    from its logits. For images, channels first (Gymnasium's Atari pipeline
    gives 4 x 84 x 84) or last where that dimension is the smallest, as
    SB3 tells them. Torch keeps its default threads: its forward pass takes
    milliseconds on a CPU, and needs them."""
    import numpy as np
    import torch

    from gymnasium import spaces

    shape = tuple(getattr(observation_space, "shape", None) or ())
    if len(shape) != 3:
        shape = (0, 0, 0)  # (refused below)
    last = shape[2] < min(shape[:2])  # channels last
    channels, height, width = (shape[2], *shape[:2]) if last else shape
    if not isinstance(observation_space, spaces.Box) or min(height, width) < 36:
        raise ValueError("--policy cnn needs image observations, at least 36 x 36 (such as --atari's 4 x 84 x 84), "
                         f"got {observation_space}")
    if not isinstance(action_space, spaces.Discrete):
        raise ValueError(f"--policy cnn needs a Discrete action space, got {action_space}")
    nn = torch.nn
    torch.manual_seed(0)
    convolutions = nn.Sequential(nn.Conv2d(channels, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2),
                                 nn.ReLU(), nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten())
    with torch.no_grad():
        features = convolutions(torch.zeros(1, channels, height, width)).shape[1]
    net = nn.Sequential(convolutions, nn.Linear(features, 512), nn.ReLU(),
                        nn.Linear(512, int(action_space.n))).to(device)

    @torch.inference_mode()
    def policy(obs):
        x = torch.as_tensor(np.asarray(obs), device=device).float() / 255.0
        if last:
            x = x.permute(0, 3, 1, 2)
        return torch.multinomial(torch.softmax(net(x), dim=-1), 1).squeeze(1).cpu().numpy()

    return policy


def plain_step(env) -> Callable[[Any], None]:
    """Steps one env with an action, resetting it when an episode ends: the
    body of a plain loop, no vector env."""

    def step(action) -> None:
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset()

    return step


def single_env_rate(spec: str, seconds: float, atari: bool = False) -> float:
    """Steps per second of one env of `spec` in a plain loop, alone."""
    env = env_factory(spec, atari)()
    try:
        env.reset(seed=0)
        step = plain_step(env)
        actions = action_batches(env.action_space, None)
        step_for(step, actions, warmup_seconds(seconds))
        calls, elapsed = step_for(step, actions, seconds)
    finally:
        env.close()
    return calls / elapsed


_loop: list = []  # this process's plain loop (envs, step, actions), between _prepare_loop and _run_loop


def plain_envs(spec: str, atari: bool, count: int) -> tuple[list, list[Callable[[Any], None]]]:
    """`count` envs of `spec`, reset with seeds 0, 1, ..., and each one's
    plain_step."""
    envs = [env_factory(spec, atari)() for _ in range(count)]
    for seed, env in enumerate(envs):
        env.reset(seed=seed)
    return envs, [plain_step(env) for env in envs]


def _prepare_loop(spec: str, atari: bool, warmup: float, count: int = 1, cpu: int | None = None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    envs, steps = plain_envs(spec, atari, count)

    def step_all(action) -> None:  # every env of the loop, one after another, with the same action
        for one in steps:
            one(action)

    # One env (the limit): its own step, so that the limit pays no call more than a plain loop.
    step = steps[0] if count == 1 else step_all
    actions = action_batches(envs[0].action_space, None)
    step_for(step, actions, warmup)
    _loop.append((envs, step, actions))


def _run_loop(start_at: float, seconds: float) -> float:
    envs, step, actions = _loop.pop()
    time.sleep(max(0.0, start_at - time.monotonic()))  # CLOCK_MONOTONIC is one clock for all processes
    calls, elapsed = step_for(step, actions, seconds)
    for env in envs:
        env.close()
    return len(envs) * calls / elapsed


def concurrent_limit(spec: str, seconds: float, atari: bool = False, processes: int | None = None,
                     num_envs: int | None = None, pin: bool = False) -> dict:
    """The machine's limit, measured: one fresh process per usable CPU, each
    stepping one env of `spec` in a plain loop, all starting at the same
    moment for the same `seconds`; their rates summed. Unlike usable CPUs x
    one loop's rate, it counts what running at once costs (shared caches,
    memory bandwidth, turbo, other load such as `Hogs`). Returns
    ``{"steps_per_s": sum, "loops": [each loop's steps/s]}``.

    With `num_envs`, each loop steps its share of `num_envs` envs (split as
    shmvec splits them) instead of one: the "uncoupled" row, the pace of
    fixed shares that never wait for each other. Against it, a lock-step
    vector env over as many processes shows what waiting for the slowest
    costs, apart from what more envs per process cost.

    With `pin`, loop i runs on the i-th CPU this process may use, and the
    result's ``"cpus"`` says which: what each CPU gives while all are busy."""
    count = processes or usable_cpus()
    shares = [len(rows) for rows in split_slices(num_envs, count)] if num_envs else [1] * count
    shares = [share for share in shares if share]
    cpus: list = [None] * len(shares)
    if pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(shares) > len(cpus):
            raise ValueError(f"pin=True needs a CPU per loop: {len(shares)} loops, {len(cpus)} CPUs")
        cpus = cpus[:len(shares)]
    workers = [FreshProcess() for _ in shares]
    try:
        for process, share, cpu in zip(workers, shares, cpus):
            process.send(_prepare_loop, spec, atari, warmup_seconds(seconds), share, cpu)
        for process in workers:  # every env made and warm: now start together
            process.receive()
        start_at = time.monotonic() + 0.05
        for process in workers:
            process.send(_run_loop, start_at, seconds)
        loops = [process.receive() for process in workers]
    finally:
        for process in workers:
            process.close()
    return {"steps_per_s": sum(loops), "loops": loops, **({"cpus": cpus} if pin else {})}


# A hog spins until stopped, or until the process that started it is gone
# (it checks every few milliseconds), so that not even a killed bench leaves one behind.
_HOG = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    for _ in range(20000): pass\n"


class Hogs:
    """`count` processes spinning on the CPU while a measurement runs: the
    learner's other work (data loading, logging) on a busy machine. A
    context manager; they are stopped on leaving it, also on an error or
    Ctrl-C.

    They run in the measuring process's session. With `own_sessions`, each
    gets a session of its own, as another job started from another terminal
    would: where the kernel groups processes by session
    (/proc/sys/kernel/sched_autogroup_enabled, on in most distributions), each
    session then gets an equal share of the CPUs, so all the processes of a
    vector env together get what a single process gets."""

    def __init__(self, count: int, own_sessions: bool = False):
        self.count = count
        self.own_sessions = own_sessions
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> Hogs:
        # Apart from the terminal's foreground group either way: Ctrl-C
        # reaches the bench, which stops them.
        apart = {"start_new_session": True} if self.own_sessions else {"preexec_fn": os.setpgrp}
        try:
            for _ in range(self.count):
                self.processes.append(subprocess.Popen([sys.executable, "-c", _HOG], stdin=subprocess.DEVNULL,
                                                       **apart))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        while self.processes:
            process = self.processes.pop()
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


def _descendants(pid: int) -> list[int]:
    children = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:  # it ended meanwhile
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])  # the name before ")" may hold spaces
            children[ppid].append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children[todo.pop()]
        found += kids
        todo += kids
    return found


def proc_field(path: str, field: str) -> int:
    """The number after `field:` in a /proc file such as /proc/PID/status
    (kB for memory fields, a count for context switches); 0 if the process
    ended meanwhile."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:  # it ended meanwhile
        pass
    return 0


def tree_memory(pid: int | None = None) -> dict[str, float]:
    """Memory of a process and all its descendants (workers, fork servers),
    in MiB: `peak_rss_mib` sums each one's peak resident set (pages shared
    between them count in each); `pss_mib` sums their proportional set size
    now (a shared page counts once, split between its sharers)."""
    pids = [pid or os.getpid()]
    pids += _descendants(pids[0])
    return {
        "peak_rss_mib": sum(proc_field(f"/proc/{p}/status", "VmHWM") for p in pids) / 1024,
        "pss_mib": sum(proc_field(f"/proc/{p}/smaps_rollup", "Pss") for p in pids) / 1024,
        "processes": len(pids),
    }


_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """Ends this process when the bench process ends, killed included: a
    measurement would otherwise run on (for as long as its hogs spin, with
    --busy-late), and report into a closed pipe."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the prctl
        os._exit(1)


def _serve(conn, parent: int, printed_into: str) -> None:
    PrintedFolder.enter_in_child(printed_into)
    _die_with(parent)
    try:
        while True:
            try:
                fn, args = conn.recv()
            except (EOFError, ConnectionResetError):  # the caller is done, or gone
                return
            try:
                reply = (True, fn(*args))
            except Exception:
                reply = (False, traceback.format_exc())
            try:
                conn.send(reply)
            except (BrokenPipeError, ConnectionResetError):  # the caller stopped (Ctrl-C, an error) and went
                return
    except KeyboardInterrupt:  # Ctrl-C reaches us too; the caller reports it
        return


class FreshProcess:
    """A new interpreter (spawn) that runs the calls sent to it: what it
    measures is not disturbed by earlier measurements (threads, fork servers,
    memory high-water marks). `fn` must be importable by name. What it and
    its own processes print is kept aside, for `printed.take_printed`."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self._printed = PrintedFolder()
        self._conn, child = ctx.Pipe()
        # Not a daemon: the vector envs it measures start processes of their own.
        self._process = ctx.Process(target=_serve, args=(child, os.getpid(), self._printed.path),
                                    name="shmvec-bench")
        try:
            self._process.start()
        except BaseException:
            self._printed.collect()
            raise
        child.close()

    def call(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` in the process; its exception comes back as a
        RuntimeError whose message is the remote traceback."""
        self.send(fn, *args)
        return self.receive()

    def send(self, fn: Callable, *args: Any) -> None:
        """Starts `fn(*args)` in the process; `receive` returns its result
        (so that several processes can run at once)."""
        self._conn.send((fn, args))

    def receive(self) -> Any:
        try:
            ok, value = self._conn.recv()
        except EOFError:
            self._process.join(1.0)
            # (what it printed, a crash's last words among it, reaches take_printed on close)
            raise RuntimeError(f"the benchmark process died (exit code {self._process.exitcode})") from None
        if not ok:
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        self._conn.close()  # it sees end-of-file and returns
        self._process.join()
        self._printed.collect()

    def __enter__(self) -> FreshProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def isolated(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` in a fresh process of its own."""
    with FreshProcess() as process:
        return process.call(fn, *args)
