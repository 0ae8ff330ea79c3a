"""What a worker started by forkserver or spawn takes from the caller, so
that it sees what a forked one would.

- **Environment variables** (forkserver): the fork server has the caller's
  environment of when it started, with the program's first such vector
  env; a variable set since (``MUJOCO_GL``, a run's settings) would reach
  the caller's own slice of envs and fork's and spawn's workers, not these.
  A worker takes the caller's variables as they are when it is started;
  modules it imports from then on see them (the fork server has numpy and
  gymnasium loaded already).
- **Gymnasium ids registered at run time** (forkserver and spawn): such a
  worker imports the main module afresh and does not run its main guard,
  so an id registered there is not in its registry. A factory that fails
  to find an id gets the caller's registrations that the worker lacks,
  and is called once more. Only then: a factory that registers ids itself
  (``gym.register_envs(ale_py)``) would otherwise be warned that it
  overrides them.
- **Warning filters**: the caller's, as they are when the worker is
  started (forkserver and spawn: a ``warnings.filterwarnings`` in the main
  guard that silences an env's warnings, say), in place of the worker's
  own, and again whenever the caller has changed them by the time it
  begins a command (every start method: ``FilterSync``): a worker then
  decides as the caller would, and, as any process whose filters change,
  shows again what it showed once (what it shows goes to the caller:
  warning_relay). A filter whose category the worker cannot import is
  left out.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import cloudpickle
import gymnasium as gym

__all__ = ["caller_environ", "caller_registrations", "caller_warning_filters", "take_environ",
           "take_warning_filters", "CallerRegistrations", "FilterSync"]

# Each registered spec pickled once: (the spec, its bytes), by id.
_pickled_specs: dict[str, tuple[Any, bytes | None]] = {}


def caller_environ(start_method: str) -> dict[str, str] | None:
    """The variables to hand a worker: None where it inherits them."""
    return dict(os.environ) if start_method == "forkserver" else None


def take_environ(environ: dict[str, str]) -> None:
    """This process's variables made `environ` (in a new worker)."""
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)


def caller_warning_filters(start_method: str) -> list[bytes] | None:
    """The caller's warning filters, for a worker that does not inherit them."""
    return None if start_method == "fork" else pickled_filters(warnings.filters)


def pickled_filters(filters: list) -> list[bytes]:
    """Warning filters, each pickled (action, message and module patterns,
    category, line); one that cannot be pickled is left out."""
    pickled = []
    for action, message, category, module, lineno in filters:
        try:
            pickled.append(cloudpickle.dumps((action, message.pattern if message else "", category,
                                              module.pattern if module else "", lineno)))
        except Exception:
            continue
    return pickled


def take_warning_filters(pickled: list[bytes]) -> None:
    """This process's warning filters made the caller's (in a new worker),
    in their order."""
    warnings.resetwarnings()
    for data in pickled:
        try:
            action, message, category, module, lineno = cloudpickle.loads(data)
        except Exception:  # a category this worker cannot import: as if the filter were not there
            continue
        warnings.filterwarnings(action, message, category, module, lineno, append=True)


class FilterSync:
    """In the caller: whether its warning filters differ from those its
    workers last took (its own when the workers started).

    Asked as every command begins, so cheap when nothing changed: a few
    identity checks while the filter list is the one seen last; the whole
    list is compared only when it is another one (each
    ``warnings.catch_warnings()`` makes a copy: a loop that steps inside one
    of its own sends nothing). A change that leaves the list equal to the
    one the workers took is not sent; in the caller it makes what was shown
    once show again, in the workers not."""

    def __init__(self):
        self.taken(warnings.filters)

    def changed(self) -> list | None:
        """The caller's filters, if the workers have others; else None."""
        filters = warnings.filters
        if filters is self._list and len(filters) == self._len and (not filters or filters[0] is self._first):
            return None
        if filters == self._content:
            self._seen(filters)
            return None
        return list(filters)

    def taken(self, filters: list) -> None:
        """The workers took `filters` (they are the caller's now)."""
        self._content = list(filters)
        self._seen(warnings.filters)

    def forget(self) -> None:
        """A worker was restarted with the caller's filters of then: send them all again."""
        self._list = self._content = None

    def _seen(self, filters: list) -> None:
        self._list, self._len, self._first = filters, len(filters), filters[0] if filters else None


def caller_registrations(start_method: str) -> dict[str, bytes] | None:
    """The caller's registered specs, each pickled (by value where pickle
    cannot name it: an env class of the main module), for a worker that
    does not inherit them; a spec that cannot be pickled is left out."""
    if start_method == "fork":
        return None
    pickled = {}
    for env_id, spec in gym.registry.items():
        cached = _pickled_specs.get(env_id)
        if cached is None or cached[0] is not spec:
            try:
                data = cloudpickle.dumps(spec)
            except Exception:
                data = None
            cached = _pickled_specs[env_id] = (spec, data)
        if cached[1] is not None:
            pickled[env_id] = cached[1]
    return pickled


class CallerRegistrations:
    """In a worker, the caller's registrations, added to its own registry
    the first time a factory misses an id."""

    def __init__(self, pickled: dict[str, bytes] | None):
        self._pickled = pickled

    def add_missing(self) -> bool:
        """Adds the caller's ids this registry lacks; True if any (once)."""
        pickled, self._pickled = self._pickled, None
        added = False
        for env_id, data in (pickled or {}).items():
            if env_id in gym.registry:
                continue
            try:
                gym.registry[env_id] = cloudpickle.loads(data)
            except Exception:  # e.g. an entry point this worker cannot import: as if not registered
                continue
            added = True
        return added
