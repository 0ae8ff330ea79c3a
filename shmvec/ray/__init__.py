from shmvec.ray.vector_env import ActorDiedError, RayVecEnv, register_rllib_env

__all__ = ["ActorDiedError", "RayVecEnv", "register_rllib_env"]
