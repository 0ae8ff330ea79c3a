"""bench/late_hogs.py --migrations: its reading of `perf script`'s
sched_migrate_task lines (the figures in docs/performance.md, "How the
kernel settles the hogs", rest on it)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "late_hogs.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="needs the source tree's bench/")


@pytest.fixture(scope="module")
def late_hogs():
    spec = importlib.util.spec_from_file_location("late_hogs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def line(at: float, comm: str, pid: int, source: int, target: int) -> str:
    return (f"     migration/0    18 [000] {at:.6f}: sched:sched_migrate_task: comm={comm} pid={pid} prio=120 "
            f"orig_cpu={source} dest_cpu={target}")


PIDS = {"caller": 100, "workers": [101], "hogs": [200, 201], "hogs_at_ns": 10_000_000_000}


def test_counts_the_callers_moves_until_a_hog_leaves_the_workers_cpu(late_hogs):
    text = "\n".join([
        line(9.5, "python", 100, 0, 1),   # before the hogs: not counted
        line(10.1, "python", 101, 1, 0),  # shmvec moves the worker to the caller's CPU 0
        line(10.2, "python", 100, 0, 1),  # the kernel moves the caller to CPU 1 ...
        line(10.2, "python", 101, 0, 1),  # ... and shmvec the worker after it
        line(10.3, "python", 201, 0, 1),  # a hog joins them: not leaving
        line(10.4, "python", 100, 1, 0),
        line(10.4, "python", 101, 1, 0),
        line(10.75, "python", 200, 0, 1),  # a hog leaves the workers' CPU 0
        line(11.0, "python", 100, 0, 1),  # the caller after that: not counted
        line(11.2, "python", 201, 1, 0),  # a hog comes back: counted in all
    ])
    summary = late_hogs.migrations(text, PIDS)
    assert "at 0.10 s" in summary
    assert "moved the caller 2x" in summary
    assert "off the workers' CPU at 0.75 s" in summary
    assert "hogs moved 3x in all" in summary


def test_says_when_no_hog_left_or_no_worker_moved(late_hogs):
    assert "moved no hog off it" in late_hogs.migrations(line(10.1, "python", 101, 1, 0), PIDS)
    assert "did not move its workers" in late_hogs.migrations(line(10.2, "python", 100, 0, 1), PIDS)
