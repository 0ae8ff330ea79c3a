"""``shmvec bench``: env steps per second of shmvec and of every installed
peer on this machine, as a table, a JSON file and a plot.

Each measurement runs in a fresh process, so that none disturbs the next
and each one's peak memory is its own. Usage: ``shmvec bench --help``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from shmvec._engine.system import usable_cpus
from shmvec.bench import passes, report
from shmvec.bench.peers import PEERS, env_factory, workload_missing

__all__ = ["add_arguments", "run"]

DEFAULT_ENVS = ["CartPole-v1"]
DEFAULT_NUM_ENVS = [8, 64, 256]
# Three interleaved passes of half a second: about a minute and a half for the
# default CartPole run, and medians that one slow moment does not move.
DEFAULT_SECONDS = 0.5
DEFAULT_PASSES = 3
# Rows for a question of their own, not a default comparison.
ONLY_WHEN_NAMED = ("shmvec-unpinned", "uncoupled")


def _env_spec(text: str) -> str:
    if workload_missing(text):  # skipped with a note, not refused
        return text
    try:
        env_factory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _num_envs(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return list(dict.fromkeys(counts))  # a count named twice is one row, not two passes of it


def _backends(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown backend {', '.join(map(repr, unknown)) or repr(text)}; choose from {', '.join(PEERS)}")
    return names


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _int_from(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"expected an integer of {least} or more, got {text!r}")
    return value


def _workers(text: str) -> int:
    return _int_from(text, 0)


def _count(text: str) -> int:
    return _int_from(text, 1)


def _output_problem(path: str | None, what: str) -> str | None:
    """Why `path` cannot be written, found before minutes of measuring, or None."""
    if path is None:
        return None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"{what} {path!r}: no folder {folder!r} to write it in"
    if os.path.isdir(path):
        return f"{what} {path!r} is a folder: name the file to write"
    existed = os.path.exists(path)
    try:  # what access() cannot tell (a file only root could make, in /proc): the file itself
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"{what} {path!r} cannot be written: {exc.strerror or exc}"
    if not existed:
        os.remove(path)
    if what == "--plot":
        try:
            import matplotlib.figure
        except ImportError:
            return None  # a note at the end says so
        extension = os.path.splitext(path)[1].lstrip(".").lower()
        formats = matplotlib.figure.Figure().canvas.get_supported_filetypes()
        if extension not in formats:
            return f"--plot {path!r}: matplotlib writes {', '.join(sorted(formats))}, not {extension!r}"
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("env", nargs="*", type=_env_spec, metavar="ENV_ID",
                        help="registered gymnasium env ids or module:callable env factories "
                             f"(default: {' '.join(DEFAULT_ENVS)})")
    parser.add_argument("--env", dest="env_options", action="append", default=[], type=_env_spec,
                        metavar="ENV_ID", help="one more env, as the positional ENV_ID (repeatable)")
    parser.add_argument("--atari", action="store_true",
                        help="wrap each ALE env (such as ALE/Pong-v5) in Gymnasium's Atari pipeline: "
                             "frameskip=1, AtariPreprocessing(frame_skip=4, screen_size=84, grayscale_obs=True), "
                             "FrameStackObservation(4); adds ale-py's and EnvPool's native vector envs as peers")
    parser.add_argument("--num-envs", type=_num_envs, default=DEFAULT_NUM_ENVS, metavar="N,N,...",
                        help=f"numbers of envs (default: {','.join(map(str, DEFAULT_NUM_ENVS))})")
    parser.add_argument("--workers", type=_workers, default=None, metavar="N",
                        help="shmvec worker processes (default: shmvec's, one per usable CPU "
                             "less the caller, which steps a slice itself)")
    parser.add_argument("--no-pin-workers", dest="pin_workers", action="store_false",
                        help="leave shmvec's workers unpinned (default: pin_workers=\"auto\")")
    parser.add_argument("--backends", type=_backends, default=None, metavar="NAME,...",
                        help=f"what to compare (default: all that are installed and can run the env: "
                             f"{','.join(p for p in PEERS if p not in ONLY_WHEN_NAMED)}; shmvec-async with "
                             "--async-batch; only when named: shmvec-unpinned, pin_workers=False, and "
                             "uncoupled, one plain loop per usable CPU over its share of the envs, none "
                             "waiting for another: what lock-step costs is shmvec's gap to it)")
    parser.add_argument("--seconds", type=_positive, default=DEFAULT_SECONDS, metavar="S",
                        help=f"timed stepping per measurement, after a warm-up (default: {DEFAULT_SECONDS})")
    parser.add_argument("--passes", type=_count, default=DEFAULT_PASSES, metavar="P",
                        help="interleaved passes over all configurations, each in a fresh process; "
                             f"the table shows medians and min-max (default: {DEFAULT_PASSES})")
    parser.add_argument("--policy", choices=["mlp", "cnn"], default=None,
                        help="a torch policy picks every batch's actions from the observations inside the timed "
                             "loop, at torch's default threads (shmvec's torch_threads=\"auto\" manages them while "
                             "its env is open): mlp, a small MLP (obs -> 64 -> 64 -> actions); cnn, CleanRL's Atari "
                             "CNN, for image observations (such as --atari's)")
    parser.add_argument("--policy-device", default="cpu", metavar="DEVICE",
                        help="the torch device the --policy runs on, such as cuda or cuda:1 (default: cpu); "
                             "observations go to it and actions come back every batch, as in training")
    parser.add_argument("--busy", type=_workers, default=0, metavar="N",
                        help="N processes spinning on the CPU during every measurement, the limit's too "
                             "(default: 0); in the bench's session, as a learner's own other work")
    parser.add_argument("--busy-apart", action="store_true",
                        help="start the --busy processes in sessions of their own, as another job from "
                             "another terminal: where the kernel shares the CPUs between sessions "
                             "(autogroup), a vector env's processes together then get one process's share")
    parser.add_argument("--busy-late", action="store_true",
                        help="start the --busy processes only once each vector env has been made and warmed up, "
                             "as other programs that start while a learner steps (the limit's and the plain "
                             "loops' run from the start)")
    parser.add_argument("--async-batch", type=_count, default=None, metavar="B",
                        help="adds the row shmvec-async: ShmVecEnv(batch_size=B), async_reset, recv, "
                             "send(actions, infos['env_id']) (at envs > B)")
    parser.add_argument("--plot", metavar="FILE.png", help="write a plot of steps/s against envs")
    parser.add_argument("--json", metavar="FILE.json", help="write the results as JSON")


def default_backends(async_batch: int | None) -> list[str]:
    """Every backend but those run only when named; shmvec-async only when
    --async-batch asks for it."""
    return [name for name in PEERS if name not in ONLY_WHEN_NAMED and (name != "shmvec-async" or async_batch)]


def run(args: argparse.Namespace) -> int:
    specs = list(dict.fromkeys([*args.env, *args.env_options])) or DEFAULT_ENVS
    if args.atari and not any(passes.in_atari_pipeline(args, spec) for spec in specs):
        print("error: --atari takes ALE ids (such as ALE/Pong-v5)", file=sys.stderr)
        return 2
    if args.policy_device != "cpu" and not args.policy:
        print("error: --policy-device needs --policy mlp or cnn", file=sys.stderr)
        return 2
    if (args.busy_apart or args.busy_late) and not args.busy:
        print("error: --busy-apart and --busy-late need --busy N", file=sys.stderr)
        return 2
    for problem in (_output_problem(args.json, "--json"), _output_problem(args.plot, "--plot")):
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if args.backends is None:
        args.backends = default_backends(args.async_batch)
    elif args.async_batch and "shmvec-async" not in args.backends:
        print("note: --async-batch measures the row shmvec-async, which --backends does not name", file=sys.stderr)
    cpus = usable_cpus()
    specs, jobs, notes = passes.plan(specs, args)
    limit_runs, measured = passes.measure_all(specs, jobs, args, notes)
    if not measured:
        print("error: nothing could be measured (see the notes above)", file=sys.stderr)
        return 1
    limits = report.limit_medians(limit_runs)
    rows = report.result_rows(measured, limits)

    about = report.about_the_run(cpus)
    title = report.title_line(about, args)
    print(title)
    print(report.table(rows, limits, args, cpus))
    if args.json:
        report.write_json(args.json, about, args, specs, limits, rows, notes)
    if args.plot:
        missing = report.plot(rows, limits, args.plot, title)
        if missing:
            print(f"note: {missing}", file=sys.stderr)
    return 0
