"""The native core's own C++ tests (csrc/tests), built with CMake and run
without Python: round trips across forked processes, async rings, liveness;
front end and workers as threads over one arena (lost wake-ups, randomized
stress), also under ThreadSanitizer."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

SOURCE = pathlib.Path(__file__).resolve().parent.parent

needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


def _build(build: pathlib.Path, *targets: str, options: tuple[str, ...] = ()) -> None:
    subprocess.run(["cmake", "-S", str(SOURCE), "-B", str(build), "-DSHMVEC_BUILD_TESTS=ON", *options],
                   check=True, capture_output=True)
    for target in targets:
        subprocess.run(["cmake", "--build", str(build), "--target", target, "-j2"],
                       check=True, capture_output=True)


def _run(args: list[str], timeout: float, env: dict | None = None) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@needs_cmake
def test_native_core(tmp_path):
    build = tmp_path / "build"
    _build(build, "test_signal", "test_threads", options=("-DCMAKE_BUILD_TYPE=Release",))
    out = _run([str(build / "test_signal")], timeout=90)
    assert "round trips ok" in out
    assert "pop_finished: oldest first across workers, in pieces: ok" in out
    assert "thread tests: ok" in _run([str(build / "test_threads"), "5000"], timeout=90)


@pytest.mark.heavy  # a second build of the core, under ThreadSanitizer (~30 s)
@needs_cmake
def test_threads_under_thread_sanitizer(tmp_path):
    """Every shared word and area, seen by ThreadSanitizer: the first report fails."""
    build = tmp_path / "build"
    _build(build, "test_threads", options=("-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DSHMVEC_SANITIZE=thread"))
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1")
    assert "thread tests: ok" in _run([str(build / "test_threads")], timeout=300, env=env)
