"""What the package ships: its version written once, `shmvec --version`, the
license and the py.typed marker in the installed package, and an sdist that
holds what a build needs and nothing that a checkout gathers."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

import shmvec
from shmvec import cli

SOURCE_TREE = pathlib.Path(__file__).resolve().parent.parent

# What an sdist needs to build the package, and so all it holds.
SDIST_FILES = ["pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE"]
SDIST_GLOBS = ["csrc/**/*.cpp", "csrc/**/*.hpp", "shmvec/**/*.py", "shmvec/py.typed"]

# What the README's commands and a developer's work leave in a checkout.
CHECKOUT_LITTER = [
    "bench.json", "bench.png",  # shmvec bench --plot bench.png --json bench.json
    ".venv/pyvenv.cfg", ".venv/lib/python3/site-packages/x.py",
    ".pytest_cache/v/cache/nodeids", ".hypothesis/examples/x", ".benchmarks/x.json",
    "shmvec/__pycache__/engine.cpython-311.pyc", "shmvec/_core.cpython-311-x86_64-linux-gnu.so",
    "build/CMakeCache.txt", "dist/shmvec-0.0.0.tar.gz", "shmvec.egg-info/PKG-INFO", "notes.txt",
]


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    path = SOURCE_TREE / "pyproject.toml"
    if not path.is_file():
        pytest.skip("no pyproject.toml beside the tests")
    return tomllib.loads(path.read_text())


def test_version_is_written_once():
    assert shmvec.__version__ == importlib.metadata.version("shmvec") == _pyproject()["project"]["version"]


def test_version_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"shmvec {shmvec.__version__}\n"


def test_console_script_version():
    script = pathlib.Path(sys.executable).parent / "shmvec"
    if not script.exists():
        pytest.skip(f"no shmvec console script beside {sys.executable}")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"shmvec {shmvec.__version__}\n"


def test_installed_package_has_license_and_py_typed():
    dist = importlib.metadata.distribution("shmvec")
    assert dist.metadata["License-Expression"] == "MIT"
    assert dist.metadata.get_all("License-File") == ["LICENSE"]
    assert "MIT License" in dist.read_text("licenses/LICENSE")
    assert (importlib.resources.files("shmvec") / "py.typed").is_file()


def _copy_checkout(dest: pathlib.Path) -> None:
    """The checkout's own files (what git would hold), without a build's or
    a run's leftovers."""
    shutil.copytree(SOURCE_TREE, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "__pycache__", "*.so", "*.egg-info", ".*_cache", ".hypothesis",
        ".benchmarks", "bench.json", "bench.png"))


@pytest.mark.heavy
def test_sdist_holds_what_a_build_needs_and_nothing_else(tmp_path):
    if not (SOURCE_TREE / "csrc").is_dir():
        pytest.skip("no source tree beside the tests (an installed wheel is under test)")
    if importlib.util.find_spec("build") is None:
        pytest.skip("the build package is not installed (pip install build)")
    checkout = tmp_path / "checkout"
    _copy_checkout(checkout)
    needed = {pathlib.PurePosixPath(name) for name in SDIST_FILES}
    for pattern in SDIST_GLOBS:
        needed |= {pathlib.PurePosixPath(p.relative_to(checkout).as_posix()) for p in checkout.glob(pattern)}
    assert {"shmvec/__init__.py", "shmvec/py.typed", "csrc/binding.cpp"} <= {str(p) for p in needed}
    for name in CHECKOUT_LITTER:
        path = checkout / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("litter\n")

    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(checkout)],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sdist,) = out.glob("shmvec-*.tar.gz")
    assert sdist.name == f"shmvec-{shmvec.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if not m.isdir()]
    top = f"shmvec-{shmvec.__version__}"
    assert all(m.name.startswith(top + "/") for m in members)
    held = {pathlib.PurePosixPath(m.name).relative_to(top) for m in members}
    assert held == needed | {pathlib.PurePosixPath("PKG-INFO")}
