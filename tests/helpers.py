"""Comparison helpers shared by the tests."""

from __future__ import annotations

import itertools
import os
from typing import Any

import numpy as np
import pytest

from shmvec._gym_compat import AUTORESET_MODES, GYMNASIUM_1, GYMNASIUM_VERSION, AutoresetMode, autoreset_mode

# The autoreset modes to compare in: Gymnasium 1.1's three; before 1.1 the
# installed version's only behaviour (0.29: same-step, with
# final_observation; 1.0: next-step), which no keyword asks for.
MODES = list(AutoresetMode) if AUTORESET_MODES else [autoreset_mode(None)]
SAME_STEP = AutoresetMode.SAME_STEP
AUTORESETTING_MODES = [m for m in MODES if m is not AutoresetMode.DISABLED]
FINAL_OBS = "final_obs" if GYMNASIUM_1 else "final_observation"


def mode_id(mode: AutoresetMode | None) -> str:
    return "default" if mode is None else mode.value


def autoreset_kwargs(mode: AutoresetMode | None) -> dict[str, Any]:
    """The vector env keywords for autoreset `mode` (None: the default)."""
    return {"autoreset_mode": mode} if mode is not None and AUTORESET_MODES else {}


def sync_pair(fns: list, mode: AutoresetMode | None = None, **kwargs: Any) -> tuple:
    """A ShmVecEnv (with `kwargs`) and a SyncVectorEnv over `fns`, in
    autoreset `mode` (None: the installed Gymnasium's default)."""
    import shmvec
    from gymnasium.vector import SyncVectorEnv

    return (shmvec.ShmVecEnv(fns, **autoreset_kwargs(mode), **kwargs),
            SyncVectorEnv(fns, **autoreset_kwargs(mode)))


def quick_by_default(axes: list[list], *quick: tuple) -> list:
    """Every combination of `axes`, for a parametrize; all but the `quick` ones
    are heavy (run with -m heavy), so that the default run keeps a few of the grid."""
    return [combo if combo in quick else pytest.param(*combo, marks=pytest.mark.heavy)
            for combo in itertools.product(*axes)]


def needs_gymnasium_1(what: str) -> pytest.MarkDecorator:
    """Skips a test under Gymnasium 0.29: `what` is a 1.x feature."""
    return pytest.mark.skipif(not GYMNASIUM_1, reason=f"{what}: Gymnasium 1.x only (installed: {GYMNASIUM_VERSION})")


def needs_autoreset_modes(what: str) -> pytest.MarkDecorator:
    """Skips a test under Gymnasium 0.29 and 1.0: `what` came in 1.1
    (autoreset_mode, options["reset_mask"])."""
    return pytest.mark.skipif(not AUTORESET_MODES,
                              reason=f"{what}: Gymnasium 1.1+ only (installed: {GYMNASIUM_VERSION})")


# Tests of same-step autoreset run where the installed Gymnasium has it: not 1.0.
needs_same_step = pytest.mark.skipif(SAME_STEP not in MODES,
                                     reason=f"same-step autoreset: not in Gymnasium {GYMNASIUM_VERSION}")


def skip_unless_gymnasium(what: str, since: str) -> None:
    """Skips the calling test module under a Gymnasium older than `since`,
    "1.0" or "1.1" (call it before importing names only those have)."""
    if not GYMNASIUM_1 or (since == "1.1" and not AUTORESET_MODES):
        pytest.skip(f"{what}: Gymnasium {since}+ only (installed: {GYMNASIUM_VERSION})", allow_module_level=True)


def _zero_dim(x: Any) -> Any:
    """A numpy scalar as a 0-d array. An env may return either for a Box of
    shape (); shmvec cannot tell them apart across processes (documented)."""
    return np.asarray(x) if isinstance(x, np.generic) else x


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Exactly equal, dtypes, key order and container types included."""
    if isinstance(a, np.generic) != isinstance(b, np.generic) and np.ndim(a) == np.ndim(b) == 0:
        a, b = _zero_dim(a), _zero_dim(b)
    assert type(a) is type(b), f"{where}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{k}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
        if a.dtype == object:
            for k, (x, y) in enumerate(zip(a.ravel(), b.ravel())):
                assert_same(x, y, f"{where}[{k}]")
        else:
            assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), f"{where}: {a} != {b}"
    elif hasattr(a, "nodes") and hasattr(a, "edge_links"):  # GraphInstance
        for field in ("nodes", "edges", "edge_links"):
            assert_same(getattr(a, field), getattr(b, field), f"{where}.{field}")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def run_lockstep(envs, ref, steps: int, seed: int = 0, reset_seed: Any = 0) -> None:
    """Steps `envs` and the reference with the same actions and compares
    every output; under DISABLED autoreset, resets finished envs by mask."""
    out, expected = envs.reset(seed=reset_seed), ref.reset(seed=reset_seed)
    assert_same(out, expected, "reset")
    ref.action_space.seed(seed)
    disabled = ref.metadata.get("autoreset_mode") == AutoresetMode.DISABLED  # 0.29: no such key
    for t in range(steps):
        actions = ref.action_space.sample()
        out, expected = envs.step(actions), ref.step(actions)
        assert_same(out, expected, f"step {t}")
        done = np.logical_or(expected[2], expected[3])
        if disabled and done.any():
            options = {"reset_mask": done}
            out = envs.reset(options=dict(options))
            expected = ref.reset(options=dict(options))
            assert_same(out, expected, f"masked reset after step {t}")


def init_local_ray(tmp_path_factory: pytest.TempPathFactory, workers_cwd: os.PathLike, num_cpus: int) -> str:
    """Starts a local Ray cluster that keeps its files with pytest's
    temporary files, not in /tmp, and returns its processes' TMPDIR.
    Ray puts the driver's working directory on its workers' path: it is
    `workers_cwd` during ray.init(). Its session files (logs, sockets) go
    to a directory of their own; its processes inherit TMPDIR, because Ray
    kills them at shutdown, before multiprocessing's exit hook removes the
    pymp-* directory of a fork server that a ShmVecEnv in one started.
    Its workers run at nice 0, not Ray's 15: beside whatever else keeps a
    CI machine busy, an actor at nice 15 takes ten times as long to start
    or restart (test_ray's test_actors_run_at_the_niceness_they_are_given
    covers Ray's setting)."""
    import ray

    tmpdir = str(tmp_path_factory.mktemp("tmp"))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workers_cwd)
        mp.setenv("TMPDIR", tmpdir)
        mp.setenv("RAY_worker_niceness", "0")
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 _temp_dir=str(tmp_path_factory.mktemp("ray")))
    return tmpdir


def row_info(infos: dict, i: int) -> dict:
    """One env's part of vectorised infos (the inverse of _add_info), keys
    sorted: their batched order depends on which other envs share the batch."""
    out = {}
    for key, value in sorted(infos.items()):
        if key.startswith("_") or key == "env_id":
            continue
        mask = infos.get(f"_{key}")
        if mask is None or not mask[i]:
            continue
        out[key] = row_info(value, i) if isinstance(value, dict) else value[i]
    return out
