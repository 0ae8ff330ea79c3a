"""Smoke tests of `shmvec bench`: tiny runs, the JSON they write, and how
bad input and missing peers are reported."""

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from shmvec import PerformanceWarning, ShmVecEnv, cli
from shmvec.bench import measure, peers, printed
from shmvec.bench.peers import PEERS
from shmvec.testing import NoopEnv

FAST = ["--seconds", "0.05", "--passes", "1"]


class FailingEnv(NoopEnv):
    """Imported by name in the benchmark's own processes."""

    def step(self, action):
        raise RuntimeError("this env cannot step")


class SecondEnvWarns(NoopEnv):
    """Warns as shmvec does of a slow setting, once a process makes a second
    one: in a vector env's process, not in the limit's single-env loops."""

    made = 0

    def __init__(self):
        super().__init__()
        SecondEnvWarns.made += 1
        if SecondEnvWarns.made == 2:
            warnings.warn("pass fast=True to run faster", PerformanceWarning)


class PrintsFromC(NoopEnv):
    """Prints as MuJoCo does when it loads a model: from C, straight to the
    process's stdout, once per env made, a line in two writes (processes
    that make envs at once would interleave them in a file they share)."""

    def __init__(self):
        super().__init__()
        os.write(1, b"WARNING")
        time.sleep(0.05)
        os.write(1, b": this model uses a deprecated attribute\n\n")


class DiesWithLastWords(NoopEnv):
    """Ends its process as a crash would, saying why on stderr first."""

    def step(self, action):
        os.write(2, b"fatal: this env's library gave up\n")
        os._exit(3)


@pytest.fixture(autouse=True)
def restore_sys_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command adds the current folder


def bench(*args: str) -> int:
    return cli.main(["bench", *args])


def cpu_model_in_proc() -> str:
    """/proc/cpuinfo's first "model name", or None where it has none (aarch64)."""
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == "model name"]
    return names[0] if names else None


def test_module_callable_json_table_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "out.json", tmp_path / "out.png"
    code = bench("shmvec.testing:NoopEnv", "--num-envs", "2,3", "--backends", "shmvec,sync",
                 "--workers", "1", "--json", str(out), "--plot", str(plot), *FAST)
    assert code == 0
    report = json.loads(out.read_text())
    assert report["settings"]["envs"] == ["shmvec.testing:NoopEnv"]
    assert report["usable_cpus"] >= 1
    limit = report["machine_limit"]["shmvec.testing:NoopEnv"]
    # Measured: one plain loop per usable CPU at once, summed.
    loops = report["limits"]["shmvec.testing:NoopEnv"]["loops"]
    assert len(loops) == report["usable_cpus"] and limit == pytest.approx(sum(loops))
    runs = {(r["backend"], r["num_envs"]): r for r in report["results"]}
    assert set(runs) == {("shmvec", 2), ("shmvec", 3), ("sync", 2), ("sync", 3)}
    for r in runs.values():
        assert r["steps_per_s"] > 0 and r["peak_rss_mib"] > 0
        assert r["limit"] == limit and r["of_limit"] == pytest.approx(r["steps_per_s"] / limit)
        assert r["min"] <= r["steps_per_s"] <= r["max"] and len(r["passes"]) == 1
    assert runs["sync", 2]["vs_sync"] == pytest.approx(1.0)
    captured = capsys.readouterr()
    assert "steps/s" in captured.out and "shmvec" in captured.out and "sync" in captured.out
    # Figures mean little without the CPU they ran on: the title and the JSON name it.
    assert report["cpu_model"] == cpu_model_in_proc()
    assert report["cpu_model"] is None or report["cpu_model"] in captured.out.splitlines()[0]
    if importlib.util.find_spec("matplotlib"):
        assert plot.read_bytes().startswith(b"\x89PNG")
    else:
        assert "matplotlib is not installed" in captured.out + captured.err


@pytest.mark.heavy
@pytest.mark.parametrize(("flags", "pin_workers"), [([], "auto"), (["--no-pin-workers"], False)])
def test_json_records_the_options_really_used(tmp_path, flags, pin_workers, closing):
    out = tmp_path / "out.json"
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "3", "--backends", "shmvec,sync",
                 "--json", str(out), *flags, *FAST) == 0
    report = json.loads(out.read_text())
    # As passed to ShmVecEnv: "auto" is not True, and no --workers is its default (null).
    assert report["settings"]["pin_workers"] == pin_workers
    assert report["settings"]["workers"] is None
    runs = {r["backend"]: r for r in report["results"]}
    # What shmvec made of them: the default number of workers, pinned or not.
    default = ShmVecEnv([NoopEnv] * 3, pin_workers=False, start_method="fork")
    closing(default)
    # (or none, or one on the caller's CPU, where CPUs looked busy when the
    # bench's env was made: the default leaves them out, and a CI machine
    # may be busy)
    assert runs["shmvec"]["workers"] in {default.num_workers, 0, 1}
    assert isinstance(runs["shmvec"]["pinned"], bool) and isinstance(runs["shmvec"]["on_callers_cpu"], bool)
    if pin_workers is False:
        assert runs["shmvec"]["pinned"] is runs["shmvec"]["on_callers_cpu"] is False
    assert "workers" not in runs["sync"] and "pinned" not in runs["sync"]


@pytest.mark.heavy
def test_shmvec_unpinned_row_runs_the_same_env_with_workers_unpinned(tmp_path):
    # Pinned and unpinned side by side in one run: the measurement behind
    # the pin_workers default.
    out = tmp_path / "out.json"
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "3", "--backends", "shmvec,shmvec-unpinned",
                 "--workers", "1", "--json", str(out), *FAST) == 0
    runs = {r["backend"]: r for r in json.loads(out.read_text())["results"]}
    assert runs["shmvec-unpinned"]["pinned"] is False
    assert runs["shmvec-unpinned"]["workers"] == runs["shmvec"]["workers"] == 1


class CountingEnv(NoopEnv):
    """Counts its own steps (in the process that steps it)."""

    def __init__(self):
        super().__init__()
        self.steps = 0

    def step(self, action):
        self.steps += 1
        return super().step(action)


@pytest.mark.heavy
def test_uncoupled_row_steps_each_share_in_a_plain_loop_of_its_own(tmp_path, capsys):
    # The reference that tells lock-step's cost apart: one plain loop per
    # usable CPU over its share of the envs, none waiting for another.
    out = tmp_path / "out.json"
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "1,5", "--backends", "sync,uncoupled",
                 "--json", str(out), *FAST) == 0
    report = json.loads(out.read_text())
    runs = {(r["backend"], r["num_envs"]): r for r in report["results"]}
    assert len(runs["uncoupled", 1]["loops"]) == 1  # one env: one loop, not one per CPU
    assert len(runs["uncoupled", 5]["loops"]) == min(5, report["usable_cpus"])
    for n in (1, 5):
        row = runs["uncoupled", n]
        assert row["steps_per_s"] == pytest.approx(sum(row["loops"])) and row["peak_rss_mib"] is None
    assert "uncoupled: one plain loop per usable CPU" in capsys.readouterr().out


def test_an_uncoupled_loop_steps_every_env_of_its_share():
    measure._prepare_loop("test_bench_cli:CountingEnv", False, 0.01, 3)
    envs = measure._loop[-1][0]
    assert len(envs) == 3
    before = [env.unwrapped.steps for env in envs]
    rate = measure._run_loop(0.0, 0.02)
    calls = [env.unwrapped.steps - b for env, b in zip(envs, before)]
    assert calls[0] > 0 and calls == [calls[0]] * 3  # the same number of steps each
    assert rate > 0 and not measure._loop


def test_a_pinned_loop_runs_on_its_cpu():
    before = os.sched_getaffinity(0)
    cpu = max(before)
    try:
        measure._prepare_loop("test_bench_cli:CountingEnv", False, 0.01, 1, cpu)
        assert os.sched_getaffinity(0) == {cpu}
        assert measure._run_loop(0.0, 0.01) > 0
    finally:
        os.sched_setaffinity(0, before)


def test_pinned_limit_says_which_cpu_each_loop_ran_on():
    cpus = sorted(os.sched_getaffinity(0))[:2]
    limit = measure.concurrent_limit("shmvec.testing:NoopEnv", 0.05, processes=len(cpus), pin=True)
    assert limit["cpus"] == cpus and len(limit["loops"]) == len(cpus) and min(limit["loops"]) > 0
    assert "cpus" not in measure.concurrent_limit("shmvec.testing:NoopEnv", 0.05, processes=1)
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=f"pin=True needs a CPU per loop: {too_many} loops"):
        measure.concurrent_limit("shmvec.testing:NoopEnv", 0.05, processes=too_many, pin=True)


def test_actions_do_not_cycle_within_an_episode_and_stay_small():
    """A short cycle of actions drives each env into a gait of its own. With
    64 batches cycled, some HalfCheetahs stepped 10% slower than others for
    the whole run, and a lock-step vector env waited for them every batch."""
    import gymnasium
    box = gymnasium.spaces.Box(-1, 1, (6,), np.float32)
    batches = measure.action_batches(box, 16)
    assert len(batches) > 2 * 1000  # two HalfCheetah episodes
    assert len({batch.tobytes() for batch in batches}) == len(batches)
    many = measure.action_batches(gymnasium.spaces.Discrete(2), 4096)  # 32 KiB a batch
    assert len(many) * many[0].nbytes <= measure.ACTION_BYTES and len(many) >= 64
    nested = gymnasium.spaces.Dict({"a": gymnasium.spaces.Discrete(3), "b": box})
    assert len(measure.action_batches(nested, 4)) == len(measure.action_batches(box, 4))
    assert len(measure.action_batches(box, None, count=5)) == 5


def test_uncoupled_is_only_run_when_named_and_never_with_a_policy():
    from shmvec.bench import command, passes
    assert "uncoupled" not in command.default_backends(None) + command.default_backends(8)
    assert "shmvec-async" in command.default_backends(8)
    pytest.importorskip("torch")
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--policy", "mlp", "--num-envs", "2", "--backends", "sync,uncoupled"])
    _, jobs, notes = passes.plan(["shmvec.testing:NoopEnv"], args)
    assert [name for _, name, _ in jobs] == ["sync"]
    assert "skipping uncoupled: its plain loops have no policy" in notes


def test_json_records_workers_given(tmp_path):
    out = tmp_path / "out.json"
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "3", "--backends", "shmvec", "--workers", "2",
                 "--json", str(out), *FAST) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["workers"] == 2
    assert report["results"][0]["workers"] == 2


@pytest.mark.heavy
def test_missing_and_capped_peers_are_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(PEERS, "dummy", dataclasses.replace(PEERS["dummy"], requires="shmvec_no_such_module"))
    out = tmp_path / "out.json"
    code = bench("shmvec.testing:NoopEnv", "--num-envs", "1,129", "--backends", "sync,dummy,async",
                 "--json", str(out), *FAST)
    assert code == 0
    err = capsys.readouterr().err
    assert "note: skipping dummy: shmvec_no_such_module is not installed" in err
    assert "note: skipping async at 129 envs" in err
    runs = {(r["backend"], r["num_envs"]) for r in json.loads(out.read_text())["results"]}
    assert runs == {("sync", 1), ("sync", 129), ("async", 1)}


def test_an_env_that_fails_is_a_note_not_a_crash(capsys):
    assert bench("test_bench_cli:FailingEnv", "--num-envs", "1", "--backends", "sync", *FAST) == 1
    err = capsys.readouterr().err
    assert re.search(r"limit, \d+ plain loops at once failed: RuntimeError: this env cannot step", err)
    assert "nothing could be measured" in err


@pytest.mark.heavy
def test_a_performance_warning_is_one_note_not_one_per_measurement(tmp_path, capfd):
    out = tmp_path / "out.json"
    assert bench("test_bench_cli:SecondEnvWarns", "--num-envs", "2,3", "--backends", "shmvec", "--workers", "0",
                 "--seconds", "0.05", "--passes", "2", "--json", str(out)) == 0
    err = capfd.readouterr().err
    assert err.count("pass fast=True to run faster") == 1, err
    assert "note: shmvec on test_bench_cli:SecondEnvWarns: pass fast=True to run faster" in err
    assert "shmvec on test_bench_cli:SecondEnvWarns: pass fast=True to run faster" in json.loads(out.read_text())["notes"]


@pytest.mark.heavy
def test_what_the_envs_print_is_one_note_not_a_line_per_env(tmp_path, capfd):
    out = tmp_path / "out.json"
    assert bench("test_bench_cli:PrintsFromC", "--num-envs", "2,3", "--backends", "shmvec,sync,uncoupled,async",
                 "--seconds", "0.05", "--passes", "2", "--json", str(out)) == 0
    captured = capfd.readouterr()
    assert "deprecated attribute" not in captured.out  # the table stays readable
    assert captured.err.count("deprecated attribute") == 1, captured.err  # whole, once, in all processes
    assert re.search(r"note: pass 1/2: test_bench_cli:PrintsFromC: limit, \d+ plain loops at once printed \(shown once\):"
                     r"\n    WARNING: this model uses a deprecated attribute\n", captured.err), captured.err
    assert any("WARNING: this model uses a deprecated attribute" in note for note in json.loads(out.read_text())["notes"])
    assert printed.take_printed() == []  # handed out once


def test_a_process_that_dies_leaves_its_last_words_in_a_note(capfd):
    assert bench("test_bench_cli:DiesWithLastWords", "--num-envs", "1", "--backends", "sync", *FAST) == 1
    err = capfd.readouterr().err
    assert "failed: the benchmark process died (exit code 3)" in err
    assert "printed (shown once):\n    fatal: this env's library gave up" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--backends", "shmvec,nope"], "unknown backend 'nope'; choose from shmvec, shmvec-async, shmvec-unpinned, sync, async"),
    (["NoSuchEnv-v0"], "'NoSuchEnv-v0' is not a registered gymnasium env id"),
    (["shmvec.testing:NoSuchEnv"], "shmvec.testing has no callable 'NoSuchEnv' and registers no env id"),
    (["shmvec_no_such_module:Env"], "cannot import 'shmvec_no_such_module'"),
    (["--num-envs", "8,x"], "expected positive integers separated by commas"),
    (["--seconds", "0"], "expected a positive number of seconds, got '0'"),
    (["--seconds", "inf"], "expected a positive number of seconds, got 'inf'"),  # it ran for good
    (["--seconds", "abc"], "expected a positive number of seconds, got 'abc'"),  # "invalid _positive value"
    (["--workers", "abc"], "expected an integer of 0 or more, got 'abc'"),
    (["--passes", "1.5"], "expected an integer of 1 or more, got '1.5'"),
])
def test_bad_arguments_are_clear_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench(*args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "name", "message"), [
    ("--json", "no/such/folder/out.json", "no folder"),
    ("--plot", "no/such/folder/out.png", "no folder"),
    ("--plot", "out.txt", "not 'txt'"),
])
def test_outputs_that_cannot_be_written_are_refused_before_measuring(flag, name, message, tmp_path, capsys,
                                                                     monkeypatch):
    """They failed after the whole run, its figures lost (a bad --json took
    the plot with it)."""
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    from shmvec.bench import passes

    monkeypatch.setattr(passes, "measure_all", lambda *args: pytest.fail("measured"))
    assert bench("shmvec.testing:NoopEnv", flag, str(tmp_path / name), *FAST) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_outputs_that_name_a_folder_or_an_unwritable_file_are_refused_before_measuring(flag, tmp_path, capsys,
                                                                                      monkeypatch):
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    from shmvec.bench import passes

    monkeypatch.setattr(passes, "measure_all", lambda *args: pytest.fail("measured"))
    folder = tmp_path / "out.png"
    folder.mkdir()
    assert bench("shmvec.testing:NoopEnv", flag, str(folder), *FAST) == 2
    assert "is a folder" in capsys.readouterr().err
    if os.geteuid() == 0:  # root may write any file, but not make one in /proc
        unwritable = "/proc/shmvec-bench-out.png"
    else:
        unwritable = tmp_path / "locked.png"
        unwritable.write_text("")
        unwritable.chmod(0o444)
    assert bench("shmvec.testing:NoopEnv", flag, str(unwritable), *FAST) == 2
    assert "cannot be written" in capsys.readouterr().err
    from shmvec.bench import command

    fresh = tmp_path / "fresh.png"  # writable: the check leaves no file of its own behind
    assert command._output_problem(str(fresh), flag) is None and not fresh.exists()


def test_a_count_named_twice_is_one_row(tmp_path):
    out = tmp_path / "out.json"
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "2,2", "--backends", "sync", "--json", str(out),
                 *FAST) == 0
    rows = json.loads(out.read_text())["results"]
    assert [row["num_envs"] for row in rows] == [2]
    assert len(rows[0]["passes"]) == 1


def test_async_batch_without_its_row_says_so(capsys):
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "4", "--backends", "sync", "--async-batch", "2",
                 *FAST) == 0
    assert "--async-batch measures the row shmvec-async, which --backends does not name" in capsys.readouterr().err


def test_a_measuring_process_ends_with_the_bench(tmp_path):
    """A SIGKILLed bench takes its measuring processes with it, and so the
    hogs they started (--busy-late): those spun on for the measurement's
    length, and its report met a closed pipe. The folder they printed into
    goes with the next bench."""
    script = tmp_path / "bench_then_die.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from shmvec.bench import measure\n"
        "process = measure.FreshProcess()\n"
        "process.send(time.sleep, 60)\n"
        "print(process._process.pid, process._printed.path, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    pid, printed_into = done.stdout.split()
    pid = int(pid)

    def running() -> bool:  # (a zombie has ended: whoever adopted it reaps it, or not)
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running():
        time.sleep(0.05)
    assert not running()
    assert os.path.isdir(printed_into)
    printed.PrintedFolder().collect()
    assert not os.path.exists(printed_into)


@pytest.mark.heavy
def test_passes_give_medians_with_min_and_max(tmp_path):
    out = tmp_path / "out.json"
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "2", "--backends", "sync", "--json", str(out),
                 "--seconds", "0.05", "--passes", "3") == 0
    report = json.loads(out.read_text())
    assert report["settings"]["passes"] == 3
    (row,) = report["results"]
    assert len(row["passes"]) == 3 and row["steps_per_s"] == sorted(row["passes"])[1]
    assert row["min"] == min(row["passes"]) and row["max"] == max(row["passes"])
    limit = report["limits"]["shmvec.testing:NoopEnv"]
    assert len(limit["passes"]) == 3 and limit["steps_per_s"] == sorted(limit["passes"])[1]


def _hogs() -> set[int]:
    """Pids of this process's children that are CPU hogs (their command line is measure._HOG)."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                hog = measure._HOG.encode() in f.read()
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except OSError:  # it ended meanwhile
            continue
        if hog and ppid == os.getpid():
            found.add(int(entry))
    return found


def test_busy_runs_hogs_and_leaves_none_behind(tmp_path, monkeypatch):
    seen = []
    real_call = measure.FreshProcess.call

    def call(self, fn, *args):  # the hogs run while a measurement does
        seen.append(len(_hogs()))
        return real_call(self, fn, *args)

    monkeypatch.setattr(measure.FreshProcess, "call", call)
    out = tmp_path / "out.json"
    before = _hogs()
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "2", "--backends", "sync", "--busy", "1",
                 "--json", str(out), *FAST) == 0
    assert seen and all(count >= 1 for count in seen)
    assert not _hogs() and not before
    settings = json.loads(out.read_text())["settings"]
    assert (settings["busy"], settings["busy_apart"]) == (1, False)


@pytest.mark.heavy
def test_busy_late_starts_the_hogs_after_the_warmup_and_leaves_none_behind(tmp_path, monkeypatch):
    """--busy-late: other programs that start while the envs step. The
    hogs start in the measuring process, once its vector env has been made
    and warmed up; the limit's run from the start."""
    from shmvec.bench import passes

    at_warmup_end, at_fresh_call = [], []
    real_rate, real_call, real_limit = passes.vector_rate, measure.FreshProcess.call, passes.concurrent_limit

    def rate(envs, num_envs, seconds, policy=None, after_warmup=lambda: None):
        def then():
            at_warmup_end.append(len(_hogs()))
            after_warmup()
            at_warmup_end.append(len(_hogs()))
        return real_rate(envs, num_envs, seconds, policy, then)

    def call(self, fn, *args):
        at_fresh_call.append((fn.__name__, len(_hogs())))
        return real_call(self, fn, *args)

    def limit(*args):
        at_fresh_call.append(("concurrent_limit", len(_hogs())))
        return real_limit(*args)

    monkeypatch.setattr(passes, "vector_rate", rate)
    result = passes.measure_once("shmvec", "shmvec.testing:NoopEnv", 2, 0.05, busy_late=(2, False))
    assert at_warmup_end == [0, 2] and not _hogs()
    assert result["on_callers_cpu"] in (True, False)
    monkeypatch.setattr(measure.FreshProcess, "call", call)
    monkeypatch.setattr(passes, "concurrent_limit", limit)
    out = tmp_path / "out.json"
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "2", "--backends", "shmvec", "--busy", "1",
                 "--busy-late", "--json", str(out), *FAST) == 0
    assert at_fresh_call == [("concurrent_limit", 1), ("measure_once", 0)]
    assert not _hogs()
    assert json.loads(out.read_text())["settings"]["busy_late"] is True


@pytest.mark.parametrize("own_sessions", [False, True])
def test_hogs_share_our_session_unless_apart(own_sessions):
    # Where the kernel shares CPUs between sessions (autogroup), hogs in our
    # session load it as a learner's own work does; apart, as another job.
    with measure.Hogs(2, own_sessions=own_sessions) as hogs:
        sessions = {os.getsid(p.pid) for p in hogs.processes}
        groups = {os.getpgid(p.pid) for p in hogs.processes}
    assert (sessions == {os.getsid(0)}) is not own_sessions
    assert os.getpgid(0) not in groups  # never in our foreground group: Ctrl-C is ours to handle


def test_hogs_are_stopped_on_an_error():
    with pytest.raises(KeyboardInterrupt), measure.Hogs(2) as hogs:
        pids = {p.pid for p in hogs.processes}
        assert len(pids) == 2 and all(p.poll() is None for p in hogs.processes)
        raise KeyboardInterrupt
    assert not pids & _hogs()


@pytest.mark.heavy
def test_policy_mlp(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "out.json"
    assert bench("CartPole-v1", "--num-envs", "4", "--backends", "shmvec,sync", "--policy", "mlp",
                 "--workers", "1", "--json", str(out), *FAST) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["policy"] == "mlp" and report["settings"]["policy_device"] == "cpu"
    for r in report["results"]:
        assert r["steps_per_s"] > 0 and r["torch_threads"] >= 1 and r["policy_device"] == "cpu"


@pytest.mark.parametrize(("device", "why"), [("tpu9", "'tpu9' is not a torch device"),
                                           ("cuda:0", "torch sees no cuda device here")])
def test_policy_device_must_be_one_torch_has(device, why):
    torch = pytest.importorskip("torch")
    from shmvec.bench import command, passes
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--policy", "mlp", "--policy-device", device, "--backends", "sync"])
    _, jobs, notes = passes.plan(["CartPole-v1"], args)
    assert jobs == [] and len(notes) == 1 and notes[0].startswith("skipping --policy mlp: ") and why in notes[0]


def test_policy_device_needs_a_policy(capsys):
    assert bench("CartPole-v1", "--policy-device", "cuda", "--backends", "sync", *FAST) == 2
    assert "--policy-device needs --policy mlp or cnn" in capsys.readouterr().err


def test_mlp_policy_acts_in_box_and_discrete_spaces():
    pytest.importorskip("torch")
    from gymnasium import spaces

    box = spaces.Box(-1, 1, (2,), np.float32)
    actions = measure.mlp_policy(spaces.Box(-1, 1, (3,)), box)(np.zeros((5, 3), np.float32))
    assert actions.shape == (5, 2) and actions.dtype == np.float32 and np.all(np.abs(actions) <= 1)
    actions = measure.mlp_policy(spaces.Box(0, 255, (2, 4, 4), np.uint8), spaces.Discrete(3))(
        np.zeros((5, 2, 4, 4), np.uint8))
    assert actions.shape == (5,) and set(actions) <= {0, 1, 2}
    with pytest.raises(ValueError, match="needs a Box observation space"):  # (Blackjack's: a TypeError deep in it)
        measure.mlp_policy(spaces.Tuple((spaces.Discrete(3), spaces.Discrete(2))), spaces.Discrete(2))


def test_cnn_policy_acts_on_images_channels_first_or_last():
    pytest.importorskip("torch")
    from gymnasium import spaces

    for shape in [(4, 84, 84), (84, 84, 4), (1, 36, 40)]:
        actions = measure.cnn_policy(spaces.Box(0, 255, shape, np.uint8), spaces.Discrete(6))(
            np.full((3, *shape), 7, np.uint8))
        assert actions.shape == (3,) and set(actions) <= set(range(6))
    with pytest.raises(ValueError, match="needs image observations"):
        measure.cnn_policy(spaces.Box(-1, 1, (17,)), spaces.Discrete(2))
    with pytest.raises(ValueError, match="needs image observations"):  # too small for its convolutions
        measure.cnn_policy(spaces.Box(0, 255, (4, 20, 20), np.uint8), spaces.Discrete(2))
    with pytest.raises(ValueError, match="needs a Discrete action space"):
        measure.cnn_policy(spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Box(-1, 1, (2,)))


@pytest.mark.heavy
def test_policy_cnn(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "out.json"
    assert bench("shmvec.testing:ImageEnv", "--num-envs", "4", "--backends", "shmvec,sync", "--policy", "cnn",
                 "--workers", "1", "--json", str(out), *FAST) == 0
    assert "policy: CleanRL's Atari CNN" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["settings"]["policy"] == "cnn"
    for r in report["results"]:
        assert r["steps_per_s"] > 0 and r["torch_threads"] >= 1


@pytest.mark.heavy
def test_policy_cnn_needs_images(capsys):
    pytest.importorskip("torch")
    assert bench("CartPole-v1", "--num-envs", "2", "--backends", "sync", "--policy", "cnn", *FAST) == 1
    assert "--policy cnn needs image observations" in capsys.readouterr().err


def hide_package(monkeypatch, package: str) -> None:
    """As if `package` were not installed (for find_spec, as the bench asks)."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else
                        real_find_spec(name, *a))


def test_policy_mlp_is_skipped_without_torch(monkeypatch, capsys):
    hide_package(monkeypatch, "torch")
    assert bench("CartPole-v1", "--num-envs", "2", "--backends", "sync", "--policy", "mlp", *FAST) == 1
    err = capsys.readouterr().err
    assert "skipping --policy mlp: torch is not installed" in err


@pytest.mark.heavy
def test_async_batch_adds_the_shmvec_async_row(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "2,4", "--backends", "shmvec-async,sync",
                 "--async-batch", "2", "--workers", "1", "--json", str(out), *FAST) == 0
    runs = {(r["backend"], r["num_envs"]) for r in json.loads(out.read_text())["results"]}
    assert runs == {("shmvec-async", 4), ("sync", 2), ("sync", 4)}
    assert "skipping shmvec-async at envs <= --async-batch 2" in capsys.readouterr().err


def test_nothing_to_measure_is_said_before_the_limit_is_measured(capsys):
    # Every count is at most --async-batch: no run is left, so the limit is not worth measuring.
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "2,4", "--backends", "shmvec-async",
                 "--async-batch", "4", *FAST) == 1
    err = capsys.readouterr().err
    assert "skipping shmvec-async at envs <= --async-batch 4" in err
    assert "nothing could be measured" in err
    assert "plain loops at once" not in err


def test_atari_without_ale_py_is_skipped(monkeypatch, capsys):
    hide_package(monkeypatch, "ale_py")
    assert bench("--env", "ALE/Pong-v5", "--atari", "--backends", "sync", "--num-envs", "2", *FAST) == 1
    err = capsys.readouterr().err
    assert "skipping ALE/Pong-v5: ale-py is not installed" in err
    assert "nothing could be measured" in err


def test_atari_takes_ale_ids(capsys):
    assert bench("CartPole-v1", "--atari", *FAST) == 2
    assert "--atari takes ALE ids" in capsys.readouterr().err


@pytest.mark.heavy
def test_atari_pipeline(tmp_path):
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    env = peers.env_factory("ALE/Pong-v5", atari=True)()
    try:
        assert env.observation_space.shape == (4, 84, 84)
        assert env.unwrapped._frameskip == 1
    finally:
        env.close()
    out = tmp_path / "out.json"
    assert bench("--env", "ALE/Pong-v5", "--atari", "--num-envs", "2", "--backends", "sync,ale",
                 "--json", str(out), *FAST) == 0
    runs = {r["backend"] for r in json.loads(out.read_text())["results"]}
    assert runs == {"sync", "ale"}


def test_python_dash_m_entry_point(tmp_path):
    # Away from the source tree, which `python -m` would import instead of the installed package.
    done = subprocess.run([sys.executable, "-m", "shmvec.bench", "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert done.returncode == 0
    assert "--num-envs" in done.stdout and "module:callable" in done.stdout
    assert "``" not in done.stdout  # the docstring's markup is not for a terminal


@pytest.mark.parametrize("flag", ["--busy-apart", "--busy-late"])
def test_where_and_when_the_hogs_run_needs_hogs(flag, capsys):
    assert bench("CartPole-v1", flag, "--backends", "sync", *FAST) == 2
    assert "need --busy N" in capsys.readouterr().err
