"""The measuring of ``shmvec bench``: the runs (env, backend, number of
envs) that its command line asks for, and the interleaved passes over them,
each run in a fresh process of its own (`measure_once`)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings

from shmvec._engine.system import usable_cpus
from shmvec.errors import PerformanceWarning
from shmvec.bench.measure import (Hogs, async_rate, concurrent_limit, isolated, mlp_policy, cnn_policy, tree_memory,
                                  vector_rate)
from shmvec.bench.peers import PEERS, build, single_action_space, workload_missing
from shmvec.bench.printed import take_printed

__all__ = ["shmvec_options", "in_atari_pipeline", "measure_once", "plan", "measure_all"]

TORCH_INSTALL = 'pip install "torch==2.13.0"'
POLICIES = {"mlp": mlp_policy, "cnn": cnn_policy}  # --policy


def shmvec_options(args: argparse.Namespace) -> dict:
    """The options `shmvec bench` passes to ShmVecEnv, as passed."""
    return {"num_workers": args.workers, "pin_workers": "auto" if args.pin_workers else False}


def _options(args: argparse.Namespace, peer: str) -> dict:
    if peer == "shmvec-async":
        return {**shmvec_options(args), "batch_size": args.async_batch}
    if peer == "shmvec-unpinned":
        return {**shmvec_options(args), "pin_workers": False}
    return shmvec_options(args) if PEERS[peer].takes_options else {}


def in_atari_pipeline(args: argparse.Namespace, spec: str) -> bool:
    """--atari applies to the ALE ids among the envs."""
    return args.atari and spec.startswith("ALE/")


def _layout(envs) -> dict:
    """What a ShmVecEnv made of its options: its number of workers, whether
    they were pinned (``pin_workers="auto"`` pins only when every worker gets
    a CPU of its own), and whether they ran on the caller's CPU instead at
    the end of the measurement (in lock-step while other programs keep
    every CPU busy)."""
    engine = envs._engine  # a shmvec ShmVecEnv: only peers that take shmvec's options get here
    return {"workers": envs.num_workers, "pinned": any(cpu is not None for cpu in engine.pool.cpus),
            "on_callers_cpu": engine._placement is not None and engine._placement.following}


def _performance_warnings(caught: list) -> list[str]:
    """The text of shmvec's PerformanceWarnings among `caught` (measure_all
    makes each one note, not one warning per measurement); any other warning
    is shown as usual."""
    told = []
    for w in caught:
        if issubclass(w.category, PerformanceWarning):
            told.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return list(dict.fromkeys(told))


def measure_once(peer: str, spec: str, num_envs: int, seconds: float, options: dict | None = None,
                 atari: bool = False, policy: str | None = None, policy_device: str = "cpu",
                 busy_late: tuple[int, bool] = (0, False)) -> dict:
    """One measurement, meant for a fresh process; `options` go to
    ShmVecEnv (with ``batch_size`` below `num_envs`, the async loop runs);
    the `policy`, if any, runs on torch's `policy_device`; `busy_late`: the
    Hogs (count, own_sessions) that start after the warm-up, once the
    vector env has been made and has stepped."""
    options = options or {}
    if policy:
        import torch  # before the envs, as a training script imports it at the top

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        envs = build(peer, spec, num_envs, atari=atari, **options)
    hogs = Hogs(*busy_late)
    try:
        extra = {}
        told = _performance_warnings(caught)
        if told:
            extra["performance_warnings"] = told
        pick = None
        if policy:
            observation_space = getattr(envs, "single_observation_space", None) or envs.observation_space
            pick = POLICIES[policy](observation_space, single_action_space(envs), device=policy_device)
            extra.update(torch_threads=torch.get_num_threads(), policy_device=policy_device)
        if options.get("batch_size", num_envs) < num_envs:
            rate = async_rate(envs, seconds, pick, hogs.__enter__)
        else:
            rate = vector_rate(envs, num_envs, seconds, pick, hogs.__enter__)
        memory = tree_memory()
        if PEERS[peer].takes_options:
            extra.update(_layout(envs))
    finally:
        hogs.stop()
        envs.close()
    return {"steps_per_s": rate, "peak_rss_mib": memory["peak_rss_mib"], **extra}


def _device_missing(device: str) -> str | None:
    """Why torch cannot run a policy on `device` here, or None if it can.
    (The bench's measurements run in spawned processes: torch's state in
    this one does not reach them.)"""
    if device == "cpu":
        return None  # (no torch import in this process for the default)
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        return f"--policy-device {device!r} is not a torch device ({exc})"
    if kind == "cpu":
        return None
    backend = getattr(torch, kind, None)
    count = backend.device_count() if backend is not None and hasattr(backend, "device_count") else 0
    return None if count else f"torch sees no {kind} device here (--policy-device {device})"


def plan(specs: list[str], args: argparse.Namespace) -> tuple[list[str], list[tuple], list[str]]:
    """The envs to measure, the (env, backend, num_envs) runs to do, and
    notes on those skipped."""
    notes = []
    if args.policy and importlib.util.find_spec("torch") is None:
        return [], [], [f"skipping --policy {args.policy}: torch is not installed ({TORCH_INSTALL})"]
    missing_device = args.policy and _device_missing(args.policy_device)
    if missing_device:
        return [], [], [f"skipping --policy {args.policy}: {missing_device}"]
    ready = []
    for spec in specs:
        missing = workload_missing(spec, in_atari_pipeline(args, spec))
        if missing:
            notes.append(f"skipping {missing}")
        else:
            ready.append(spec)
    jobs = []
    for spec in ready:
        for name in args.backends:
            peer = PEERS[name]
            if not peer.is_vector_env and args.policy:
                notes.append(f"skipping {name}: its plain loops have no policy")
                continue
            if name == "shmvec-async" and args.async_batch is None:
                notes.append("skipping shmvec-async: it needs --async-batch B")
                continue
            reason = peer.unavailable(spec, in_atari_pipeline(args, spec))
            if reason:
                notes.append(f"skipping {reason}")
                continue
            capped = [n for n in args.num_envs if peer.max_envs and n > peer.max_envs]
            if capped:
                notes.append(f"skipping {name} at {','.join(map(str, capped))} envs on {spec}: "
                             f"it starts a process per env (capped at {peer.max_envs})")
            if name == "shmvec-async":
                capped += [n for n in args.num_envs if n <= args.async_batch]
                if any(n <= args.async_batch for n in args.num_envs):
                    notes.append(f"skipping shmvec-async at envs <= --async-batch {args.async_batch}")
            jobs += [(spec, name, n) for n in args.num_envs if n not in capped]
    return ready, jobs, list(dict.fromkeys(notes))


class _Progress:
    """A bar and what runs now, on one line of stderr (one line per run
    when stderr is not a terminal)."""

    WIDTH = 24

    def __init__(self, total: int):
        self.total = total
        self.count = 0
        self.tty = sys.stderr.isatty()

    def show(self, what: str) -> None:
        filled = self.WIDTH * self.count // max(1, self.total)
        self.count += 1
        line = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.count}/{self.total} {what}"
        sys.stderr.write(f"\r\033[K{line}" if self.tty else f"{line}\n")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        self.clear()
        print(f"note: {text}", file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def measure_all(specs: list[str], jobs: list[tuple], args: argparse.Namespace,
                notes: list[str]) -> tuple[dict[str, list[dict]], dict[tuple, list[dict]]]:
    """`args.passes` interleaved passes: in each, the limit of every env a job steps, then
    every job, each in fresh processes, with `args.busy` hogs running (with
    `args.busy_late`, a vector env's only once it has been made and warmed up). A
    failure becomes a note, not the end of the run, and is not retried.
    Returns the limit measurements of each env and the results of each job,
    one per pass that succeeded."""
    specs = [spec for spec in specs if any(job[0] == spec for job in jobs)]  # a limit only where a job needs it
    progress = _Progress(args.passes * (len(specs) + len(jobs)))
    for note in notes:
        progress.note(note)
    failed: set = set()

    def attempt(key, what: str, fn, *fn_args, busy: int = args.busy):
        progress.show(what)
        if key in failed:
            return None
        try:
            with Hogs(busy, own_sessions=args.busy_apart):
                return fn(*fn_args)
        except RuntimeError as exc:
            failed.add(key)
            notes.append(f"{what} failed: {str(exc).strip().splitlines()[-1]}")
            progress.note(notes[-1])
            return None
        finally:
            printed = take_printed()  # each line once in the run, not once per env and measurement
            if printed:
                notes.append(f"{what} printed (shown once):" + "".join(f"\n    {line}" for line in printed))
                progress.note(notes[-1])

    limit_runs: dict[str, list[dict]] = {}
    measured: dict[tuple, list[dict]] = {}
    for done in range(args.passes):
        tag = f"pass {done + 1}/{args.passes}: " if args.passes > 1 else ""
        for spec in specs:
            limit = attempt(spec, f"{tag}{spec}: limit, {usable_cpus()} plain loops at once",
                            concurrent_limit, spec, args.seconds, in_atari_pipeline(args, spec))
            if limit is not None:
                limit_runs.setdefault(spec, []).append(limit)
        for spec, name, n in jobs:
            if spec not in limit_runs:
                continue
            what = f"{tag}{spec}: {name} x{n}"
            if not PEERS[name].is_vector_env:
                result = attempt((spec, name, n), what, concurrent_limit, spec, args.seconds,
                                 in_atari_pipeline(args, spec), None, n)
            else:
                result = attempt((spec, name, n), what, isolated, measure_once, name, spec, n, args.seconds,
                                 _options(args, name), in_atari_pipeline(args, spec), args.policy,
                                 args.policy_device, (args.busy if args.busy_late else 0, args.busy_apart),
                                 busy=0 if args.busy_late else args.busy)
            if result is not None:
                measured.setdefault((spec, name, n), []).append(result)
                for text in result.get("performance_warnings", ()):
                    note = f"{name} on {spec}: {text}"
                    if note not in notes:
                        notes.append(note)
                        progress.note(note)
    progress.clear()
    return limit_runs, measured
