"""The native core's own C++ tests (csrc/tests), built with CMake and run
without Python: round trips across forked processes, async rings, liveness."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

SOURCE = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_native_core(tmp_path):
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(SOURCE), "-B", str(build), "-DSHMVEC_BUILD_TESTS=ON",
                    "-DCMAKE_BUILD_TYPE=Release"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "test_signal", "-j2"],
                   check=True, capture_output=True)
    result = subprocess.run([str(build / "test_signal")], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "round trips ok" in result.stdout
