"""shmvec: step many reinforcement-learning environments in parallel through
shared memory. ``shmvec.ShmVecEnv`` is a drop-in Gymnasium ``VectorEnv``."""

from shmvec.errors import ShmVecError, WorkerDiedError
from shmvec.make import make
from shmvec.vector_env import ShmVecEnv

__all__ = ["ShmVecEnv", "make", "WorkerDiedError", "ShmVecError", "__version__"]

__version__ = "0.1.0"
