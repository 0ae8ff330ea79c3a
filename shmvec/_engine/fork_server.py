"""What multiprocessing's fork server loads before it forks workers
(``set_forkserver_preload``); nothing else imports this module.

numpy, gymnasium and the worker's code, so that workers start in
milliseconds, and the BLAS/OpenMP pools held at one thread, so that a
worker forked from here need not set them (``thread_pools`` says why).
The program has one fork server: other processes it starts, the program's
own, begin with one BLAS thread too; they may set more (threadpoolctl).
"""

import shmvec._engine.worker  # noqa: F401
from shmvec._engine.thread_pools import hold_loaded_pools

hold_loaded_pools()
