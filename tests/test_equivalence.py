"""Same seeds and actions give exactly what SyncVectorEnv gives: observations,
rewards, flags and infos, dtypes included, across spaces, autoreset modes,
worker layouts and start methods. Runs under Gymnasium 1.x and 0.29 (against
the installed one's SyncVectorEnv; 0.29 has one autoreset behaviour)."""

from __future__ import annotations

import copy
import functools

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import SyncVectorEnv
from helpers import MODES, SAME_STEP, assert_same, mode_id, needs_autoreset_modes, run_lockstep, sync_pair

import shmvec
from shmvec._gym_compat import AUTORESET_MODES, GYMNASIUM_1, AutoresetMode
from shmvec.testing import SpacesEnv


SPACES = {
    "dict": (
        spaces.Dict({"pos": spaces.Box(-1, 1, (3,), np.float32), "id": spaces.Discrete(5)}),
        spaces.Dict({"move": spaces.Box(-1, 1, (2,), np.float32), "pick": spaces.Discrete(3)}),
    ),
    "tuple_multidiscrete_image": (
        spaces.Tuple((spaces.MultiDiscrete([3, 4]), spaces.Box(0, 255, (8, 8, 3), np.uint8))),
        spaces.MultiDiscrete([2, 5]),
    ),
    "float16_bool": (
        spaces.Tuple((spaces.Box(-2, 2, (4,), np.float16), spaces.Box(0, 1, (3,), np.bool_))),
        spaces.MultiBinary(4),
    ),
    "ints": (
        spaces.Box(-100, 100, (2, 2), np.int16),
        spaces.Box(0, 10, (3,), np.uint32),
    ),
    "nested": (
        spaces.Dict({"a": spaces.Tuple((spaces.Discrete(2), spaces.Dict({"b": spaces.Box(0, 1, (2,), np.float64)}))),
                     "c": spaces.MultiBinary((2, 2))}),
        spaces.Tuple((spaces.Discrete(4, start=-2), spaces.Box(-1, 1, (), np.float32))),
    ),
    "text_sequence": (
        spaces.Dict({"text": spaces.Text(6), "seq": spaces.Sequence(spaces.Discrete(3)),
                     "x": spaces.Box(-1, 1, (2,), np.float32)}),
        spaces.Text(4),
    ),
    "graph": (
        spaces.Graph(node_space=spaces.Box(0, 1, (2,), np.float32), edge_space=spaces.Discrete(3)),
        spaces.Discrete(2),
    ),
}


def spaces_env(name: str, **kwargs):
    obs, act = SPACES[name]
    return functools.partial(SpacesEnv, obs, act, **kwargs)


def pair(make, num_envs, mode=None, **kwargs):
    return sync_pair([make] * num_envs, mode, **kwargs)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_classic_control(env_id, mode, closing):
    envs, ref = pair(lambda: gym.make(env_id), 6, mode, num_workers=2, start_method="fork")
    closing(envs), closing(ref)
    run_lockstep(envs, ref, steps=300)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("space", sorted(SPACES))
def test_spaces(space, mode, closing):
    envs, ref = pair(spaces_env(space), 5, mode, num_workers=1, start_method="fork")
    closing(envs), closing(ref)
    run_lockstep(envs, ref, steps=120)


@pytest.mark.parametrize(
    "num_workers, caller_steps, num_envs",
    [(1, False, 4), (2, False, 5), (3, False, 7), (0, True, 3), (1, True, 5), (2, True, 8)],
)
def test_worker_layouts(num_workers, caller_steps, num_envs, closing):
    envs, ref = pair(spaces_env("dict"), num_envs, SAME_STEP,
                     num_workers=num_workers, caller_steps=caller_steps, start_method="fork")
    closing(envs), closing(ref)
    assert envs.num_workers == num_workers
    run_lockstep(envs, ref, steps=150)


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_start_methods(start_method, closing):
    envs, ref = pair(spaces_env("nested"), 4, num_workers=2,
                     caller_steps=False, start_method=start_method)
    closing(envs), closing(ref)
    run_lockstep(envs, ref, steps=100)


def test_many_steps_cartpole_default_options(closing):
    envs, ref = pair(lambda: gym.make("CartPole-v1"), 16, start_method="fork")
    closing(envs), closing(ref)
    run_lockstep(envs, ref, steps=1000, reset_seed=list(range(100, 116)))


def test_reset_seeds_and_options(closing):
    envs, ref = pair(spaces_env("dict"), 4, num_workers=1, start_method="fork")
    closing(envs), closing(ref)
    for kwargs in [dict(seed=3), dict(seed=[1, None, 5, 7]), dict(seed=9, options={"start": 2.5}), {}]:
        # Unseeded envs go on with the RNG an earlier seed gave them, so all compare.
        assert_same(envs.reset(**kwargs), ref.reset(**kwargs), str(kwargs))


class ResetKeywordsEnv(gym.Env):
    """Records the keywords of each reset() call (not made through
    gym.make, whose wrappers pass both); episodes of 2 steps."""

    observation_space = spaces.Box(-1, 1, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self):
        self.calls = []
        self.t = 0

    def reset(self, **kwargs):
        self.calls.append(sorted(k for k in kwargs if kwargs[k] is not None) + [f"{k}=None" for k in sorted(kwargs)
                                                                                if kwargs[k] is None])
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(1, np.float32), 0.0, self.t == 2, False, {}


@pytest.mark.parametrize("mode", [m for m in MODES if m is not AutoresetMode.DISABLED], ids=mode_id)
@pytest.mark.parametrize("num_workers, caller_steps", [(0, True), (1, False)])
def test_reset_gets_the_keywords_sync_gives(mode, num_workers, caller_steps, closing):
    """An env's reset() gets what SyncVectorEnv passes it: Gymnasium 1.x
    passes seed and options always, 0.29 each only when not None (so a
    `reset(self, seed=None)` works there); an autoreset passes none."""
    envs, ref = sync_pair([ResetKeywordsEnv] * 2, mode, num_workers=num_workers, caller_steps=caller_steps,
                          start_method="fork")
    closing(envs), closing(ref)
    for kwargs in [{}, dict(seed=1), dict(options={"a": 1}), dict(seed=2, options={})]:
        assert_same(envs.reset(**kwargs), ref.reset(**kwargs), str(kwargs))
        for t in range(3):  # an episode's end, and its autoreset
            assert_same(envs.step(np.zeros(2, np.int64)), ref.step(np.zeros(2, np.int64)), f"step {t}")
    assert envs.get_attr("calls") == ref.get_attr("calls")


@needs_autoreset_modes("options['reset_mask']")
def test_reset_masks(closing):
    envs, ref = pair(spaces_env("dict"), 4, num_workers=1, start_method="fork")
    closing(envs), closing(ref)
    envs.reset(seed=0), ref.reset(seed=0)
    ref.action_space.seed(1)
    for t in range(30):
        actions = ref.action_space.sample()
        assert_same(envs.step(actions), ref.step(actions), f"step {t}")
        if t % 7 == 3:  # partial reset mid-episode, also of envs waiting to autoreset
            mask = np.array([True, False, t % 2 == 1, False])
            opts = {"reset_mask": mask, "start": 1.0}
            assert_same(envs.reset(seed=[t, None, t + 1, None], options=opts),
                        ref.reset(seed=[t, None, t + 1, None], options=dict(opts)))
            # Where SyncVectorEnv pops the mask from the caller's dict, shmvec leaves it
            # (see test_vector_wrappers.py's test_episode_statistics_survive_partial_resets).
            assert opts.keys() == {"reset_mask", "start"}


def test_call_get_set_attr_and_render(closing):
    make = functools.partial(SpacesEnv, render_mode="rgb_array", max_steps=7)
    envs, ref = pair(make, 5, num_workers=2, start_method="fork")
    closing(envs), closing(ref)
    envs.reset(seed=1), ref.reset(seed=1)
    assert_same(envs.get_attr("max_steps"), ref.get_attr("max_steps"))
    envs.set_attr("max_steps", [3, 4, 5, 6, 7]), ref.set_attr("max_steps", [3, 4, 5, 6, 7])
    assert envs.get_attr("max_steps") == (3, 4, 5, 6, 7)
    envs.set_attr("terminate_prob", 0.0), ref.set_attr("terminate_prob", 0.0)
    assert_same(envs.call("_info", 1), ref.call("_info", 1))
    assert_same(envs.render(), ref.call("render"))  # 0.29's SyncVectorEnv has no render()
    if GYMNASIUM_1:  # 0.29's envs have no np_random_seed
        assert envs.np_random_seed == ref.np_random_seed
    run_lockstep(envs, ref, steps=20, reset_seed=4)


def test_copy_false_returns_views(closing):
    envs, ref = pair(lambda: gym.make("CartPole-v1"), 4, num_workers=1, copy=False, start_method="fork")
    closing(envs), closing(ref)
    first, _ = envs.reset(seed=0)
    ref.reset(seed=0)
    second = envs.step(np.zeros(4, dtype=np.int64))[0]
    assert second is first  # the same view, overwritten in place
    assert_same(second.copy(), ref.step(np.zeros(4, dtype=np.int64))[0])


class ActionKeeper(gym.Env):
    """Keeps every action it is given, as an env that stores its last
    action (or a replay of them) does."""

    observation_space = spaces.Box(-1, 1, (2,), np.float32)
    action_space = spaces.Box(-1, 1, (3,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.kept = []
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.kept.append(action)
        return np.zeros(2, np.float32), 0.0, False, False, {}


@pytest.mark.parametrize("num_workers", [0, 1])
def test_each_env_keeps_an_action_of_its_own(num_workers, closing):
    """An action row of the arena is overwritten by the next step: every
    env gets a copy of its own, as SyncVectorEnv's iteration over the batch
    gives it an array that later batches do not touch."""
    envs, ref = pair(ActionKeeper, 4, num_workers=num_workers, caller_steps=True, start_method="fork")
    closing(envs), closing(ref)
    envs.reset(seed=0), ref.reset(seed=0)
    batches = [np.random.default_rng(k).uniform(-1, 1, (4, 3)).astype(dtype)
               for k, dtype in enumerate([np.float32, np.float32, np.float64])]
    for actions in batches:
        envs.step(actions), ref.step(actions)
    assert_same(envs.get_attr("kept"), ref.get_attr("kept"))  # a view of the row would hold the last batch
    kept_by_caller = envs._engine._caller.envs[0].kept  # (a worker's come pickled: their own anyway)
    assert all(action.flags.owndata and action.flags.writeable for action in kept_by_caller)


def test_attributes_match_sync(closing):
    envs, ref = pair(lambda: gym.make("CartPole-v1"), 3, SAME_STEP, num_workers=1, start_method="fork")
    closing(envs), closing(ref)
    assert envs.num_envs == ref.num_envs
    assert envs.single_observation_space == ref.single_observation_space
    assert envs.single_action_space == ref.single_action_space
    assert envs.observation_space == ref.observation_space
    assert envs.action_space == ref.action_space
    assert envs.metadata == ref.metadata
    if AUTORESET_MODES:
        assert envs.metadata["autoreset_mode"] is AutoresetMode.SAME_STEP
    if not GYMNASIUM_1:
        assert envs.is_vector_env is ref.is_vector_env is True
    assert envs.render_mode == ref.render_mode
    envs.spec = ref.spec = gym.spec("CartPole-v1")
    assert repr(envs) == repr(ref).replace("SyncVectorEnv", "ShmVecEnv")
    assert "CartPole-v1" in repr(envs)
    envs.single_observation_space = spaces.Box(-5, 5, (4,), np.float32)  # CleanRL scripts do this
    assert envs.single_observation_space.high[0] == 5


@needs_autoreset_modes("autoreset_mode")
def test_autoreset_mode_strings():
    for value in ["NextStep", "SameStep", "Disabled", "same_step"]:
        envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")], num_workers=0)
        envs.close()
        envs = shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")], num_workers=0, autoreset_mode=value)
        assert isinstance(envs.metadata["autoreset_mode"], AutoresetMode)
        envs.close()
    with pytest.raises(ValueError, match="autoreset_mode"):
        shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")], num_workers=0, autoreset_mode="Sometimes")


def test_make_mirrors_make_vec(closing):
    envs = shmvec.make("CartPole-v1", num_envs=3, max_episode_steps=5,
                       vector_kwargs={"num_workers": 1, "start_method": "fork"})
    closing(envs)
    if GYMNASIUM_1:
        ref = gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync", max_episode_steps=5)
    else:  # 0.29's gym.vector.make warns that it is deprecated
        ref = SyncVectorEnv([functools.partial(gym.make, "CartPole-v1", max_episode_steps=5)] * 3)
    closing(ref)
    assert envs.spec.id == "CartPole-v1"
    run_lockstep(envs, ref, steps=20)
    wrapped = shmvec.make("Pendulum-v1", num_envs=2, g=1.62, wrappers=[gym.wrappers.ClipAction],
                          vector_kwargs={"num_workers": 0})
    closing(wrapped)
    assert wrapped.get_attr("g") == (1.62, 1.62)
    with pytest.raises(gym.error.Error):
        shmvec.make("NoSuchEnv-v0", num_envs=2)
    # An EnvSpec too, as gym.make and make_vec take one
    from_spec = shmvec.make(gym.spec("CartPole-v1"), num_envs=3, max_episode_steps=5,
                            vector_kwargs={"num_workers": 1, "start_method": "fork"})
    closing(from_spec)
    assert from_spec.spec.id == "CartPole-v1"
    run_lockstep(from_spec, ref, steps=20)


def test_make_takes_make_vec_arguments(closing):
    """make_vec's own signature: the mode third (any mode that makes the
    envs one by one steps them in shmvec), the spec's make-level kwargs
    (max_episode_steps, num_envs, ...) routed as make_vec routes them, its
    forms of ids, and a vector spec that rebuilds the same envs."""
    fork = {"num_workers": 1, "start_method": "fork"}
    closing(shmvec.make("CartPole-v1", 2, "sync", fork))
    for mode in ["async", "sync", None] + ([gym.VectorizeMode.ASYNC] if GYMNASIUM_1 else []):
        envs = shmvec.make("CartPole-v1", 2, vectorization_mode=mode, vector_kwargs={"num_workers": 0})
        closing(envs)
        assert isinstance(envs, shmvec.ShmVecEnv) and envs.num_envs == 2
    with pytest.raises(ValueError, match="gymnasium.make_vec"):
        shmvec.make("CartPole-v1", 2, "vector_entry_point" if GYMNASIUM_1 else "custom")
    with pytest.raises(ValueError, match="Invalid vectorization mode"):
        shmvec.make("CartPole-v1", 2, "threads")

    # The vector spec records what made the envs; made again from it, the same envs.
    envs = shmvec.make("Pendulum-v1", 3, "async", {"num_workers": 0}, [gym.wrappers.ClipAction],
                       g=2.0, max_episode_steps=4)
    closing(envs)
    assert envs.spec.kwargs == {"g": 2.0, "max_episode_steps": 4, "num_envs": 3, "vectorization_mode": "async",
                                "vector_kwargs": {"num_workers": 0}, "wrappers": [gym.wrappers.ClipAction]}
    if GYMNASIUM_1:
        ref_spec = gym.make_vec("Pendulum-v1", 3, "sync", wrappers=[gym.wrappers.ClipAction], g=2.0,
                                max_episode_steps=4).spec
        assert {**ref_spec.kwargs, "vectorization_mode": "async", "vector_kwargs": {"num_workers": 0}} \
            == envs.spec.kwargs
    again = shmvec.make(envs.spec)
    closing(again)
    assert again.num_envs == 3 and again.get_attr("g") == (2.0,) * 3
    ref = SyncVectorEnv([lambda: gym.wrappers.ClipAction(gym.make("Pendulum-v1", g=2.0, max_episode_steps=4))] * 3)
    closing(ref)
    run_lockstep(again, ref, steps=10)  # truncated at 4 steps, as recorded
    assert again.spec.kwargs == envs.spec.kwargs

    # make-level keys and num_envs in a registered spec's kwargs, as make_vec takes them
    gym.register(id="KwargsCartPole-v0", entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
                 kwargs={"max_episode_steps": 3, "disable_env_checker": True, "num_envs": 2})
    try:
        envs = shmvec.make("KwargsCartPole-v0", vector_kwargs={"num_workers": 0})
        closing(envs)
        ref = SyncVectorEnv([lambda: gym.make("CartPole-v1", max_episode_steps=3)] * 2)
        closing(ref)
        assert envs.num_envs == 2
        run_lockstep(envs, ref, steps=8)
    finally:
        del gym.registry["KwargsCartPole-v0"]

    # make_vec's forms of ids: a module to import first, and an id without its version
    envs = shmvec.make("gymnasium.envs.classic_control:CartPole-v1", 2, vector_kwargs={"num_workers": 0})
    closing(envs)
    assert envs.spec.id == "CartPole-v1"
    with pytest.warns(UserWarning, match="latest version"):  # make_vec's warning, for the latest version it picks
        envs = shmvec.make("CartPole", 2, vector_kwargs={"num_workers": 0})
    closing(envs)
    assert envs.spec.id == "CartPole-v1"
    with pytest.raises(gym.error.Error, match="Invalid id type"):
        shmvec.make(3, 2)

    # make_vec's parameter names, as keywords: its first is `id`, so an env's
    # own `env_id` keyword reaches the env
    envs = shmvec.make(id="CartPole-v1", num_envs=2, vector_kwargs={"num_workers": 0})
    closing(envs)
    assert envs.spec.id == "CartPole-v1" and envs.num_envs == 2
    gym.register(id="EnvIdKwarg-v0", entry_point=EnvIdKwargEnv)
    try:
        envs = shmvec.make("EnvIdKwarg-v0", num_envs=2, env_id="mine", vector_kwargs={"num_workers": 0})
        closing(envs)
        assert envs.get_attr("env_id") == ("mine", "mine")
    finally:
        del gym.registry["EnvIdKwarg-v0"]


class EnvIdKwargEnv(gym.Env):
    """An env whose constructor takes an `env_id` keyword."""

    observation_space = spaces.Discrete(2)
    action_space = spaces.Discrete(2)

    def __init__(self, env_id=""):
        self.env_id = env_id

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        return 0, 0.0, False, False, {}


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_make_reaches_ids_registered_at_run_time(start_method, closing):
    """An id registered in the running program (e.g. inside the main
    guard), which workers that import the program afresh never see:
    make() hands them the spec, as gymnasium.make_vec does."""
    gym.register(id="RunTimeCartPole-v0", entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv",
                 max_episode_steps=7)
    try:
        envs = shmvec.make("RunTimeCartPole-v0", num_envs=2,
                           vector_kwargs={"num_workers": 1, "caller_steps": False, "start_method": start_method})
        closing(envs)
        ref = SyncVectorEnv([lambda: gym.make("RunTimeCartPole-v0")] * 2)
        closing(ref)
        run_lockstep(envs, ref, steps=10)  # truncated at 7 steps, as registered
    finally:
        del gym.registry["RunTimeCartPole-v0"]


class HeldBufferEnv(gym.Env):
    """Returns its one internal array every step, changed in place: a
    vector env that hands it out without a copy lets a held observation
    change, and the caller's edits reach the env."""

    observation_space = spaces.Sequence(spaces.Box(-100, 100, (2,), np.float32), stack=True)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.buf = np.zeros((3, 2), np.float32)
        return self.buf, {}

    def step(self, action):
        self.buf += 1
        return self.buf, 0.0, False, False, {}


@pytest.mark.parametrize("num_workers, caller_steps", [(0, None), (1, True), (2, False)])
def test_observations_without_a_fixed_shape_are_copies(num_workers, caller_steps, closing):
    """As SyncVectorEnv (copy=True) deep-copies them: an observation held
    across steps keeps its value, and editing it does not reach the env."""
    envs, ref = pair(HeldBufferEnv, 2, num_workers=num_workers, caller_steps=caller_steps, start_method="fork")
    closing(envs), closing(ref)
    actions = np.zeros(2, dtype=np.int64)
    for vec in (envs, ref):
        held, _ = vec.reset(seed=0)
        stepped = vec.step(actions)[0]
        for obs in stepped:
            obs[...] = -50  # the caller's edit
        vec.results = held, stepped, vec.step(actions)[0]
    assert_same(envs.results, ref.results)
    assert envs.results[0][0][0].tolist() == [0.0, 0.0]


@needs_autoreset_modes("reset_mask")
def test_masked_reset_hands_out_copies_of_the_kept_observations(closing):
    envs, ref = pair(HeldBufferEnv, 2, AutoresetMode.DISABLED, num_workers=2, caller_steps=False,
                     start_method="fork")
    closing(envs), closing(ref)
    for vec in (envs, ref):
        vec.reset(seed=0)
        stepped = vec.step(np.zeros(2, dtype=np.int64))[0]
        kept, _ = vec.reset(options={"reset_mask": np.array([True, False])})
        assert kept[1] is not stepped[1]
        stepped[1][...] = -7
        vec.results = kept
    assert_same(envs.results, ref.results)


class Vec3(spaces.Space):
    """A custom space for which the caller registered Gymnasium's batching
    functions: its batch is one array."""

    def __init__(self, seed=None):
        super().__init__((3,), np.float32, seed)

    def sample(self, mask=None, probability=None):
        return self.np_random.random(3).astype(np.float32)

    def contains(self, x):
        return isinstance(x, np.ndarray) and x.shape == (3,)

    def __eq__(self, other):
        return isinstance(other, Vec3)


@gym.vector.utils.batch_space.register(Vec3)
def _batch_vec3(space, n=1):
    return spaces.Box(0, 1, (n, 3), np.float32)


@gym.vector.utils.create_empty_array.register(Vec3)
def _empty_vec3(space, n=1, fn=np.zeros):
    return fn((n, 3), dtype=np.float32)


@gym.vector.utils.concatenate.register(Vec3)
def _concatenate_vec3(space, items, out):
    return np.stack(items, axis=0, out=out)


class Vec3Env(gym.Env):
    observation_space = spaces.Dict({"v": Vec3(), "n": spaces.Discrete(4)})
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return {"v": np.full(3, 0.1, np.float32), "n": 0}, {}

    def step(self, action):
        self.t += 1
        return {"v": np.full(3, self.t / 10, np.float32), "n": self.t % 4}, 1.0, self.t % 3 == 0, False, {}


@pytest.mark.parametrize("copy_obs", [True, False])
@pytest.mark.parametrize("num_workers, caller_steps", [(0, None), (1, True)])
def test_custom_space_batched_by_its_registered_functions(num_workers, caller_steps, copy_obs, closing):
    envs = shmvec.ShmVecEnv([Vec3Env] * 3, num_workers=num_workers, caller_steps=caller_steps, copy=copy_obs,
                            start_method="fork")
    ref = SyncVectorEnv([Vec3Env] * 3, copy=copy_obs)
    closing(envs), closing(ref)
    run_lockstep(envs, ref, steps=8)
    assert envs.observation_space == ref.observation_space
    obs = envs.step(np.zeros(3, dtype=np.int64))[0]
    assert isinstance(obs["v"], np.ndarray) and envs.observation_space.contains(obs)
    if not copy_obs:  # as SyncVectorEnv: the same batch, refilled every step
        assert envs.step(np.zeros(3, dtype=np.int64))[0]["v"] is obs["v"]


def _env_with_a_local_info_class():
    class Payload:  # pickle cannot name it (a script's __main__ class under forkserver is the same case)
        def __init__(self, t):
            self.t = t

        def __eq__(self, other):
            return type(other) is Payload and other.t == self.t

    class PayloadEnv(gym.Env):
        observation_space = spaces.Box(-1, 1, (1,), np.float32)
        action_space = spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return np.zeros(1, np.float32), {"payload": Payload(0)}

        def step(self, action):
            self.t += 1
            return np.zeros(1, np.float32), 1.0, self.t % 3 == 0, False, {"payload": Payload(self.t)}

    return PayloadEnv, Payload


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_infos_of_classes_that_pickle_cannot_name(start_method, closing):
    """Infos travel back from workers by pickle, and by cloudpickle where
    pickle cannot name a class; the caller gets instances of its own class."""
    env_cls, payload_cls = _env_with_a_local_info_class()
    envs, ref = pair(env_cls, 2, num_workers=2, caller_steps=False, start_method=start_method)
    closing(envs), closing(ref)
    run_lockstep(envs, ref, steps=6)
    infos = envs.step(np.zeros(2, dtype=np.int64))[-1]
    assert type(infos["payload"][0]) is payload_cls


class ReusedInfoArrayEnv(gym.Env):
    """Its infos hold arrays it keeps and overwrites in place at reset: what
    the vector env returns must not depend on when it batches them."""

    observation_space = spaces.Box(-100, 100, (2,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self):
        self.buf, self.inner, self.t = np.zeros(2, np.float32), np.zeros(3, np.int64), 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.buf[:], self.inner[:], self.t = -1, -2, 0
        return np.zeros(2, np.float32), {"buf": self.buf}

    def step(self, action):
        self.t += 1
        self.buf[:], self.inner[:] = self.t, 10 * self.t
        info = {"buf": self.buf, "nested": {"inner": self.inner}, "t": self.t}
        return np.full(2, self.t, np.float32), 1.0, self.t == 3, False, info


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("num_workers, caller_steps", [(0, True), (1, True), (2, False)])
def test_info_arrays_an_env_overwrites_at_reset(mode, num_workers, caller_steps, closing):
    """Gymnasium 1.1+'s SAME_STEP batches an ended episode's info before the
    env's reset, copying its arrays; 0.29's keeps the info itself, after."""
    envs, ref = pair(ReusedInfoArrayEnv, 4, mode, num_workers=num_workers, caller_steps=caller_steps,
                     start_method="fork")
    closing(envs), closing(ref)
    run_lockstep(envs, ref, steps=10)


class ActionTypeEnv(gym.Env):
    """Reports the type and dtype of each action it is handed, and the
    action itself as its observation."""

    def __init__(self, action_space):
        self.action_space = copy.deepcopy(action_space)
        self.observation_space = action_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.action_space.seed(seed)
        return self.action_space.sample(), {}

    def step(self, action):
        seen = _seen_types(action)
        return action, 0.0, False, False, {"seen": repr(seen)}


def _seen_types(action):
    """(type, dtype) of an action, recursively through dicts and tuples."""
    if isinstance(action, dict):
        return {k: _seen_types(v) for k, v in action.items()}
    if isinstance(action, tuple):
        return tuple(_seen_types(v) for v in action)
    if isinstance(action, list):  # (a list of Python scalars per env: their types too)
        return ["builtins.list", *map(_seen_types, action)]
    kind = type(action)  # numpy's bool is named "bool" too: the module tells them apart
    return f"{kind.__module__}.{kind.__qualname__}", str(np.asarray(action).dtype)


F32 = np.float32
ACTION_DTYPE_CASES = {
    "box0": (spaces.Box(0, 1, (), F32), [np.float64, np.float32, np.float16, np.float64]),
    "box2": (spaces.Box(0, 1, (2,), F32), [np.float64, np.float32, np.float64, np.float16]),
    "discrete": (spaces.Discrete(3), [np.int32, np.int64, np.int8, np.uint8, np.int32]),
    "multibinary": (spaces.MultiBinary(3), [np.bool_, np.int8, np.int64]),
    "dict": (spaces.Dict({"a": spaces.Box(0, 1, (), F32), "b": spaces.Discrete(3),
                          "c": spaces.Box(0, 1, (2,), F32)}),
             [(np.float64, np.int32, np.float64), (np.float32, np.int64, np.float32),
              (np.float16, np.int16, np.float64)]),
}


def _batch_of(space, dtypes, n, rng):
    if isinstance(space, spaces.Dict):
        return {key: _batch_of(sub, (d,), n, rng) for (key, sub), d in zip(space.spaces.items(), dtypes)}
    shape = (n, *space.shape)
    if isinstance(space, spaces.Discrete):
        return rng.integers(0, space.n, size=shape).astype(dtypes[0])
    if isinstance(space, spaces.MultiBinary):
        return rng.integers(0, 2, size=shape).astype(dtypes[0])
    return rng.random(shape).astype(dtypes[0])


def _action_type_pair(space, num_workers, caller_steps, closing):
    """A ShmVecEnv and a SyncVectorEnv of 4 ActionTypeEnvs, reset alike."""
    envs, ref = pair(functools.partial(ActionTypeEnv, space), 4, num_workers=num_workers,
                     caller_steps=caller_steps, start_method="fork")
    closing(envs), closing(ref)
    assert_same(envs.reset(seed=0), ref.reset(seed=0), "reset")
    return envs, ref


@pytest.mark.parametrize("num_workers, caller_steps", [(1, True), (2, False)])
@pytest.mark.parametrize("case", sorted(ACTION_DTYPE_CASES))
def test_env_sees_action_dtype_of_the_batch(case, num_workers, caller_steps, closing):
    """As SyncVectorEnv, each env gets an element of the batch the caller
    passed: a float64 batch for a float32 Box gives np.float64 actions (so
    ``time.sleep(action)`` works), an int32 batch for a Discrete np.int32."""
    space, dtypes = ACTION_DTYPE_CASES[case]
    envs, ref = _action_type_pair(space, num_workers, caller_steps, closing)
    rng = np.random.default_rng(0)
    for t, d in enumerate(dtypes):
        actions = _batch_of(space, d if isinstance(d, tuple) else (d,), 4, rng)
        out, expected = envs.step(actions), ref.step(actions)
        assert_same(out, expected, f"step {t} ({d})")


class BinaryActionEnv(ActionTypeEnv):
    """An ActionTypeEnv over MultiBinary(3) whose observation is its action
    as int8 (a float batch would not stack into the space's int8)."""

    def __init__(self):
        super().__init__(spaces.MultiBinary(3))

    def step(self, action):
        obs, *rest = super().step(action)
        return np.asarray(obs, np.int8), *rest


@pytest.mark.parametrize("num_workers, caller_steps", [(1, True), (2, False)])
def test_multibinary_takes_float_actions_as_sync_does(num_workers, caller_steps, closing):
    """MultiBinary.contains takes 0s and 1s of any number dtype, and SB3's
    PPO and A2C sample its actions as float32: each env gets its row in the
    batch's float dtype, as under SyncVectorEnv."""
    envs, ref = pair(BinaryActionEnv, 4, num_workers=num_workers, caller_steps=caller_steps, start_method="fork")
    closing(envs), closing(ref)
    assert_same(envs.reset(seed=0), ref.reset(seed=0))
    rng = np.random.default_rng(0)
    for t, dtype in enumerate([np.float32, np.float64, np.int8, np.float16]):
        actions = rng.integers(0, 2, size=(4, 3)).astype(dtype)
        assert_same(envs.step(actions), ref.step(actions), f"step {t} ({dtype.__name__})")


class IntegerBoxActionEnv(ActionTypeEnv):
    """An ActionTypeEnv over an int16 Box whose observation is its action
    rounded, as an env over such a space would take a policy's floats."""

    def __init__(self):
        super().__init__(spaces.Box(0, 100, (2,), np.int16))

    def step(self, action):
        obs, *rest = super().step(action)
        return np.rint(obs).astype(np.int16), *rest


@pytest.mark.parametrize("num_workers, caller_steps", [(1, True), (2, False)])
def test_integer_box_takes_actions_of_any_number_dtype_as_sync_does(num_workers, caller_steps, closing):
    """A policy samples any Box's actions as floats (SB3's PPO, SAC and A2C,
    an integer Box's too), and SyncVectorEnv hands each env its row as it
    is: so does shmvec, in the batch's dtype (they were refused)."""
    envs, ref = pair(IntegerBoxActionEnv, 4, num_workers=num_workers, caller_steps=caller_steps,
                     start_method="fork")
    closing(envs), closing(ref)
    assert_same(envs.reset(seed=0), ref.reset(seed=0))
    rng = np.random.default_rng(0)
    for t, dtype in enumerate([np.float32, np.float64, np.int64, np.uint8, np.bool_, np.float16]):
        actions = (rng.random((4, 2)) * 100).astype(dtype)
        assert_same(envs.step(actions), ref.step(actions), f"step {t} ({dtype.__name__})")


@pytest.mark.parametrize("env_fn, inexact, exact", [
    (BinaryActionEnv, np.full((2, 3), 0.5, np.float32), np.ones((2, 3), np.float32)),
    (IntegerBoxActionEnv, np.full((2, 2), 2.5), np.full((2, 2), 3.0)),
    (IntegerBoxActionEnv, np.full((2, 2), 2**20, np.int64), np.full((2, 2), 7, np.int64)),
], ids=["multibinary floats", "integer box floats", "integer box int64"])
def test_async_mode_casts_actions_of_another_kind_only_exactly(env_fn, inexact, exact, closing):
    """send() stores actions in the space's dtype: 0.0 and 1.0 cast exactly;
    a 0.5 (or 2.5 for an int16 Box, or 2**20) would silently become another
    number, so it is refused, and nothing is sent."""
    envs = shmvec.ShmVecEnv([env_fn] * 4, batch_size=2, num_workers=2, start_method="fork")
    closing(envs)
    envs.async_reset(seed=0)
    obs, *_, infos = envs.recv()
    with pytest.raises(ValueError, match="cannot store exactly"):
        envs.send(inexact, infos["env_id"])
    envs.send(exact, infos["env_id"])
    obs, *_, infos = envs.recv()
    dtype = envs.single_action_space.dtype
    assert obs.dtype == dtype
    seen = [s for s, ok in zip(infos.get("seen", []), infos.get("_seen", [])) if ok]
    assert seen == [repr(("numpy.ndarray", str(dtype)))] * len(seen)


LIST_ACTION_CASES = {
    "discrete-list": (spaces.Discrete(3), lambda n: [k % 3 for k in range(n)]),
    "discrete-tuple": (spaces.Discrete(3), lambda n: tuple((k + 1) % 3 for k in range(n))),
    "discrete-bools": (spaces.Discrete(2), lambda n: [k % 2 == 0 for k in range(n)]),
    "box0-floats": (spaces.Box(0, 1, (), F32), lambda n: [k / n for k in range(n)]),
    # One list per env: each env gets its list (Python scalars inside).
    "box2-lists": (spaces.Box(0, 1, (2,), F32), lambda n: [[k / n, 0.1] for k in range(n)]),
    "box22-lists": (spaces.Box(0, 1, (2, 2), F32), lambda n: [[[k / n, 0.1], [0.2, 0.3]] for k in range(n)]),
    "multidiscrete-tuple-of-lists": (spaces.MultiDiscrete([3, 3]), lambda n: tuple([k % 3, 1] for k in range(n))),
    "multibinary-lists": (spaces.MultiBinary(2), lambda n: [[k % 2 == 0, True] for k in range(n)]),
    "dict-leaf-list": (spaces.Dict({"a": spaces.Box(0, 1, (2,), F32), "b": spaces.Discrete(3)}),
                       lambda n: {"a": np.full((n, 2), 0.5, F32), "b": [k % 3 for k in range(n)]}),
    "dict-leaf-lists": (spaces.Dict({"a": spaces.Box(0, 1, (2,), F32), "b": spaces.Discrete(3)}),
                        lambda n: {"a": [[0.5, k / n] for k in range(n)], "b": np.arange(n) % 3}),
    # Other items: each env gets the list's item, as SyncVectorEnv hands it on.
    # Numpy items of one dtype come back from an array of them; tuples, Python
    # numbers of mixed types, 0-d arrays, numpy items of several dtypes do not.
    "discrete-numpy-items": (spaces.Discrete(3), lambda n: [np.int64(k % 3) for k in range(n)]),
    "discrete-mixed-bools-and-ints": (spaces.Discrete(2),
                                      lambda n: [k % 2 == 0 if k % 3 else k % 2 for k in range(n)]),
    "box0-mixed-ints-and-floats": (spaces.Box(0, 1, (), F32),
                                   lambda n: [k % 2 if k % 3 else k / n for k in range(n)]),
    "box2-tuples": (spaces.Box(0, 1, (2,), F32), lambda n: [(k / n, 0.1) for k in range(n)]),
    "box2-lists-of-mixed": (spaces.Box(0, 1, (2,), F32), lambda n: [[k % 2, 0.5] for k in range(n)]),
    "box2-arrays": (spaces.Box(0, 1, (2,), F32), lambda n: [np.full(2, k / n, np.float64) for k in range(n)]),
    "box0-zero-dim-arrays": (spaces.Box(0, 1, (), F32), lambda n: [np.array(k / n, F32) for k in range(n)]),
    "discrete-numpy-items-of-two-dtypes": (spaces.Discrete(3), lambda n: [np.int64(k % 3) if k % 2 else np.int8(1)
                                                                        for k in range(n)]),
    "multidiscrete-tuples": (spaces.MultiDiscrete([3, 3]), lambda n: [(k % 3, 1) for k in range(n)]),
    "dict-leaf-tuples": (spaces.Dict({"a": spaces.Box(0, 1, (2,), F32), "b": spaces.Discrete(3)}),
                         lambda n: {"a": [(0.5, k / n) for k in range(n)], "b": [k % 3 for k in range(n)]}),
}


@pytest.mark.parametrize("num_workers, caller_steps", [(1, True), (2, False)])
@pytest.mark.parametrize("case", sorted(LIST_ACTION_CASES))
def test_env_sees_the_python_scalars_of_a_list_batch(case, num_workers, caller_steps, closing):
    """As SyncVectorEnv, which iterates over the caller's list, each env of a
    list (or tuple) of Python ints, floats or bools gets a Python int, float
    or bool, not a numpy scalar (an env may json.dumps its action); of a list
    of lists, its own list; of a list of other items, its item (a tuple, say)."""
    space, batch = LIST_ACTION_CASES[case]
    envs, ref = _action_type_pair(space, num_workers, caller_steps, closing)
    rng = np.random.default_rng(0)
    for t in range(3):  # a list between array batches: the arrays' types come back
        out, expected = envs.step(batch(4)), ref.step(batch(4))
        assert_same(out, expected, f"step {t}: list")
        arrays = _batch_of(space, (np.float32, np.int64) if isinstance(space, spaces.Dict) else (space.dtype,), 4, rng)
        assert_same(envs.step(arrays), ref.step(arrays), f"step {t}: arrays")


def test_async_send_casts_actions_to_the_space_dtype(closing):
    """send() writes some rows while other envs read theirs: it stores the
    batch in the action space's dtype, whatever the caller's dtype."""
    envs = shmvec.ShmVecEnv([functools.partial(ActionTypeEnv, spaces.Box(0, 1, (2,), F32))] * 4,
                            batch_size=2, num_workers=2, start_method="fork")
    closing(envs)
    envs.async_reset(seed=0)
    seen = []
    for t in range(6):
        obs, _, _, _, infos = envs.recv()
        seen += [s for s, ok in zip(infos.get("seen", []), infos.get("_seen", [])) if ok]
        dtype = np.float64 if t % 2 else np.float32
        envs.send(np.full((2, 2), 0.5, dtype), infos["env_id"])
        assert obs.dtype == np.float32
    assert seen and set(seen) == {repr(("numpy.ndarray", "float32"))}


@pytest.mark.slow
# About 1.2 ms a step of both vector envs and the comparison on a 2-vCPU VM
# (this env samples its spaces): 124 s at the suite's 120 s default.
@pytest.mark.timeout(900)
def test_hundred_thousand_steps_lockstep(closing):
    """10^5 steps against SyncVectorEnv, episodes ending and infos flowing."""
    envs, ref = pair(spaces_env("dict"), 4, SAME_STEP, num_workers=1, start_method="fork")
    closing(envs), closing(ref)
    run_lockstep(envs, ref, steps=100_000)
