"""What ``shmvec bench`` reports: each configuration's median over the
passes with min and max, and its ratios to SyncVectorEnv and to the limit,
as a table, a JSON file and a plot."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics

import shmvec
from shmvec.bench.passes import in_atari_pipeline, shmvec_options
from shmvec.bench.peers import PEERS

__all__ = ["limit_medians", "result_rows", "cpu_model", "about_the_run", "title_line", "table", "write_json", "plot"]


def _spread(values: list[float]) -> dict:
    return {"steps_per_s": statistics.median(values), "min": min(values), "max": max(values), "passes": values}


def limit_medians(limit_runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Each env's limit: the median of its passes with min and max, and the
    loops of the pass nearest the median."""
    limits = {}
    for spec, runs in limit_runs.items():
        median = _spread([r["steps_per_s"] for r in runs])
        middle = min(runs, key=lambda r: abs(r["steps_per_s"] - median["steps_per_s"]))
        limits[spec] = {**median, "loops": middle["loops"]}
    return limits


def result_rows(measured: dict[tuple, list[dict]], limits: dict[str, dict]) -> list[dict]:
    """One row per configuration: the median of its passes with min and max,
    and its ratios: to SyncVectorEnv with as many envs, and to the limit
    measured in the same run."""
    rows = []
    for (spec, name, n), runs in measured.items():
        last = {k: v for k, v in runs[-1].items() if k != "steps_per_s"}
        memory = [r["peak_rss_mib"] for r in runs if "peak_rss_mib" in r]  # none for the uncoupled loops
        rows.append({"env": spec, "backend": name, "num_envs": n, **last,
                     "peak_rss_mib": max(memory) if memory else None,
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


def cpu_model() -> str | None:
    """The CPU's model name as /proc/cpuinfo gives it; None where it gives
    none (aarch64 kernels, say). Figures from two CPU models do not compare."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return None


def about_the_run(cpus: int) -> dict:
    """When and where the run was, and which shmvec it measured."""
    model = cpu_model()
    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": ", ".join(filter(None, [f"{platform.system()} {platform.machine()}", model,
                                               f"{cpus} usable CPUs", f"Python {platform.python_version()}"])),
            "cpu_model": model, "usable_cpus": cpus, "shmvec": shmvec.__version__}


def title_line(about: dict, args: argparse.Namespace) -> str:
    """One line: shmvec's version, the date, the machine, and the load the run added."""
    extras = [f"policy {args.policy} on {args.policy_device}" if args.policy else "",
              f"busy {args.busy}{' apart' if args.busy_apart else ''}{' late' if args.busy_late else ''}"
              if args.busy else ""]
    return ", ".join(filter(None, [f"shmvec {about['shmvec']} bench", about["date"][:10], about["machine"], *extras]))


def _k(value: float) -> str:
    return f"{value / 1000:,.1f}k" if value < 1e6 else f"{value / 1e6:,.2f}M"


def table(rows: list[dict], limits: dict[str, dict], args: argparse.Namespace, cpus: int) -> str:
    width = max([14] + [len(r["backend"]) + 1 for r in rows])  # (shmvec-unpinned is 15 wide)
    header = f"{'backend':<{width}}{'envs':>6}{'steps/s':>10}{'min-max':>16}{'x Sync':>8}{'limit':>9}" \
             f"{'of limit':>10}{'peak RSS MiB':>14}"
    lines = []
    for spec, limit in limits.items():
        loops = " + ".join(_k(rate) for rate in limit["loops"])
        workload = f"{spec} in Gymnasium's Atari pipeline" if in_atari_pipeline(args, spec) else spec
        lines += ["", f"{workload}: limit {limit['steps_per_s']:,.0f} steps/s (min-max "
                      f"{_k(limit['min'])}-{_k(limit['max'])}) = {cpus} plain single-env loops at once "
                      f"({loops})", header]
        for r in (r for r in rows if r["env"] == spec):
            vs_sync = f"{r['vs_sync']:.2f}" if r["vs_sync"] else "-"
            spread = f"{_k(r['min'])}-{_k(r['max'])}"
            memory = "-" if r["peak_rss_mib"] is None else f"{r['peak_rss_mib']:,.0f}"
            lines.append(f"{r['backend']:<{width}}{r['num_envs']:>6}{_k(r['steps_per_s']):>10}{spread:>16}{vs_sync:>8}"
                         f"{_k(r['limit']):>9}{r['of_limit']:>10.2f}{memory:>14}")
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
        net = ("a torch MLP (obs -> 64 -> 64 -> actions)" if args.policy == "mlp"
               else "CleanRL's Atari CNN (3 convolutions, 512 units)")
        lines.append(f"policy: {net} on {args.policy_device} picks the actions "
                     f"in the timed loop, torch threads {','.join(map(str, sorted(threads)))} (torch's default, or what shmvec's "
                     "torch_threads=\"auto\" set while its env was open); the limit has none.")
    if args.busy:
        where = "each in a session of its own" if args.busy_apart else "in the bench's session"
        when = ("started once each vector env had been made and warmed up (the limit's and the plain loops' "
                "from the start)" if args.busy_late else "during every measurement, the limit's too")
        lines.append(f"busy: {args.busy} processes spinning on the CPU {when}, {where}.")
    names = {r["backend"] for r in rows}
    if "uncoupled" in names:
        lines += [f"uncoupled: one plain loop per usable CPU ({cpus}) over its share of the envs, all at once, none",
                  "waiting for another (no vector env, so no memory figure): shmvec's gap to it is what lock-step",
                  "costs, each batch waiting for the slower process."]
    if "envpool" in names:
        lines.append("envpool steps its own C++ envs, not the Python ones of the limit.")
        if any(r["backend"] == "envpool" and in_atari_pipeline(args, r["env"]) for r in rows):
            lines.append("envpool's Atari defaults differ from Gymnasium's pipeline: sticky actions 0 (not 0.25),"
                         " fire reset on.")
    if "ale" in names:
        lines.append(f"ale: ale-py's AtariVectorEnv, preprocessing in C++ on {cpus} threads, set to match "
                     "Gymnasium's pipeline.")
    return "\n".join(lines)


def write_json(path: str, about: dict, args: argparse.Namespace, specs: list[str], limits: dict[str, dict],
               rows: list[dict], notes: list[str]) -> None:
    """The run as JSON: `about` it, its settings, the limits, the rows and the notes."""
    options = shmvec_options(args)
    report = {
        **about,
        # As passed to ShmVecEnv (workers: null is its default); each shmvec
        # result says what they came to (its workers, whether pinned, whether on the caller's CPU).
        "settings": {"envs": specs, "num_envs": args.num_envs, "backends": args.backends,
                     "workers": options["num_workers"], "pin_workers": options["pin_workers"],
                     "seconds": args.seconds, "passes": args.passes, "atari": args.atari,
                     "policy": args.policy, "policy_device": args.policy_device, "busy": args.busy,
                     "busy_apart": args.busy_apart,
                     "busy_late": args.busy_late, "async_batch": args.async_batch},
        # The limit: one plain single-env loop per usable CPU, all at once, summed (median of the passes).
        "machine_limit": {spec: limit["steps_per_s"] for spec, limit in limits.items()},
        "limits": limits,
        "results": rows, "notes": notes,
    }
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def plot(rows: list[dict], limits: dict[str, dict], path: str, title: str) -> str | None:
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
