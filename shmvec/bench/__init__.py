"""The benchmark tools: the ``shmvec bench`` command (`command`, its
arguments; `passes`, its measurements, each in a fresh process; `report`,
its table, JSON and plot), `timeline` (``python -m shmvec.bench.timeline``:
where a lock-step batch's time goes) and what it shares with the pytest-benchmark
suites in the repository's ``bench/``: the vector envs compared, each built
from one env spec (`peers`), and how they are measured (`measure`).
``import shmvec`` does not import them.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["add_arguments", "run", "measure_once"]

# Where each name lives. Imported on first use, not here: a vector env's
# worker that unpickles an env factory of `peers` imports this package, and
# needs neither the command nor its imports (argparse, statistics, ...).
_EXPORTS = {"add_arguments": "command", "run": "command", "measure_once": "passes"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
