"""Thread pools of the libraries that envs use (BLAS, OpenMP, OpenCV) held
at one thread in a worker: each worker steps on one CPU, and a pool of one
thread per CPU in every worker would oversubscribe the machine.

A fork stops OpenBLAS's pool, and setting its thread count in the child
starts the pool again, one thread per CPU, even to set one thread. Each new
thread spins with sched_yield for about 0.1 s before it sleeps, on the
worker's CPU (threads inherit its pinning), so a worker that set the count
shared its core with them from its start: its env construction slowed, and
its spin, losing the core on every yield, backed off for up to 64 ms at a
time (NoopEnv x8 on two vCPUs: the first 0.1 s at 0.14M-0.24M steps/s
against 1.1M-1.5M after, the worker asleep in every wait; README, "A
worker's first 0.1 s"). So the fork server, which every worker under
forkserver is forked from, holds the pools at one thread (``fork_server``),
and a worker sets only pools that run more threads.
Under fork (the learner is the parent, its pools are its own) and spawn (a
fresh interpreter makes its pool when it imports numpy) the count is set in
the worker, as before.

In the caller, ``end_idle_openmp_helpers`` ends the helper threads that an
OpenMP parallel op (torch's) left spinning, for ``torch_threads`` to call
where they would take the workers' CPUs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable, Iterator

__all__ = ["end_idle_openmp_helpers", "hold_env_pools", "hold_loaded_pools", "hold_worker_pools",
           "env_pools_held_while_forking"]

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def hold_loaded_pools() -> None:
    """One thread for the BLAS/OpenMP pools already loaded, leaving alone
    those at one thread already (setting them would restart a pool that a
    fork stopped)."""
    try:
        from threadpoolctl import ThreadpoolController

        for pool in ThreadpoolController().lib_controllers:
            if pool.num_threads != 1:
                pool.set_num_threads(1)
    except Exception:  # threadpoolctl is best effort: never fail a worker for it
        pass


def hold_worker_pools() -> None:
    """A worker's pools at one thread: environment variables for libraries
    loaded from now on, then those numpy loaded already."""
    for var in _THREAD_VARS:
        os.environ[var] = "1"
    hold_loaded_pools()


def hold_env_pools() -> None:
    """One thread for the pools that envs bring and the BLAS cap does not
    reach: OpenCV's (Gymnasium's AtariPreprocessing resizes with it), which
    otherwise starts a thread per CPU in every worker."""
    cv2 = sys.modules.get("cv2")
    if cv2 is not None:
        cv2.setNumThreads(1)


@contextlib.contextmanager
def env_pools_held_while_forking(start_method: str) -> Iterator[None]:
    """Under fork, OpenCV's pool held at one thread in this process while a
    worker is forked, then set back. A forked child that sets the thread
    count of a pool its parent ran (hold_env_pools, in every worker) hangs
    in OpenCV 4's pthreads pool; a parent's pool at one thread has no
    threads, and setting it in the child is safe. (Under forkserver and
    spawn, workers come from a fresh interpreter.)"""
    cv2 = sys.modules.get("cv2") if start_method == "fork" else None
    threads = cv2.getNumThreads() if cv2 is not None else 1
    if threads != 1:
        cv2.setNumThreads(1)
    try:
        yield
    finally:
        if threads != 1:
            cv2.setNumThreads(threads)


_OMP_PAUSE_SOFT = 1  # omp_pause_soft: the runtime's threads end; its settings stay
_openmp_pauses: list[Callable[[int], int]] | None = None  # found at the first call


def end_idle_openmp_helpers() -> None:
    """Ends the helper threads that this thread's OpenMP parallel ops left
    idle, in each OpenMP runtime loaded in this process
    (``omp_pause_resource_all``, OpenMP 5.0: libgomp from GCC 9 on). GNU
    OpenMP's helpers spin for about 5 ms after each op (torch's, after its
    forward pass or update) before they sleep; the next parallel op starts
    them again. On a 2-vCPU VM a pause took about 30 us and the next op
    about 30 us longer. The runtimes are looked up once (threadpoolctl, as
    for the workers' pools); a runtime without the call is left alone."""
    global _openmp_pauses
    if _openmp_pauses is None:
        _openmp_pauses = []
        try:
            from threadpoolctl import ThreadpoolController

            for pool in ThreadpoolController().lib_controllers:
                if pool.internal_api != "openmp":
                    continue
                pause = getattr(pool.dynlib, "omp_pause_resource_all", None)
                if pause is not None:
                    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
                    _openmp_pauses.append(pause)
        except Exception:  # best effort, as for the workers' pools: never fail a step for it
            pass
    for pause in _openmp_pauses:
        pause(_OMP_PAUSE_SOFT)
