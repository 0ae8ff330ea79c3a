"""``shmvec bench``: env steps per second of shmvec and of every installed
peer on this machine, as a table, a JSON file and a plot.

Each measurement runs in a fresh process, so that none disturbs the next
and each one's peak memory is its own. Usage: ``shmvec bench --help``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import shmvec
from shmvec._system import usable_cpus
from shmvec.measure import isolated, single_env_rate, tree_memory, vector_rate
from shmvec.peers import PEERS, build, env_factory

__all__ = ["add_arguments", "run"]

DEFAULT_ENVS = ["CartPole-v1"]
DEFAULT_NUM_ENVS = [8, 64, 256]
DEFAULT_SECONDS = 1.0


def _env_spec(text: str) -> str:
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("env", nargs="*", type=_env_spec, metavar="ENV_ID",
                        help="registered gymnasium env ids or module:callable env factories "
                             f"(default: {' '.join(DEFAULT_ENVS)})")
    parser.add_argument("--num-envs", type=_num_envs, default=DEFAULT_NUM_ENVS, metavar="N,N,...",
                        help=f"numbers of envs (default: {','.join(map(str, DEFAULT_NUM_ENVS))})")
    parser.add_argument("--workers", type=_workers, default=None, metavar="N",
                        help="shmvec worker processes (default: shmvec's, one per usable CPU "
                             "less the caller, which steps a slice itself)")
    parser.add_argument("--no-pin-workers", dest="pin_workers", action="store_false",
                        help="leave shmvec's workers unpinned (default: pin_workers=\"auto\")")
    parser.add_argument("--backends", type=_backends, default=list(PEERS), metavar="NAME,...",
                        help=f"what to compare (default: all that are installed: {','.join(PEERS)})")
    parser.add_argument("--seconds", type=_positive, default=DEFAULT_SECONDS, metavar="S",
                        help=f"timed stepping per measurement, after a warm-up (default: {DEFAULT_SECONDS})")
    parser.add_argument("--plot", metavar="FILE.png", help="write a plot of steps/s against envs")
    parser.add_argument("--json", metavar="FILE.json", help="write the results as JSON")


def _shmvec_options(args: argparse.Namespace) -> dict:
    """The options `shmvec bench` passes to ShmVecEnv, as passed."""
    return {"num_workers": args.workers, "pin_workers": "auto" if args.pin_workers else False}


def _layout(envs) -> dict:
    """What a ShmVecEnv made of its options: its number of workers, and
    whether they were pinned (``pin_workers="auto"`` pins only when every
    worker gets a CPU of its own)."""
    cpus = getattr(getattr(envs, "_engine", None), "_cpus", None)
    return {"workers": envs.num_workers,
            "pinned": None if cpus is None else any(cpu is not None for cpu in cpus)}


def _measure(peer: str, spec: str, num_envs: int, options: dict, seconds: float) -> dict:
    """One measurement, run in a fresh process; `options` go to shmvec."""
    envs = build(peer, spec, num_envs, **(options if peer == "shmvec" else {}))
    try:
        layout = _layout(envs) if peer == "shmvec" else {}
        rate = vector_rate(envs, num_envs, seconds)
        memory = tree_memory()
    finally:
        envs.close()
    return {"steps_per_s": rate, "peak_rss_mib": memory["peak_rss_mib"], **layout}


def _plan(specs: list[str], backends: list[str], counts: list[int]) -> tuple[list[tuple], list[str]]:
    """The (env, backend, num_envs) runs to do, and notes on those skipped."""
    jobs, notes = [], []
    for spec in specs:
        for name in backends:
            peer = PEERS[name]
            reason = peer.unavailable(spec)
            if reason:
                notes.append(f"skipping {reason}")
                continue
            capped = [n for n in counts if peer.max_envs and n > peer.max_envs]
            if capped:
                notes.append(f"skipping {name} at {','.join(map(str, capped))} envs on {spec}: "
                             f"it starts a process per env (capped at {peer.max_envs})")
            jobs += [(spec, name, n) for n in counts if n not in capped]
    return jobs, list(dict.fromkeys(notes))


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


def _rows(results: list[dict], limits: dict[str, float]) -> list[dict]:
    """Adds the ratios: to SyncVectorEnv with as many envs, to the machine
    limit, and the time per env step beyond the limit's."""
    sync = {(r["env"], r["num_envs"]): r["steps_per_s"] for r in results if r["backend"] == "sync"}
    for r in results:
        rate, limit = r["steps_per_s"], limits[r["env"]]
        base = sync.get((r["env"], r["num_envs"]))
        r["vs_sync"] = rate / base if base else None
        r["of_limit"] = rate / limit
        r["overhead_us"] = 1e6 * (1 / rate - 1 / limit)
    return results


def _table(rows: list[dict], limits: dict[str, float], singles: dict[str, float], cpus: int) -> str:
    header = f"{'backend':<10}{'envs':>6}{'steps/s':>13}{'x Sync':>8}{'of limit':>10}" \
             f"{'overhead us':>13}{'peak RSS MiB':>14}"
    lines = []
    for spec in limits:
        lines += ["", f"{spec}: machine limit {limits[spec]:,.0f} steps/s = {cpus} CPUs x "
                      f"{singles[spec]:,.0f} steps/s of one env in a plain loop", header]
        for r in (r for r in rows if r["env"] == spec):
            vs_sync = f"{r['vs_sync']:.2f}" if r["vs_sync"] else "-"
            lines.append(f"{r['backend']:<10}{r['num_envs']:>6}{r['steps_per_s']:>13,.0f}{vs_sync:>8}"
                         f"{r['of_limit']:>10.2f}{r['overhead_us']:>13.2f}{r['peak_rss_mib']:>14,.0f}")
    lines += [
        "",
        "x Sync: over gymnasium SyncVectorEnv with as many envs. of limit: over the machine limit.",
        "overhead: wall time per env step beyond the limit's. peak RSS: the front end and all the",
        "processes it started, summed (shared pages count in each).",
    ]
    if any(r["backend"] == "envpool" for r in rows):
        lines.append("envpool steps its own C++ envs, not the Python ones of the limit.")
    return "\n".join(lines)


def _plot(rows: list[dict], limits: dict[str, float], path: str, title: str) -> str | None:
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
            points = sorted((r["num_envs"], r["steps_per_s"]) for r in rows
                            if r["env"] == spec and r["backend"] == name)
            if points:
                ax.plot(*zip(*points), marker="o", label=PEERS[name].label)
        ax.axhline(limits[spec], color="grey", linestyle="--", label="machine limit")
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
                 notes: list[str]) -> tuple[dict[str, float], list[dict]]:
    """One env of each spec in a plain loop, then every job, each in a fresh
    process; a failure becomes a note, not the end of the run."""
    progress = _Progress(len(specs) + len(jobs))
    for note in notes:
        progress.note(note)

    def attempt(what: str, fn, *fn_args):
        progress.show(what)
        try:
            return isolated(fn, *fn_args)
        except RuntimeError as exc:
            notes.append(f"{what} failed: {str(exc).strip().splitlines()[-1]}")
            progress.note(notes[-1])
            return None

    singles = {}
    for spec in specs:
        rate = attempt(f"{spec}: one env in a plain loop", single_env_rate, spec, args.seconds)
        if rate is not None:
            singles[spec] = rate
    results = []
    for spec, name, n in jobs:
        if spec in singles:
            measured = attempt(f"{spec}: {name} x{n}", _measure, name, spec, n, _shmvec_options(args),
                               args.seconds)
            if measured is not None:
                results.append({"env": spec, "backend": name, "num_envs": n, **measured})
    progress.clear()
    return singles, results


def run(args: argparse.Namespace) -> int:
    specs = args.env or DEFAULT_ENVS
    cpus = usable_cpus()
    jobs, notes = _plan(specs, args.backends, args.num_envs)
    singles, results = _measure_all(specs, jobs, args, notes)
    if not results:
        print("error: nothing could be measured (see the notes above)", file=sys.stderr)
        return 1
    limits = {spec: cpus * rate for spec, rate in singles.items()}
    rows = _rows(results, limits)

    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = f"{platform.system()} {platform.machine()}, {cpus} usable CPUs, Python {platform.python_version()}"
    title = f"shmvec {shmvec.__version__} bench, {date[:10]}, {machine}"
    print(title)
    print(_table(rows, limits, singles, cpus))
    if args.json:
        options = _shmvec_options(args)
        report = {
            "date": date, "machine": machine, "usable_cpus": cpus, "shmvec": shmvec.__version__,
            # As passed to ShmVecEnv (workers: null is its default); each shmvec
            # result says what they came to (its workers, and whether pinned).
            "settings": {"envs": specs, "num_envs": args.num_envs, "backends": args.backends,
                         "workers": options["num_workers"], "pin_workers": options["pin_workers"],
                         "seconds": args.seconds},
            "single_env_steps_per_s": singles, "machine_limit": limits,
            "results": rows, "notes": notes,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        missing = _plot(rows, limits, args.plot, title)
        if missing:
            print(f"note: {missing}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # python -m shmvec.bench: the same as `shmvec bench`
    from shmvec.cli import main

    sys.exit(main(["bench", *sys.argv[1:]]))
