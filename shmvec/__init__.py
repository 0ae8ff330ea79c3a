"""shmvec: step many reinforcement-learning environments in parallel through
shared memory. ``shmvec.ShmVecEnv`` is a drop-in Gymnasium ``VectorEnv``."""

from importlib.metadata import version as _version

from shmvec.errors import PerformanceWarning, ShmVecError, WorkerDiedError
from shmvec.make import make
from shmvec.vector_env import ShmVecEnv

__all__ = ["ShmVecEnv", "make", "WorkerDiedError", "ShmVecError", "PerformanceWarning", "__version__"]

# Written once, in pyproject.toml; read from the installed package's metadata.
__version__: str = _version("shmvec")
