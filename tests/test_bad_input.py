"""Bad input: malformed actions, constructor arguments, seeds and reset
masks are refused with ValueError/TypeError before anything reaches a
worker (the vector env stays usable and in step with SyncVectorEnv); envs
that break their own contract get SyncVectorEnv's casts where it casts and
an error naming the env where its result would be wrong."""

from __future__ import annotations

import functools
import math
import os
import re
import threading

import numpy as np
import pytest
from fault_envs import CastEnv, ContractEnv, FaultEnv, descendants, wait_gone
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv
from helpers import MODES, assert_same, mode_id, needs_autoreset_modes, run_lockstep, sync_pair

import shmvec
from shmvec._gym_compat import AutoresetMode
from shmvec.testing import SpacesEnv

FORK = {"start_method": "fork"}


def pair(fns, mode=None, **kwargs):
    kwargs = {"num_workers": 1, "caller_steps": True, **FORK, **kwargs}
    return sync_pair(fns, mode, **kwargs)


def step_both(envs, ref, actions, where=""):
    assert_same(envs.step(actions), ref.step(actions), where)


# -- actions --------------------------------------------------------------------------

N = 4
DICT_ACTIONS = spaces.Dict({"move": spaces.Box(-1, 1, (2,), np.float32), "pick": spaces.Discrete(3)})
TUPLE_ACTIONS = spaces.Tuple((spaces.Discrete(4, start=-2), spaces.Box(-1, 1, (2,), np.float32)))

BAD_ACTIONS = {
    "discrete": (spaces.Discrete(3), [
        ("too few", np.zeros(N - 1, np.int64), ValueError, "shape"),
        ("too many", np.zeros(N + 1, np.int64), ValueError, "shape"),
        ("2-d", np.zeros((N, 1), np.int64), ValueError, "shape"),
        ("scalar", 0, TypeError, "scalar"),  # as SyncVectorEnv: a vector env needs a batch
        ("None", None, (ValueError, TypeError), ""),
        ("float32", np.zeros(N, np.float32), TypeError, "dtype"),
        ("float list", [0.0, 1.0, 2.0, 0.5], TypeError, "dtype"),
        ("complex", np.zeros(N, np.complex64), TypeError, "dtype"),
        ("strings", np.array(["a"] * N), TypeError, "dtype"),
        ("objects", np.array([0, 1, 2, None], dtype=object), TypeError, "dtype"),
    ]),
    "box": (spaces.Box(-1, 1, (2,), np.float32), [
        ("flat", np.zeros(2 * N, np.float32), ValueError, "shape"),
        ("one env short", np.zeros((N - 1, 2), np.float32), ValueError, "shape"),
        ("leaf too wide", np.zeros((N, 3), np.float32), ValueError, "shape"),
        ("one per env", np.zeros(N, np.float32), ValueError, "shape"),
        ("complex", np.zeros((N, 2), np.complex128), TypeError, "dtype"),
        ("strings", np.full((N, 2), "x"), TypeError, "dtype"),
    ]),
    "multidiscrete": (spaces.MultiDiscrete([2, 3]), [
        ("leaf too wide", np.zeros((N, 3), np.int64), ValueError, "shape"),
        ("floats", np.zeros((N, 2), np.float64), TypeError, "dtype"),
    ]),
    "multibinary": (spaces.MultiBinary(3), [  # (floats are taken: see test_equivalence's dtype cases)
        ("leaf too narrow", np.zeros((N, 2), np.int8), ValueError, "shape"),
        ("complex", np.zeros((N, 3), np.complex64), TypeError, "dtype"),
        ("strings", np.full((N, 3), "1"), TypeError, "dtype"),
    ]),
    "dict": (DICT_ACTIONS, [
        ("missing key", {"move": np.zeros((N, 2), np.float32)}, ValueError, "pick"),
        ("list of dicts", [{"move": np.zeros(2, np.float32), "pick": 0}] * N, ValueError, ""),
        ("array", np.zeros((N, 2), np.float32), ValueError, ""),
        ("float pick", {"move": np.zeros((N, 2), np.float32), "pick": np.zeros(N)}, TypeError, "dtype"),
        ("short move", {"move": np.zeros((N - 1, 2), np.float32), "pick": np.zeros(N, np.int64)},
         ValueError, "shape"),
        # the first leaf is fine and written; the second is refused
        ("bad second leaf", {"move": np.ones((N, 2), np.float32), "pick": np.zeros(N + 1, np.int64)},
         ValueError, "shape"),
    ]),
    "tuple": (TUPLE_ACTIONS, [
        ("one item", (np.zeros(N, np.int64),), ValueError, ""),
        ("three items", (np.zeros(N, np.int64), np.zeros((N, 2), np.float32), np.zeros(N)), ValueError, ""),
        ("dict", {"0": np.zeros(N, np.int64)}, ValueError, ""),
        ("bad second item", (np.ones(N, np.int64), np.zeros((N, 3), np.float32)), ValueError, "shape"),
        # as many per-env tuples as the space has items: each taken for one item's batch, ragged
        ("per-env tuples", [(0, np.zeros(2, np.float32))] * len(TUPLE_ACTIONS), ValueError, "one batch per item"),
        ("float first item", (np.zeros(N), np.zeros((N, 2), np.float32)), TypeError, "dtype"),
    ]),
}


@pytest.mark.parametrize("space", sorted(BAD_ACTIONS))
def test_bad_actions_are_refused_and_nothing_steps(space, closing):
    action_space, cases = BAD_ACTIONS[space]
    fns = [functools.partial(SpacesEnv, None, action_space, max_steps=5)] * N
    envs, ref = pair(fns)
    closing(envs), closing(ref)
    assert_same(envs.reset(seed=1), ref.reset(seed=1))
    ref.action_space.seed(2)
    for t, (name, action, error, match) in enumerate(cases):
        with pytest.raises(error, match=match or None) as info:
            envs.step(action)
        assert str(info.value), name
        # Nothing reached a worker or the caller's envs: the next valid step
        # gives what SyncVectorEnv gives (it never saw the bad action).
        step_both(envs, ref, ref.action_space.sample(), f"valid step after {name!r}")
    run_lockstep(envs, ref, steps=10, seed=3, reset_seed=4)


def test_bad_actions_under_disabled_and_same_step(closing):
    for mode in [m for m in MODES if m is not AutoresetMode.NEXT_STEP]:
        fns = [functools.partial(SpacesEnv, None, DICT_ACTIONS, max_steps=3, terminate_prob=0.0)] * N
        envs, ref = pair(fns, mode, num_workers=2, caller_steps=False)
        closing(envs), closing(ref)
        envs.reset(seed=0), ref.reset(seed=0)
        ref.action_space.seed(0)
        with pytest.raises(ValueError):
            envs.step({"move": np.zeros((N, 2), np.float32)})
        step_both(envs, ref, ref.action_space.sample())
        step_both(envs, ref, ref.action_space.sample())


# -- constructor arguments -----------------------------------------------------------------

ENVS = [FaultEnv] * 4
OTHER_CPU = max(os.sched_getaffinity(0)) + 1  # exists nowhere this process may run

BAD_ARGS = [
    ("empty env_fns", dict(env_fns=[]), ValueError, "env_fns"),
    ("empty generator", dict(env_fns=iter([])), (ValueError, TypeError), "env_fns"),
    ("env_fns None", dict(env_fns=None), TypeError, "env_fns"),
    ("one factory, not a list", dict(env_fns=FaultEnv), TypeError, "env_fns"),
    ("envs, not factories", dict(env_fns=[object()] * 2), TypeError, "callable"),
    ("a non-callable among factories", dict(env_fns=[FaultEnv, 3]), TypeError, "callable"),
    ("negative num_workers", dict(num_workers=-1), ValueError, "num_workers"),
    ("float num_workers", dict(num_workers=1.5), TypeError, "num_workers"),
    ("str num_workers", dict(num_workers="2"), TypeError, "num_workers"),
    ("num_workers=0 without caller", dict(num_workers=0, caller_steps=False), ValueError, "caller_steps"),
    ("more workers than envs", dict(num_workers=5, caller_steps=False), ValueError, "envs"),
    ("workers + caller > envs", dict(num_workers=4, caller_steps=True), ValueError, "envs"),
    ("unknown start_method", dict(start_method="thread"), ValueError, "start_method"),
    ("int start_method", dict(start_method=3), (ValueError, TypeError), "start_method"),
    ("zero timeout", dict(timeout=0), ValueError, "timeout"),
    ("negative timeout", dict(timeout=-1.0), ValueError, "timeout"),
    ("nan timeout", dict(timeout=math.nan), ValueError, "timeout"),
    ("str timeout", dict(timeout="1"), (TypeError, ValueError), "timeout"),
    ("bool timeout", dict(timeout=True), (TypeError, ValueError), "timeout"),
    ("str pin_workers", dict(pin_workers="0"), TypeError, "pin_workers"),
    ("int pin_workers", dict(pin_workers=0), TypeError, "pin_workers"),
    ("too few CPUs", dict(num_workers=2, caller_steps=False, pin_workers=[0]), ValueError, "pin_workers"),
    ("negative CPU", dict(pin_workers=[-1]), ValueError, "-1"),
    ("CPU not allowed", dict(pin_workers=[OTHER_CPU]), ValueError, str(OTHER_CPU)),
    ("CPU far out of range", dict(pin_workers=[10**6]), ValueError, str(10**6)),
    ("float CPU", dict(pin_workers=[0.5]), TypeError, "pin_workers"),
    ("str CPU", dict(pin_workers=["a"]), (TypeError, ValueError), "pin_workers"),
    ("bad autoreset_mode", dict(autoreset_mode="Sometimes"), ValueError, "autoreset_mode"),
]


@pytest.mark.parametrize("kwargs, error, match", [c[1:] for c in BAD_ARGS], ids=[c[0] for c in BAD_ARGS])
def test_bad_constructor_arguments(kwargs, error, match):
    kwargs = {"env_fns": ENVS, "num_workers": 1, **FORK, **kwargs}
    before = set(descendants())
    with pytest.raises(error, match=re.escape(match)):
        envs = shmvec.ShmVecEnv(kwargs.pop("env_fns"), **kwargs)
        envs.close()  # accepted: the test fails (DID NOT RAISE) without leaving workers behind
    assert wait_gone(set(descendants()) - before) == []


@pytest.mark.parametrize("timeout", [math.inf, 1e12])
def test_huge_timeout_is_no_timeout_or_refused(timeout, closing):
    """A timeout too large to matter must either be refused up front or
    behave as no timeout, never time out at once."""
    fns = [functools.partial(FaultEnv, hang_s=0.3)] * 2
    try:
        envs = shmvec.ShmVecEnv(fns, num_workers=1, caller_steps=False, timeout=timeout, **FORK)
    except ValueError as exc:
        assert "timeout" in str(exc)
        return
    closing(envs)
    envs.reset()
    obs, *_ = envs.step(np.array([4, 4]))  # both envs sleep 0.3 s
    assert np.array_equal(obs, np.ones((2, 2), np.float32))


@pytest.mark.parametrize("num_workers, caller_steps", [(1, False), (0, True)])
@pytest.mark.parametrize("made", [3, None], ids=["int", "None"])
def test_factory_that_returns_no_env(made, num_workers, caller_steps):
    """An env factory that returns something else than an env gets an error
    that says so (not one raised while cleaning up)."""
    with pytest.raises(TypeError, match="Env") as info:
        shmvec.ShmVecEnv([lambda: made] * 2, num_workers=num_workers, caller_steps=caller_steps, **FORK)
    assert "close" not in str(info.value)


# -- seeds and reset masks -----------------------------------------------------------------------


def sync_error(ref, **kwargs):
    with pytest.raises(Exception) as info:
        ref.reset(**kwargs)
    return info.value


def test_bad_seeds(closing):
    fns = [functools.partial(SpacesEnv, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(3))] * 3
    envs, ref = pair(fns)
    closing(envs), closing(ref)
    envs.reset(seed=5), ref.reset(seed=5)
    ref.action_space.seed(5)
    step_both(envs, ref, ref.action_space.sample())
    # A list of the wrong length: SyncVectorEnv's error and message.
    for seed in ([1, 2], [1, 2, 3, 4], []):
        expected = sync_error(ref, seed=seed)
        if isinstance(expected, AssertionError):  # Gymnasium 0.29's bare assert: shmvec says 1.x's message
            expected = ValueError("If seeds are passed as a list the length must match num_envs=3")
        with pytest.raises(type(expected), match=re.escape(str(expected))):
            envs.reset(seed=seed)
    # Non-integers.
    for seed in (1.5, [1.5, 2, 3], [1, 2, "3"], "3", {"seed": 1}, [None, 2.0, None]):
        with pytest.raises((TypeError, ValueError), match="seed"):
            envs.reset(seed=seed)
    # Stricter than SyncVectorEnv, which reads a bool seed as 1 and passes
    # options of any type on to each env's reset().
    for seed in (True, [True, None, 2]):
        with pytest.raises(TypeError, match="seed"):
            envs.reset(seed=seed)
    with pytest.raises(TypeError, match="options must be a dict or None, got list"):
        envs.reset(options=[])
    # No env was reset by any of these: still in step with the reference.
    for t in range(5):
        step_both(envs, ref, ref.action_space.sample(), f"step {t} after the bad seeds")
    assert_same(envs.reset(seed=[3, None, 4]), ref.reset(seed=[3, None, 4]))
    # numpy ints (which SyncVectorEnv refuses) are seeds like Python's.
    assert_same(envs.reset(seed=np.int64(7)), ref.reset(seed=7))
    assert_same(envs.reset(seed=np.arange(3)), ref.reset(seed=[0, 1, 2]))


def test_set_attr_with_the_wrong_number_of_values_like_sync(closing):
    fns = [functools.partial(SpacesEnv)] * 3
    envs, ref = pair(fns)
    closing(envs), closing(ref)
    for values in ([1, 2], (1, 2, 3, 4), []):
        with pytest.raises(ValueError) as expected:
            ref.set_attr("max_steps", values)
        with pytest.raises(ValueError) as info:
            envs.set_attr("max_steps", values)
        assert str(info.value) == str(expected.value)
    assert envs.get_attr("max_steps") == (20, 20, 20)


BAD_MASKS = {
    "list": [True, False, True],
    "short": np.array([True, False]),
    "2-d": np.ones((3, 1), dtype=np.bool_),
    "ints": np.array([1, 0, 1]),
    "all false": np.zeros(3, dtype=np.bool_),
    "None": None,
}


@needs_autoreset_modes("options['reset_mask']")
@pytest.mark.parametrize("mask", sorted(BAD_MASKS))
def test_bad_reset_masks_like_sync(mask, closing):
    fns = [functools.partial(SpacesEnv, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(3))] * 3
    envs, ref = pair(fns, AutoresetMode.DISABLED)
    closing(envs), closing(ref)
    envs.reset(seed=0), ref.reset(seed=0)
    ref.action_space.seed(0)
    step_both(envs, ref, ref.action_space.sample())
    expected = sync_error(ref, options={"reset_mask": BAD_MASKS[mask]})
    if isinstance(expected, AssertionError):  # Gymnasium 1.1 asserts; shmvec raises as 1.2+ do
        with pytest.raises((TypeError, ValueError), match="reset_mask"):
            envs.reset(options={"reset_mask": BAD_MASKS[mask]})
    else:
        assert isinstance(expected, (TypeError, ValueError))
        with pytest.raises(type(expected)) as info:
            envs.reset(options={"reset_mask": BAD_MASKS[mask]})
        assert str(info.value) == str(expected)
    run_lockstep(envs, ref, steps=10, seed=1, reset_seed=2)


# -- envs that do not agree or break their contract -----------------------------------------------

BOX3 = spaces.Box(-1, 1, (3,), np.float32)
BOX4 = spaces.Box(-1, 1, (4,), np.float32)


@pytest.mark.parametrize(
    "odd_one, which, num_workers, caller_steps",
    [(1, "obs", 1, False), (3, "obs", 1, True), (2, "obs", 2, False), (3, "obs", 0, True),
     (3, "action", 2, False), (3, "action", 3, True), (0, "action", 1, True)],
)
def test_mismatched_spaces(odd_one, which, num_workers, caller_steps):
    def make(i):
        odd = i == odd_one
        obs = BOX4 if odd and which == "obs" else BOX3
        act = spaces.Discrete(4) if odd and which == "action" else spaces.Discrete(3)
        return functools.partial(SpacesEnv, obs, act)

    before = set(descendants())
    with pytest.raises(RuntimeError, match=f"{'observation' if which == 'obs' else 'action'} space"):
        shmvec.ShmVecEnv([make(i) for i in range(4)], num_workers=num_workers, caller_steps=caller_steps,
                         **FORK)
    assert wait_gone(set(descendants()) - before) == []


CONTRACT_BREAKS = {
    # kind: (error types, where it fails, observation space or None)
    "four_values": (ValueError, "step", None),
    "six_values": (ValueError, "step", None),
    "returns_none": ((ValueError, TypeError), "step", None),
    "obs_shape": (ValueError, "step", None),
    "obs_shape_2d": (ValueError, "step", None),
    "obs_scalar": (ValueError, "step", None),
    "obs_complex": (TypeError, "step", None),
    "obs_str": (TypeError, "step", None),
    "obs_float_for_int": (TypeError, "step", spaces.Box(-10, 10, (3,), np.int32)),
    "reset_three_values": (ValueError, "reset", None),
    "reset_obs_shape": (ValueError, "reset", None),
    "reward_none": ((ValueError, TypeError), "step", None),
    "reward_str": ((ValueError, TypeError), "step", None),
    "reward_array": ((ValueError, TypeError), "step", None),
    "flags_array": ((ValueError, TypeError), "step", None),
    "info_none": (TypeError, "step", None),
    "info_list": (TypeError, "step", None),
    "reset_info_none": (TypeError, "reset", None),
}


@pytest.mark.parametrize("bad_row", [1, 2], ids=["caller-env1", "worker-env2"])
@pytest.mark.parametrize("kind", list(CONTRACT_BREAKS))
def test_env_that_breaks_its_contract(kind, bad_row, closing):
    error, where, obs_space = CONTRACT_BREAKS[kind]
    fns = [functools.partial(ContractEnv, i, bad_row, kind, obs_space) for i in range(4)]
    envs = shmvec.ShmVecEnv(fns, num_workers=1, caller_steps=True, **FORK)  # caller: envs 0-1
    closing(envs)
    with pytest.raises(error) as info:
        envs.reset(seed=0)
        assert where == "step", "the bad reset was accepted"
        envs.step(np.zeros(4, np.int64))
    message = str(info.value)
    assert re.search(rf"\benv {bad_row}\b", message), f"the error does not name env {bad_row}: {message!r}"
    # Like any env error: a reset is needed before stepping again.
    with pytest.raises(RuntimeError, match="reset"):
        envs.step(np.zeros(4, np.int64))


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_an_unpicklable_factory_is_named(start_method):
    lock = threading.Lock()

    def factory():
        assert lock
        return FaultEnv()

    with pytest.raises(TypeError, match=r"env_fns\[2\] cannot be pickled.*lock"):
        shmvec.ShmVecEnv([FaultEnv, FaultEnv, factory, FaultEnv], num_workers=1, caller_steps=False,
                         start_method=start_method)


def test_contract_errors_name_the_offending_value(closing):
    checks = {"obs_shape": "(4,)", "obs_complex": "complex128", "four_values": "4", "six_values": "6"}
    for kind, value in checks.items():
        fns = [functools.partial(ContractEnv, i, 3, kind) for i in range(4)]
        envs = shmvec.ShmVecEnv(fns, num_workers=1, caller_steps=False, **FORK)
        closing(envs)
        envs.reset()
        with pytest.raises((ValueError, TypeError)) as info:
            envs.step(np.zeros(4, np.int64))
        assert value in str(info.value), (kind, str(info.value))


CASTS = {
    # name: (space dtype, returned obs dtype, reward type, flag type)
    "f64 obs, f32 box": (np.float32, np.float64, float, bool),
    "i64 obs, f32 box": (np.float32, np.int64, float, bool),
    "f64 obs, f16 box": (np.float16, np.float64, float, bool),
    "f32 obs, f64 box": (np.float64, np.float32, float, bool),
    "list obs, f32 box": (np.float32, "list", float, bool),
    "i64 obs, i32 box": (np.int32, np.int64, float, bool),
    "i8 obs, i16 box": (np.int16, np.int8, float, bool),
    "int reward, 0/1 int flags": (np.float32, np.float32, int, int),
    "numpy reward and flags": (np.float32, np.float32, np.float32, np.bool_),
    "numpy int reward and flags": (np.float32, np.float32, np.int64, np.int64),
    "bool reward": (np.float32, np.float32, bool, bool),
}


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("case", list(CASTS))
def test_casts_like_sync(case, mode, closing):
    space_dtype, obs_dtype, reward_type, flag_type = CASTS[case]
    fns = [functools.partial(CastEnv, i, space_dtype, obs_dtype, reward_type, flag_type) for i in range(4)]
    envs, ref = pair(fns, mode)  # the caller steps envs 0-1, a worker 2-3
    closing(envs), closing(ref)
    assert_same(envs.reset(seed=0), ref.reset(seed=0), "reset")
    ref.action_space.seed(0)
    ended = 0
    for t in range(10):
        actions = ref.action_space.sample()
        out, expected = envs.step(actions), ref.step(actions)
        assert_same(out, expected, f"step {t}")  # final_obs too: the env's own objects, uncast
        done = np.logical_or(expected[2], expected[3])
        ended += int(done.sum())
        if mode is AutoresetMode.DISABLED and done.any():
            mask = {"reset_mask": done}
            assert_same(envs.reset(options=dict(mask)), ref.reset(options=dict(mask)), f"reset after {t}")
    assert ended >= 8  # the autoreset paths wrote observations too


# -- DISABLED autoreset ---------------------------------------------------------------------------


@needs_autoreset_modes("autoreset_mode DISABLED")
@pytest.mark.parametrize("num_workers, caller_steps", [(1, True), (2, False)])
def test_disabled_autoreset_refuses_stepping_finished_envs(num_workers, caller_steps, closing):
    fns = [functools.partial(ContractEnv, i, -1, "") for i in range(4)]  # truncated every 4 steps
    envs, ref = pair(fns, AutoresetMode.DISABLED, num_workers=num_workers, caller_steps=caller_steps)
    closing(envs), closing(ref)
    assert_same(envs.reset(seed=0), ref.reset(seed=0))
    actions = np.zeros(4, np.int64)
    for t in range(4):
        step_both(envs, ref, actions, f"step {t}")
    for _ in range(2):  # refused, and again: nothing reached the envs
        with pytest.raises(RuntimeError, match=r"\[0, 1, 2, 3\].*DISABLED.*reset_mask"):
            envs.step(actions)
    mask = np.array([True, False, True, False])
    assert_same(envs.reset(options={"reset_mask": mask.copy()}), ref.reset(options={"reset_mask": mask.copy()}))
    with pytest.raises(RuntimeError, match=r"\[1, 3\]"):
        envs.step(actions)
    mask = ~mask
    assert_same(envs.reset(options={"reset_mask": mask.copy()}), ref.reset(options={"reset_mask": mask.copy()}))
    for t in range(3):
        step_both(envs, ref, actions, f"step {t} after the masked resets")
    # A full reset clears everything too.
    step_both(envs, ref, actions)
    with pytest.raises(RuntimeError, match="DISABLED"):
        envs.step(actions)
    assert_same(envs.reset(seed=1), ref.reset(seed=1))
    step_both(envs, ref, actions)


@pytest.mark.parametrize("front_end", ["gymnasium", "sb3"])
def test_pickling_or_copying_a_vector_env_is_a_clear_error(front_end, closing):
    """Its workers and shared memory are its process's: pickle, cloudpickle
    and deepcopy say so (not that some lambda or native object inside
    cannot be pickled), and the vector env steps on."""
    import copy
    import pickle

    import cloudpickle

    if front_end == "sb3":
        pytest.importorskip("stable_baselines3")
        import shmvec.sb3 as front
    else:
        front = shmvec
    envs = front.ShmVecEnv([FaultEnv] * 2, num_workers=1, **FORK)
    closing(envs)
    envs.reset()
    for dump in (pickle.dumps, cloudpickle.dumps, copy.deepcopy, copy.copy):
        with pytest.raises(TypeError, match=r"cannot be pickled or copied: its worker processes"):
            dump(envs)
    envs.step(np.zeros(2, dtype=np.int64))
