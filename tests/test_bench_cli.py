"""Smoke tests of `shmvec bench`: tiny runs, the JSON they write, and how
bad input and missing peers are reported."""

import dataclasses
import importlib.util
import json
import subprocess
import sys

import pytest

from shmvec import ShmVecEnv, cli
from shmvec.peers import PEERS
from shmvec.testing import NoopEnv

FAST = ["--seconds", "0.05"]


class FailingEnv(NoopEnv):
    """Imported by name in the benchmark's own processes."""

    def step(self, action):
        raise RuntimeError("this env cannot step")


@pytest.fixture(autouse=True)
def restore_sys_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command adds the current folder


def bench(*args: str) -> int:
    return cli.main(["bench", *args])


def test_module_callable_json_table_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "out.json", tmp_path / "out.png"
    code = bench("shmvec.testing:NoopEnv", "--num-envs", "2,3", "--backends", "shmvec,sync",
                 "--workers", "1", "--json", str(out), "--plot", str(plot), *FAST)
    assert code == 0
    report = json.loads(out.read_text())
    assert report["settings"]["envs"] == ["shmvec.testing:NoopEnv"]
    assert report["usable_cpus"] >= 1
    assert report["machine_limit"]["shmvec.testing:NoopEnv"] > 0
    runs = {(r["backend"], r["num_envs"]): r for r in report["results"]}
    assert set(runs) == {("shmvec", 2), ("shmvec", 3), ("sync", 2), ("sync", 3)}
    for r in runs.values():
        assert r["steps_per_s"] > 0 and r["peak_rss_mib"] > 0 and r["of_limit"] > 0
    assert runs["sync", 2]["vs_sync"] == pytest.approx(1.0)
    captured = capsys.readouterr()
    assert "steps/s" in captured.out and "shmvec" in captured.out and "sync" in captured.out
    if importlib.util.find_spec("matplotlib"):
        assert plot.read_bytes().startswith(b"\x89PNG")
    else:
        assert "matplotlib is not installed" in captured.out + captured.err


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
    assert runs["shmvec"]["workers"] == default.num_workers
    assert isinstance(runs["shmvec"]["pinned"], bool)
    if pin_workers is False:
        assert runs["shmvec"]["pinned"] is False
    assert "workers" not in runs["sync"] and "pinned" not in runs["sync"]


def test_json_records_workers_given(tmp_path):
    out = tmp_path / "out.json"
    assert bench("shmvec.testing:NoopEnv", "--num-envs", "3", "--backends", "shmvec", "--workers", "2",
                 "--json", str(out), *FAST) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["workers"] == 2
    assert report["results"][0]["workers"] == 2


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
    assert "one env in a plain loop failed: RuntimeError: this env cannot step" in err
    assert "nothing could be measured" in err


@pytest.mark.parametrize(("args", "message"), [
    (["--backends", "shmvec,nope"], "unknown backend 'nope'; choose from shmvec, sync, async"),
    (["NoSuchEnv-v0"], "'NoSuchEnv-v0' is not a registered gymnasium env id"),
    (["shmvec.testing:NoSuchEnv"], "shmvec.testing has no callable 'NoSuchEnv' and registers no env id"),
    (["shmvec_no_such_module:Env"], "cannot import 'shmvec_no_such_module'"),
    (["--num-envs", "8,x"], "expected positive integers separated by commas"),
    (["--seconds", "0"], "must be positive"),
])
def test_bad_arguments_are_clear_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench(*args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_python_dash_m_entry_point(tmp_path):
    # Away from the source tree, which `python -m` would import instead of the installed package.
    done = subprocess.run([sys.executable, "-m", "shmvec.bench", "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert done.returncode == 0
    assert "--num-envs" in done.stdout and "module:callable" in done.stdout
