"""What multiprocessing's fork server loads before it forks workers
(``set_forkserver_preload``); nothing else imports this module.

numpy, gymnasium and the worker's code, so that workers start in
milliseconds, and the BLAS/OpenMP pools held at one thread, so that a
worker forked from here need not set them (``thread_pools`` says why).
The program has one fork server: other processes it starts, the program's
own, begin with one BLAS thread too; they may set more (threadpoolctl).

Each process forked from here would also begin with this one's numpy
global RNG state, so that envs drawing from ``np.random.*`` would draw the
same numbers in every worker (and in other libraries' workers, such as
SB3's SubprocVecEnv's). A fresh import of numpy seeds it from the OS; so
does each child, as Python's ``random`` does after a fork.
"""

import os

import numpy as np

import shmvec._engine.worker  # noqa: F401
from shmvec._engine.thread_pools import hold_loaded_pools

hold_loaded_pools()
os.register_at_fork(after_in_child=np.random.seed)
