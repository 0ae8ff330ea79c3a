"""Hypothesis: random nested spaces step exactly as in SyncVectorEnv."""

from __future__ import annotations

import functools

import numpy as np
from gymnasium import spaces
from helpers import MODES, run_lockstep, sync_pair
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmvec
from shmvec.testing import SpacesEnv

DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
          np.uint8, np.uint16, np.uint32, np.uint64, np.bool_]

shapes = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)


@st.composite
def boxes(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(shapes)
    if dtype.kind == "b":
        return spaces.Box(0, 1, shape, dtype)
    if dtype.kind == "f":
        return spaces.Box(-3.0, 3.0, shape, dtype)
    low = 0 if dtype.kind == "u" else -5
    return spaces.Box(low, 9, shape, dtype)


leaf_spaces = st.one_of(
    boxes(),
    st.builds(spaces.Discrete, st.integers(1, 9), start=st.integers(-3, 3)),
    st.builds(spaces.MultiDiscrete, st.lists(st.integers(1, 5), min_size=1, max_size=3)),
    st.builds(spaces.MultiBinary, st.integers(1, 4)),
    st.builds(spaces.Text, st.integers(1, 5)),
)

nested_spaces = st.recursive(
    leaf_spaces,
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3).map(lambda xs: spaces.Tuple(xs)),
        st.dictionaries(st.sampled_from("abcde"), children, min_size=1, max_size=3).map(spaces.Dict),
    ),
    max_leaves=5,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obs_space=nested_spaces, act_space=nested_spaces,
       mode=st.sampled_from(MODES), num_envs=st.integers(2, 4))
def test_random_nested_spaces(obs_space, act_space, mode, num_envs):
    make = functools.partial(SpacesEnv, obs_space, act_space, max_steps=6, terminate_prob=0.2)
    envs, ref = sync_pair([make] * num_envs, mode, num_workers=1, start_method="fork")
    try:
        run_lockstep(envs, ref, steps=15)
    finally:
        envs.close()
        ref.close()
