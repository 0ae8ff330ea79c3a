"""``shmvec bench``: env steps per second of shmvec and of every installed
peer on this machine, as a table, a JSON file and a plot.

Each measurement runs in a fresh process, so that none disturbs the next
and each one's peak memory is its own. Usage: ``shmvec bench --help``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import platform
import statistics
import sys

import shmvec
from shmvec._system import usable_cpus
from shmvec.bench.measure import Hogs, async_rate, concurrent_limit, isolated, mlp_policy, tree_memory, vector_rate
from shmvec.bench.peers import PEERS, build, env_factory, single_action_space, workload_missing

__all__ = ["add_arguments", "run", "measure_once"]

DEFAULT_ENVS = ["CartPole-v1"]
DEFAULT_NUM_ENVS = [8, 64, 256]
# Three interleaved passes of half a second: about a minute and a half for the
# default CartPole run, and medians that one slow moment does not move.
DEFAULT_SECONDS = 0.5
DEFAULT_PASSES = 3
TORCH_INSTALL = 'pip install "torch==2.13.0"'


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
    return counts


def _backends(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown backend {', '.join(map(repr, unknown)) or repr(text)}; choose from {', '.join(PEERS)}")
    return names


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _workers(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text!r}")
    return value


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
                             f"{','.join(PEERS)}; shmvec-async with --async-batch)")
    parser.add_argument("--seconds", type=_positive, default=DEFAULT_SECONDS, metavar="S",
                        help=f"timed stepping per measurement, after a warm-up (default: {DEFAULT_SECONDS})")
    parser.add_argument("--passes", type=_count, default=DEFAULT_PASSES, metavar="P",
                        help="interleaved passes over all configurations, each in a fresh process; "
                             f"the table shows medians and min-max (default: {DEFAULT_PASSES})")
    parser.add_argument("--policy", choices=["mlp"], default=None,
                        help="a small torch MLP (obs -> 64 -> 64 -> actions) picks every batch's actions "
                             "from the observations inside the timed loop, at torch's default threads (shmvec's "
                             "torch_threads=\"auto\" lowers them while its env is open)")
    parser.add_argument("--busy", type=_workers, default=0, metavar="N",
                        help="N processes spinning on the CPU during every measurement, the limit's too "
                             "(default: 0); in the bench's session, as a learner's own other work")
    parser.add_argument("--busy-apart", action="store_true",
                        help="start the --busy processes in sessions of their own, as another job from "
                             "another terminal: where the kernel shares the CPUs between sessions "
                             "(autogroup), a vector env's processes together then get one process's share")
    parser.add_argument("--async-batch", type=_count, default=None, metavar="B",
                        help="adds the row shmvec-async: ShmVecEnv(batch_size=B), async_reset, recv, "
                             "send(actions, infos['env_id']) (at envs > B)")
    parser.add_argument("--plot", metavar="FILE.png", help="write a plot of steps/s against envs")
    parser.add_argument("--json", metavar="FILE.json", help="write the results as JSON")


def _shmvec_options(args: argparse.Namespace) -> dict:
    """The options `shmvec bench` passes to ShmVecEnv, as passed."""
    return {"num_workers": args.workers, "pin_workers": "auto" if args.pin_workers else False}


def _options(args: argparse.Namespace, peer: str) -> dict:
    if peer == "shmvec-async":
        return {**_shmvec_options(args), "batch_size": args.async_batch}
    return _shmvec_options(args) if PEERS[peer].takes_options else {}


def _atari(args: argparse.Namespace, spec: str) -> bool:
    """--atari applies to the ALE ids among the envs."""
    return args.atari and spec.startswith("ALE/")


def _layout(envs) -> dict:
    """What a ShmVecEnv made of its options: its number of workers, and
    whether they were pinned (``pin_workers="auto"`` pins only when every
    worker gets a CPU of its own)."""
    cpus = getattr(getattr(envs, "_engine", None), "_cpus", None)
    return {"workers": envs.num_workers,
            "pinned": None if cpus is None else any(cpu is not None for cpu in cpus)}


def measure_once(peer: str, spec: str, num_envs: int, seconds: float, options: dict | None = None,
                 atari: bool = False, policy: str | None = None) -> dict:
    """One measurement, meant for a fresh process; `options` go to
    ShmVecEnv (with ``batch_size`` below `num_envs`, the async loop runs)."""
    options = options or {}
    if policy == "mlp":
        import torch  # before the envs, as a training script imports it at the top

    envs = build(peer, spec, num_envs, atari=atari, **options)
    try:
        extra = _layout(envs) if PEERS[peer].takes_options else {}
        pick = None
        if policy == "mlp":
            observation_space = getattr(envs, "single_observation_space", None) or envs.observation_space
            pick = mlp_policy(observation_space, single_action_space(envs))
            extra["torch_threads"] = torch.get_num_threads()
        if options.get("batch_size", num_envs) < num_envs:
            rate = async_rate(envs, seconds, pick)
        else:
            rate = vector_rate(envs, num_envs, seconds, pick)
        memory = tree_memory()
    finally:
        envs.close()
    return {"steps_per_s": rate, "peak_rss_mib": memory["peak_rss_mib"], **extra}


def _plan(specs: list[str], args: argparse.Namespace) -> tuple[list[str], list[tuple], list[str]]:
    """The envs to measure, the (env, backend, num_envs) runs to do, and
    notes on those skipped."""
    notes = []
    if args.policy == "mlp" and importlib.util.find_spec("torch") is None:
        return [], [], [f"skipping --policy mlp: torch is not installed ({TORCH_INSTALL})"]
    ready = []
    for spec in specs:
        missing = workload_missing(spec, _atari(args, spec))
        if missing:
            notes.append(f"skipping {missing}")
        else:
            ready.append(spec)
    jobs = []
    for spec in ready:
        for name in args.backends:
            peer = PEERS[name]
            if name == "shmvec-async" and args.async_batch is None:
                notes.append("skipping shmvec-async: it needs --async-batch B")
                continue
            reason = peer.unavailable(spec, _atari(args, spec))
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


def _spread(values: list[float]) -> dict:
    return {"steps_per_s": statistics.median(values), "min": min(values), "max": max(values), "passes": values}


def _rows(measured: dict[tuple, list[dict]], limits: dict[str, dict]) -> list[dict]:
    """One row per configuration: the median of its passes with min and max,
    and its ratios: to SyncVectorEnv with as many envs, and to the limit
    measured in the same run."""
    rows = []
    for (spec, name, n), runs in measured.items():
        last = {k: v for k, v in runs[-1].items() if k != "steps_per_s"}
        rows.append({"env": spec, "backend": name, "num_envs": n, **last,
                     "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
                     **_spread([r["steps_per_s"] for r in runs])})
    sync = {(r["env"], r["num_envs"]): r["steps_per_s"] for r in rows if r["backend"] == "sync"}
    for r in rows:
        rate, limit = r["steps_per_s"], limits[r["env"]]["steps_per_s"]
        base = sync.get((r["env"], r["num_envs"]))
        r["limit"] = limit
        r["vs_sync"] = rate / base if base else None
        r["of_limit"] = rate / limit
        r["overhead_us"] = 1e6 * (1 / rate - 1 / limit)
    return rows


def _k(value: float) -> str:
    return f"{value / 1000:,.1f}k" if value < 1e7 else f"{value / 1e6:,.1f}M"


def _table(rows: list[dict], limits: dict[str, dict], args: argparse.Namespace, cpus: int) -> str:
    header = f"{'backend':<14}{'envs':>6}{'steps/s':>10}{'min-max':>16}{'x Sync':>8}{'limit':>9}" \
             f"{'of limit':>10}{'peak RSS MiB':>14}"
    lines = []
    for spec, limit in limits.items():
        loops = " + ".join(_k(rate) for rate in limit["loops"])
        workload = f"{spec} in Gymnasium's Atari pipeline" if _atari(args, spec) else spec
        lines += ["", f"{workload}: limit {limit['steps_per_s']:,.0f} steps/s (min-max "
                      f"{_k(limit['min'])}-{_k(limit['max'])}) = {cpus} plain single-env loops at once "
                      f"({loops})", header]
        for r in (r for r in rows if r["env"] == spec):
            vs_sync = f"{r['vs_sync']:.2f}" if r["vs_sync"] else "-"
            spread = f"{_k(r['min'])}-{_k(r['max'])}"
            lines.append(f"{r['backend']:<14}{r['num_envs']:>6}{_k(r['steps_per_s']):>10}{spread:>16}{vs_sync:>8}"
                         f"{_k(r['limit']):>9}{r['of_limit']:>10.2f}{r['peak_rss_mib']:>14,.0f}")
    lines += [
        "",
        f"Medians of {args.passes} interleaved passes of {args.seconds:g} s, each configuration in a fresh "
        "process; min-max over the passes.",
        "x Sync: over gymnasium SyncVectorEnv with as many envs. limit: one plain single-env loop per usable",
        "CPU, all running at once, their steps/s summed (measured in this run); of limit: steps/s over it.",
        "peak RSS: the front end and all the processes it started, summed (shared pages count in each).",
    ]
    threads = {r["torch_threads"] for r in rows if "torch_threads" in r}
    if args.policy:
        lines.append(f"policy: a torch MLP (obs -> 64 -> 64 -> actions) picks the actions in the timed loop, "
                     f"torch threads {','.join(map(str, sorted(threads)))} (torch's default, or what shmvec's "
                     "torch_threads=\"auto\" set while its env was open); the limit has none.")
    if args.busy:
        where = "each in a session of its own" if args.busy_apart else "in the bench's session"
        lines.append(f"busy: {args.busy} processes spinning on the CPU during every measurement, the limit's too, "
                     f"{where}.")
    names = {r["backend"] for r in rows}
    if "envpool" in names:
        lines.append("envpool steps its own C++ envs, not the Python ones of the limit.")
        if any(r["backend"] == "envpool" and _atari(args, r["env"]) for r in rows):
            lines.append("envpool's Atari defaults differ from Gymnasium's pipeline: sticky actions 0 (not 0.25),"
                         " fire reset on.")
    if "ale" in names:
        lines.append(f"ale: ale-py's AtariVectorEnv, preprocessing in C++ on {cpus} threads, set to match "
                     "Gymnasium's pipeline.")
    return "\n".join(lines)


def _plot(rows: list[dict], limits: dict[str, dict], path: str, title: str) -> str | None:
    """Writes the plot; returns a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed, so no plot (pip install matplotlib)"
    fig, axes = plt.subplots(1, len(limits), figsize=(6.4 * len(limits), 4.8), squeeze=False)
    for ax, spec in zip(axes[0], limits):
        for name in PEERS:
            points = sorted((r["num_envs"], r["steps_per_s"], r["min"], r["max"]) for r in rows
                            if r["env"] == spec and r["backend"] == name)
            if points:
                n, rate, low, high = zip(*points)
                spread = [[r - lo for r, lo in zip(rate, low)], [hi - r for r, hi in zip(rate, high)]]
                ax.errorbar(n, rate, yerr=spread, marker="o", capsize=3, label=PEERS[name].label)
        ax.axhline(limits[spec]["steps_per_s"], color="grey", linestyle="--",
                   label="limit: a plain loop per CPU, at once")
        ax.set(xscale="log", yscale="log", xlabel="number of envs", ylabel="env steps per second", title=spec)
        counts = sorted({r["num_envs"] for r in rows if r["env"] == spec})
        ax.set_xticks(counts, [str(n) for n in counts])  # the measured counts, not powers of ten
        ax.set_xticks([], minor=True)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _measure_all(specs: list[str], jobs: list[tuple], args: argparse.Namespace,
                 notes: list[str]) -> tuple[dict[str, dict], dict[tuple, list[dict]]]:
    """`args.passes` interleaved passes: in each, the limit of every env, then
    every job, each in fresh processes, with `args.busy` hogs running. A
    failure becomes a note, not the end of the run, and is not retried."""
    progress = _Progress(args.passes * (len(specs) + len(jobs)))
    for note in notes:
        progress.note(note)
    failed: set = set()

    def attempt(key, what: str, fn, *fn_args):
        progress.show(what)
        if key in failed:
            return None
        try:
            with Hogs(args.busy, own_sessions=args.busy_apart):
                return fn(*fn_args)
        except RuntimeError as exc:
            failed.add(key)
            notes.append(f"{what} failed: {str(exc).strip().splitlines()[-1]}")
            progress.note(notes[-1])
            return None

    limit_runs: dict[str, list[dict]] = {}
    measured: dict[tuple, list[dict]] = {}
    for done in range(args.passes):
        tag = f"pass {done + 1}/{args.passes}: " if args.passes > 1 else ""
        for spec in specs:
            limit = attempt(spec, f"{tag}{spec}: limit, {usable_cpus()} plain loops at once",
                            concurrent_limit, spec, args.seconds, _atari(args, spec))
            if limit is not None:
                limit_runs.setdefault(spec, []).append(limit)
        for spec, name, n in jobs:
            if spec not in limit_runs:
                continue
            result = attempt((spec, name, n), f"{tag}{spec}: {name} x{n}", isolated, measure_once, name, spec, n,
                             args.seconds, _options(args, name), _atari(args, spec), args.policy)
            if result is not None:
                measured.setdefault((spec, name, n), []).append(result)
    progress.clear()
    limits = {}
    for spec, runs in limit_runs.items():
        median = _spread([r["steps_per_s"] for r in runs])
        middle = min(runs, key=lambda r: abs(r["steps_per_s"] - median["steps_per_s"]))
        limits[spec] = {**median, "loops": middle["loops"]}
    return limits, measured


def run(args: argparse.Namespace) -> int:
    specs = list(dict.fromkeys([*args.env, *args.env_options])) or DEFAULT_ENVS
    if args.atari and not any(_atari(args, spec) for spec in specs):
        print("error: --atari takes ALE ids (such as ALE/Pong-v5)", file=sys.stderr)
        return 2
    if args.backends is None:  # all, shmvec-async only when --async-batch asks for it
        args.backends = [name for name in PEERS if name != "shmvec-async" or args.async_batch]
    cpus = usable_cpus()
    specs, jobs, notes = _plan(specs, args)
    limits, measured = _measure_all(specs, jobs, args, notes)
    if not measured:
        print("error: nothing could be measured (see the notes above)", file=sys.stderr)
        return 1
    rows = _rows(measured, limits)

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = f"{platform.system()} {platform.machine()}, {cpus} usable CPUs, Python {platform.python_version()}"
    extras = [f"policy {args.policy}" if args.policy else "", f"busy {args.busy}{' apart' if args.busy_apart else ''}" if args.busy else ""]
    title = ", ".join(filter(None, [f"shmvec {shmvec.__version__} bench", date[:10], machine, *extras]))
    print(title)
    print(_table(rows, limits, args, cpus))
    if args.json:
        options = _shmvec_options(args)
        report = {
            "date": date, "machine": machine, "usable_cpus": cpus, "shmvec": shmvec.__version__,
            # As passed to ShmVecEnv (workers: null is its default); each shmvec
            # result says what they came to (its workers, and whether pinned).
            "settings": {"envs": specs, "num_envs": args.num_envs, "backends": args.backends,
                         "workers": options["num_workers"], "pin_workers": options["pin_workers"],
                         "seconds": args.seconds, "passes": args.passes, "atari": args.atari,
                         "policy": args.policy, "busy": args.busy,
                         "busy_apart": args.busy_apart, "async_batch": args.async_batch},
            # The limit: one plain single-env loop per usable CPU, all at once, summed (median of the passes).
            "machine_limit": {spec: limit["steps_per_s"] for spec, limit in limits.items()},
            "limits": limits,
            "results": rows, "notes": notes,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        missing = _plot(rows, limits, args.plot, title)
        if missing:
            print(f"note: {missing}", file=sys.stderr)
    return 0
