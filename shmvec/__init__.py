"""shmvec: step many reinforcement-learning environments in parallel through
shared memory. ``shmvec.ShmVecEnv`` is a drop-in Gymnasium ``VectorEnv``."""

from importlib import import_module as _import_module
from importlib.metadata import version as _version

# The built extension first: a source tree without it (a checkout beside an
# installed shmvec, found first on sys.path by a forkserver started in it)
# then fails before any of its subpackages is imported and cached, so the
# installed package is imported whole afterwards, never mixed with it.
from shmvec import _core  # noqa: F401
from shmvec.errors import PerformanceWarning, ShmVecError, WorkerDiedError
from shmvec.make import make
from shmvec.vector_env import ShmVecEnv

__all__ = ["ShmVecEnv", "make", "WorkerDiedError", "ShmVecError", "PerformanceWarning", "__version__"]

# Written once, in pyproject.toml; read from the installed package's metadata.
__version__: str = _version("shmvec")

# Reached as attributes after `import shmvec` alone (`shmvec.sb3.ShmVecEnv`),
# but imported only then: they pull in Stable-Baselines3 (and torch) or Ray.
_SUBMODULES = ("sb3", "ray", "testing")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return _import_module(f"shmvec.{name}")
    raise AttributeError(f"module 'shmvec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})
