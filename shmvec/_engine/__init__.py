"""The engine under every front end: one shared-memory arena, the worker
processes that step slices of envs in it, and the commands that drive them.
Front ends (``shmvec.vector_env``, ``shmvec.sb3``, ``shmvec.ray``) stay thin
over ``Engine``; nothing here imports Gymnasium's vector API, SB3 or Ray.
See docs/architecture.md for the walk of one step through these modules.
"""
