"""Scale out over a Ray cluster: ``shmvec.ray.RayVecEnv`` splits its envs
into contiguous slices, each stepped by a ``shmvec.ShmVecEnv`` inside a Ray
actor (so each node uses its own cores through shared memory), behind one
``gymnasium.vector.VectorEnv``. ``register_rllib_env`` makes RLlib's env
runners build their vector envs as ``shmvec.ShmVecEnv``.

Needs ``pip install "shmvec[ray]"``; ``import shmvec`` never imports ray: this
package does, on first use of ``shmvec.ray``.

The modules: ``vector_env`` (RayVecEnv), ``actor_calls`` (its calls to the
actors, their deaths and restarts), ``actor`` (inside an actor), ``scheduler``
(async mode's bookkeeping), ``batches`` and ``infos`` (moving batches and
infos between actors and the caller), ``restarts``, ``errors``, ``rllib``.
"""

from shmvec._gym_compat import require_gymnasium
from shmvec.errors import import_extra

require_gymnasium("shmvec.ray (RayVecEnv, register_rllib_env)", "1.1", ImportError)
import_extra("ray", "shmvec.ray", "Ray", "ray")

from shmvec.ray.errors import ActorDiedError  # noqa: E402
from shmvec.ray.rllib import register_rllib_env  # noqa: E402
from shmvec.ray.vector_env import RayVecEnv  # noqa: E402

__all__ = ["ActorDiedError", "RayVecEnv", "register_rllib_env"]
