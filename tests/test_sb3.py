"""``shmvec.sb3.ShmVecEnv`` honours SB3's VecEnv contract exactly as
``DummyVecEnv`` does (and as ``SubprocVecEnv`` where that one agrees): same
seeds and actions give the same observations, rewards, dones and infos,
under SB3's wrappers and algorithms too."""

from __future__ import annotations

import collections
import functools
import json
import pathlib
import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from helpers import assert_same

pytest.importorskip("stable_baselines3")

import torch
from stable_baselines3 import A2C, DQN, PPO, SAC
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import (
    DummyVecEnv,
    SubprocVecEnv,
    VecEnv,
    VecFrameStack,
    VecMonitor,
    VecNormalize,
    VecTransposeImage,
    VecVideoRecorder,
)

from shmvec.sb3 import ShmVecEnv
from shmvec.testing import SpacesEnv

N = 4
SHM = {"num_workers": 1, "start_method": "fork"}

SPACES = {
    "box": (spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(3)),
    "dict": (
        spaces.Dict({"pos": spaces.Box(-1, 1, (3,), np.float32), "id": spaces.Discrete(5)}),
        spaces.Box(-1, 1, (2,), np.float32),
    ),
    "tuple": (
        spaces.Tuple((spaces.Box(0, 255, (4, 4, 3), np.uint8), spaces.MultiBinary(3))),
        spaces.MultiDiscrete([2, 3]),
    ),
    "discrete": (spaces.Discrete(7), spaces.MultiBinary(2)),
}


def spaces_env(name: str = "box", **kwargs):
    obs, act = SPACES[name]
    kwargs.setdefault("max_steps", 8)
    kwargs.setdefault("terminate_prob", 0.1)
    return functools.partial(SpacesEnv, obs, act, **kwargs)


class EnvBoom(Exception):
    """An env's own error type, which must reach the caller as is."""


class ProbeEnv(gym.Env):
    """Reset observation shows the options it got; step info is one dict,
    updated in place; fails on demand."""

    observation_space = spaces.Box(-10, 10, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self):
        self.label = "probe"
        self.fail_on_step = False
        self.info = {"count": {"steps": 0}}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        value = -1.0 if options is None else float(options.get("value", 0.0))
        return np.array([value], dtype=np.float32), {"options": options}

    def step(self, action):
        if self.fail_on_step:
            raise EnvBoom("step failed")
        self.info["count"]["steps"] += 1
        return np.zeros(1, dtype=np.float32), float(action), False, False, self.info

    def scaled(self, factor, offset=0):
        return factor * len(self.label) + offset

    def bump(self):
        self.bumps = getattr(self, "bumps", 0) + 1
        return self.bumps


def make(kind: str, env_fns, **kwargs) -> VecEnv:
    if kind == "dummy":
        return DummyVecEnv(env_fns)
    if kind == "subproc":
        return SubprocVecEnv(env_fns, start_method="fork")
    return ShmVecEnv(env_fns, **{**SHM, **kwargs})


@pytest.fixture
def closing():
    made = []
    yield lambda venv: made.append(venv) or venv
    for venv in made:
        venv.close()


def plain(value):
    """For comparison: OrderedDict (DummyVecEnv's Dict observations) as dict,
    wall-clock times of episode statistics dropped."""
    if isinstance(value, collections.abc.Mapping):
        out = {k: plain(v) for k, v in value.items()}
        if isinstance(out.get("episode"), dict):
            out["episode"].pop("t", None)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


def assert_equal(a, b, where=""):
    assert_same(plain(a), plain(b), where)


def actions_for(space, seed):
    space.seed(seed)
    return lambda: np.stack([space.sample() for _ in range(N)])


def run_lockstep(venv, ref, steps, seed=0):
    """Same seeds and actions into both: every output must be the same."""
    venv.seed(seed), ref.seed(seed)
    assert_equal(venv.reset(), ref.reset(), "reset")
    assert_equal(venv.unwrapped.reset_infos, ref.unwrapped.reset_infos, "reset_infos")
    sample = actions_for(ref.action_space, seed)
    for t in range(steps):
        actions = sample()
        assert_equal(venv.step(actions), ref.step(actions), f"step {t}")
        assert_equal(venv.unwrapped.reset_infos, ref.unwrapped.reset_infos, f"reset_infos at step {t}")


# -- same seeds, same actions: same everything ---------------------------------

@pytest.mark.parametrize("layout", [{"num_workers": 1}, {"num_workers": 2, "caller_steps": False},
                                    {"num_workers": 0}], ids=["caller+1", "2workers", "caller-only"])
@pytest.mark.parametrize("space", list(SPACES))
def test_same_as_dummy(space, layout, closing):
    fns = [spaces_env(space)] * N
    venv, ref = closing(make("shmvec", fns, **layout)), closing(make("dummy", fns))
    run_lockstep(venv, ref, steps=60)


def test_explicit_workers_plan_as_in_the_gymnasium_front_end(monkeypatch, closing):
    # caller_steps left unset is decided by shmvec here too: with the
    # workers on every CPU the caller steps no slice of its own.
    from shmvec._engine import plan

    monkeypatch.setattr(plan, "usable_cpus", lambda: 2)
    fns = [spaces_env("box")] * N
    assert closing(make("shmvec", fns, num_workers=2))._engine.worker_rows == [range(0, 2), range(2, 4)]
    assert closing(make("shmvec", fns, num_workers=1))._engine.worker_rows == [range(2, 4)]


def test_step_outputs_have_dummy_types(closing):
    venv = closing(make("shmvec", [spaces_env("box", terminate_prob=0.3)] * N))
    venv.seed(1)
    obs = venv.reset()
    assert obs.shape == (N, 3) and obs.dtype == np.float32
    ended = 0
    for _ in range(20):
        obs, rewards, dones, infos = venv.step(np.ones(N, dtype=np.int64))
        assert rewards.shape == (N,) and rewards.dtype == np.float32
        assert dones.shape == (N,) and dones.dtype == np.bool_
        assert type(infos) is list and len(infos) == N
        assert len({id(info) for info in infos}) == N
        for done, info in zip(dones, infos):
            assert type(info["TimeLimit.truncated"]) is bool
            assert ("terminal_observation" in info) == done
            ended += int(done)
    assert ended > 0


@pytest.mark.parametrize("space, batches", [
    (spaces.Discrete(3), ([k % 3 for k in range(N)], np.arange(N, dtype=np.int32) % 3)),
    (spaces.Box(0, 1, (2,), np.float32), ([[k / N, 0.5] for k in range(N)], np.full((N, 2), 0.25))),
], ids=["discrete", "box"])
def test_envs_get_the_actions_dummy_hands_them(space, batches, closing):
    # DummyVecEnv hands each env its item of the caller's batch: a Python
    # int (or list) of a list, a numpy scalar (or array) of an array.
    from test_equivalence import ActionTypeEnv

    make_env = functools.partial(ActionTypeEnv, space)
    venv, ref = closing(make("shmvec", [make_env] * N)), closing(make("dummy", [make_env] * N))
    venv.reset(), ref.reset()
    for actions in batches:
        seen = [info["seen"] for info in venv.step(actions)[-1]]
        assert seen == [info["seen"] for info in ref.step(actions)[-1]], repr(actions)


@pytest.mark.parametrize("kind", ["dummy", "shmvec"])
def test_observations_are_fresh_arrays(kind, closing):
    venv = closing(make(kind, [spaces_env("dict", terminate_prob=0.5)] * N))
    venv.reset()
    actions = actions_for(venv.action_space, 0)
    obs, _, _, infos = venv.step(actions())
    kept = {k: v.copy() for k, v in obs.items()}
    terminal = [info.get("terminal_observation") for info in infos]
    kept_terminal = [None if t is None else {k: v.copy() for k, v in t.items()} for t in terminal]
    for _ in range(3):
        new_obs, _, _, _ = venv.step(actions())
        for key in kept:
            assert not np.shares_memory(new_obs[key], obs[key])
    assert_equal(obs, kept)
    assert_equal(terminal, kept_terminal)


@pytest.mark.parametrize("kind", ["dummy", "shmvec"])
def test_infos_are_fresh_dicts(kind, closing):
    venv = closing(make(kind, [ProbeEnv] * N))  # envs that update one info dict in place
    venv.reset()
    history = [venv.step(np.zeros(N, dtype=np.int64))[3] for _ in range(3)]
    assert [[info["count"]["steps"] for info in infos] for infos in history] == [[1] * N, [2] * N, [3] * N]


def test_terminal_observation_of_dict_space_is_a_dict_of_arrays(closing):
    venv = closing(make("shmvec", [spaces_env("dict", terminate_prob=1.0)] * N))
    venv.reset()
    _, _, dones, infos = venv.step(actions_for(venv.action_space, 0)())
    assert dones.all()
    for info in infos:
        terminal = info["terminal_observation"]
        assert set(terminal) == {"pos", "id"}
        assert terminal["pos"].shape == (3,) and terminal["pos"].dtype == np.float32


def test_set_attr_sets_the_outermost_wrapper_as_dummy_does(closing):
    # DummyVecEnv's setattr lands on TimeLimit, not on CartPole: the dynamics
    # must not change, and get_attr must still see the new value.
    fns = [lambda: gym.make("CartPole-v1")] * N
    venv, ref = closing(make("shmvec", fns)), closing(make("dummy", fns))
    for v in (venv, ref):
        v.set_attr("force_mag", 100.0, indices=[0, -1])
    with warnings.catch_warnings():  # SB3 < 2.4 reads it through Gymnasium 0.29's deprecated wrapper getattr
        warnings.simplefilter("ignore", UserWarning)
        expected = ref.get_attr("force_mag")
    assert venv.get_attr("force_mag") == expected == [100.0, 10.0, 10.0, 100.0]
    run_lockstep(venv, ref, steps=100)


# -- seeds and options -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["dummy", "shmvec", "subproc"])
def test_seed_is_used_once(kind, closing):
    venv = closing(make(kind, [spaces_env("box")] * N))
    assert venv.seed(5) == [5, 6, 7, 8]
    first = venv.reset()
    second = venv.reset()
    venv.seed(5)
    again = venv.reset()
    assert np.array_equal(first, again)
    assert not np.array_equal(first, second)
    assert len({tuple(row) for row in first}) == N  # every env its own seed


def bounded_env(k: int, shape=(3,)):
    """A SpacesEnv whose spaces' bounds grow with k."""
    return functools.partial(SpacesEnv, spaces.Box(-1 - k, 1 + k, shape, np.float32),
                             spaces.Box(-1 - k, 1 + k, (2,), np.float32), max_steps=6)


def test_spaces_that_differ_in_bounds_as_dummy_vec_env(closing):
    """DummyVecEnv and SubprocVecEnv take env 0's spaces and check none:
    envs whose spaces differ only in bounds step as there; spaces of other
    shapes or dtypes cannot share the arena and are refused, naming the env."""
    fns = [bounded_env(k) for k in range(N)]
    shm, dummy = closing(make("shmvec", fns)), closing(make("dummy", fns))
    assert shm.observation_space == dummy.observation_space == fns[0]().observation_space
    assert shm.action_space == dummy.action_space == fns[0]().action_space
    shm.seed(1), dummy.seed(1)
    assert_same(shm.reset(), dummy.reset())
    actions = np.full((N, 2), 0.5, np.float32)
    for t in range(8):
        assert_same(shm.step(actions)[:3], dummy.step(actions)[:3], f"step {t}")
    with pytest.raises(RuntimeError, match="env 2"):
        make("shmvec", [bounded_env(0), bounded_env(1), bounded_env(2, shape=(4,)), bounded_env(3)])


@pytest.mark.parametrize("kind", ["dummy", "shmvec", "subproc"])
def test_options_for_more_or_fewer_envs(kind, closing):
    """As SB3's own: a longer list's first options are used; a shorter one
    is an IndexError at reset() (shmvec's before any env is reset)."""
    venv = closing(make(kind, [ProbeEnv] * N))
    venv.set_options([{"value": k} for k in range(N + 2)])
    assert venv.reset()[:, 0].tolist() == [float(k) for k in range(N)]
    venv.set_options([{"value": 7}] * (N - 1))
    with pytest.raises(IndexError):
        venv.reset()
    if kind == "shmvec":
        assert venv.reset_infos == [{"options": {"value": k}} for k in range(N)]  # left as they were


@pytest.mark.parametrize("kind", ["dummy", "shmvec", "subproc"])
def test_options_per_env_are_used_once(kind, closing):
    venv = closing(make(kind, [ProbeEnv] * N))
    venv.set_options([{"value": 1}, {"value": 2}, {}, {"value": 2}])
    assert venv.reset()[:, 0].tolist() == [1.0, 2.0, -1.0, 2.0]
    assert [info["options"] for info in venv.reset_infos] == [{"value": 1}, {"value": 2}, None, {"value": 2}]
    assert venv.reset()[:, 0].tolist() == [-1.0] * N  # forgotten after one reset
    venv.set_options({"value": 3})
    assert venv.reset()[:, 0].tolist() == [3.0] * N


class KeywordsEnv(gym.Env):
    """Records the keywords each reset() got; takes no `options` unless
    `options` is set (an env written for SB3, as SB3's own test envs)."""

    observation_space = spaces.Box(-10, 10, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, takes_options: bool = False):
        self.takes_options = takes_options
        self.calls = []

    def reset(self, **kwargs):
        if "options" in kwargs and not self.takes_options:
            raise TypeError("reset() got an unexpected keyword argument 'options'")
        self.calls.append(sorted(kwargs))
        super().reset(seed=kwargs.get("seed"))
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, bool(action), False, {}


@pytest.mark.parametrize("kind", ["dummy", "shmvec", "subproc"])
@pytest.mark.parametrize("layout", [{"num_workers": 0}, {"num_workers": 1, "caller_steps": False}])
def test_reset_gets_the_keywords_dummy_gives(kind, layout, closing):
    """DummyVecEnv calls reset(seed=...) and adds options= only when
    set_options() set some for that env; an autoreset calls reset()."""
    venv = closing(make(kind, [functools.partial(KeywordsEnv, takes_options=i == 1) for i in range(2)], **layout))
    venv.seed(3)
    venv.reset()
    venv.step(np.array([1, 0]))  # env 0's episode ends: an autoreset
    venv.set_options([{}, {"value": 1}])
    venv.reset()
    assert venv.env_method("__getattribute__", "calls") == [
        [["seed"], [], ["seed"]],
        [["seed"], ["options", "seed"]],
    ]


# -- attributes, methods, wrappers ---------------------------------------------------

@pytest.mark.parametrize("kind", ["dummy", "shmvec", "subproc"])
def test_attributes_and_methods_with_indices(kind, closing):
    venv = closing(make(kind, [ProbeEnv] * N))
    venv.set_attr("label", "abc", indices=1)
    venv.set_attr("label", "abcdef", indices=[-1, 2])
    assert venv.get_attr("label") == ["probe", "abc", "abcdef", "abcdef"]
    assert venv.get_attr("label", indices=[3, 0, -3]) == ["abcdef", "probe", "abc"]
    assert venv.get_attr("label", indices=2) == ["abcdef"]
    assert venv.env_method("scaled", 2, indices=[1, 0]) == [6, 10]
    assert venv.env_method("scaled", 1, offset=1) == [6, 4, 7, 7]
    if kind == "shmvec" or hasattr(venv, "has_attr"):  # SB3's own from 2.4 on
        assert venv.has_attr("scaled") and not venv.has_attr("missing")
    with pytest.raises(IndexError):
        venv.get_attr("label", indices=N)
    # An index given twice calls the env's method twice, in the order given.
    assert venv.env_method("bump", indices=[0, 0, 3, 1, 0, -1]) == [1, 2, 1, 1, 3, 2]
    assert venv.env_method("bump") == [4, 2, 1, 3]


@pytest.mark.parametrize("kind", ["dummy", "shmvec"])  # SubprocVecEnv's worker dies: EOFError
def test_missing_attributes_raise_attribute_error(kind, closing):
    venv = closing(make(kind, [ProbeEnv] * N))
    with pytest.raises(AttributeError, match="missing"):
        venv.get_attr("missing", indices=[-1])
    with pytest.raises(AttributeError, match="missing"):
        venv.env_method("missing")
    assert venv.get_attr("label") == ["probe"] * N  # and the envs still answer


@pytest.mark.parametrize("kind", ["dummy", "shmvec", "subproc"])
def test_env_is_wrapped(kind, closing):
    venv = closing(make_vec_env("CartPole-v1", n_envs=N, vec_env_cls={"dummy": DummyVecEnv, "subproc": SubprocVecEnv,
                                                                      "shmvec": ShmVecEnv}[kind],
                                vec_env_kwargs={"dummy": {}, "subproc": {"start_method": "fork"}, "shmvec": SHM}[kind]))
    assert venv.env_is_wrapped(Monitor) == [True] * N
    assert venv.env_is_wrapped(gym.wrappers.TimeLimit, indices=[-1]) == [True]
    assert venv.env_is_wrapped(gym.wrappers.ClipAction) == [False] * N


@pytest.mark.parametrize("kind", ["dummy", "shmvec"])
def test_render_and_images(kind, closing):
    venv = closing(make(kind, [spaces_env("box", render_mode="rgb_array", terminate_prob=0.0)] * N))
    venv.reset()
    venv.step(np.zeros(N, dtype=np.int64))
    images = venv.get_images()
    assert len(images) == N and all(img.shape == (8, 8, 3) and img[0, 0, 0] == 1 for img in images)
    assert venv.render().shape == (16, 16, 3)
    assert venv.render(mode="rgb_array").shape == (16, 16, 3)
    assert venv.render_mode == "rgb_array" and venv.metadata == SpacesEnv.metadata


@pytest.mark.parametrize("kind", ["dummy", "shmvec"])
def test_render_without_render_mode_warns(kind, closing):
    venv = closing(make(kind, [spaces_env("box")] * N))
    with pytest.warns(UserWarning, match="render_mode"):
        assert venv.render() is None
    with pytest.warns(UserWarning, match="rgb_array"):
        assert venv.get_images() == [None] * N


def test_metadata_comes_from_the_envs_and_there_is_no_spec_as_in_dummy(tmp_path, closing):
    """As DummyVecEnv and SubprocVecEnv, no `spec`: VecMonitor writes the
    env id it finds there into its log's header (its logs differed)."""
    made = {}
    for kind in ("dummy", "shmvec"):
        venv = made[kind] = closing(make(kind, [lambda: gym.make("CartPole-v1")] * 2))
        assert venv.metadata == gym.make("CartPole-v1").metadata
        monitor = VecMonitor(venv, filename=str(tmp_path / kind))
        monitor.close()
    assert hasattr(made["shmvec"], "spec") == hasattr(made["dummy"], "spec")
    ids = [json.loads((tmp_path / f"{kind}.monitor.csv").read_text().splitlines()[0][1:])["env_id"]
           for kind in made]  # (a header line: '#' and a JSON object)
    assert ids[0] == ids[1]


# -- SB3's wrappers and helpers ------------------------------------------------------

IMAGE = (spaces.Box(0, 255, (6, 6, 3), np.uint8), spaces.Discrete(3))
BOXES = (spaces.Dict({"a": spaces.Box(-1, 1, (3,), np.float32), "b": spaces.Box(0, 9, (2, 2), np.int32)}),
         spaces.Box(-1, 1, (2,), np.float32))

WRAPPERS = {
    "VecNormalize": (spaces_env("box"), lambda v: VecNormalize(v, gamma=0.9)),
    "VecNormalize-dict": (functools.partial(SpacesEnv, *BOXES, max_steps=8, terminate_prob=0.1),
                          lambda v: VecNormalize(v, norm_obs_keys=["a"])),
    "VecMonitor": (spaces_env("box"), VecMonitor),
    "VecFrameStack": (functools.partial(SpacesEnv, *BOXES, max_steps=8, terminate_prob=0.1),
                      lambda v: VecFrameStack(v, n_stack=3)),
    "VecTransposeImage": (functools.partial(SpacesEnv, *IMAGE, max_steps=8, terminate_prob=0.1), VecTransposeImage),
    "VecFrameStack+VecTransposeImage": (
        functools.partial(SpacesEnv, *IMAGE, max_steps=8, terminate_prob=0.1),
        lambda v: VecFrameStack(VecTransposeImage(v), n_stack=2, channels_order="first"),
    ),
}


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_under_sb3_wrappers(name, closing):
    fn, wrap = WRAPPERS[name]
    venv = closing(wrap(make("shmvec", [fn] * N)))
    ref = closing(wrap(make("dummy", [fn] * N)))
    run_lockstep(venv, ref, steps=40)


def test_under_vec_video_recorder(tmp_path, closing):
    pytest.importorskip("moviepy", reason="VecVideoRecorder needs moviepy (not a test dependency)")
    fn = spaces_env("box", render_mode="rgb_array")
    venv = closing(VecVideoRecorder(make("shmvec", [fn] * N), str(tmp_path), lambda step: step == 0, video_length=5))
    venv.reset()
    for _ in range(8):
        venv.step(np.zeros(N, dtype=np.int64))
    venv.close()
    assert list(tmp_path.glob("*.mp4"))


def cartpole_envs(kind, seed=3):
    cls = {"dummy": DummyVecEnv, "shmvec": ShmVecEnv}[kind]
    return make_vec_env("CartPole-v1", n_envs=N, seed=seed, vec_env_cls=cls,
                        vec_env_kwargs=SHM if kind == "shmvec" else None)


def test_make_vec_env(closing):
    venv, ref = closing(cartpole_envs("shmvec")), closing(cartpole_envs("dummy"))
    assert isinstance(venv, ShmVecEnv) and venv.num_workers == 1
    run_lockstep(venv, ref, steps=150, seed=3)


def test_evaluate_policy_same_as_dummy(closing):
    model = PPO("MlpPolicy", "CartPole-v1", seed=0, policy_kwargs={"net_arch": [8]}, device="cpu")
    results = []
    for kind in ("dummy", "shmvec"):
        venv = closing(cartpole_envs(kind))
        venv.seed(11)
        results.append(evaluate_policy(model, venv, n_eval_episodes=6, deterministic=True,
                                       return_episode_rewards=True))
    assert results[0] == results[1]
    assert len(results[0][0]) == 6


ALGOS = {
    "PPO": (PPO, "CartPole-v1", {"n_steps": 16, "batch_size": 32, "n_epochs": 2}, 128),
    "A2C": (A2C, "CartPole-v1", {"n_steps": 5}, 100),
    "DQN": (DQN, "CartPole-v1", {"learning_starts": 40, "buffer_size": 1000, "train_freq": 4}, 160),
    "SAC": (SAC, "Pendulum-v1", {"learning_starts": 40, "buffer_size": 1000, "batch_size": 32}, 80),
}


@pytest.mark.parametrize("algo", list(ALGOS))
def test_training_is_the_same_as_with_dummy(algo, closing, tmp_path_factory):
    """Same seed, same envs: the trained weights are bit for bit DummyVecEnv's.
    SB3's logger folder lands in pytest's temporary files, not in the
    system's temp dir (SB3 makes one per learn() unless SB3_LOGDIR says where)."""
    cls, env_id, kwargs, steps = ALGOS[algo]
    weights = []
    for vec_env_cls, vec_kwargs in ((DummyVecEnv, None), (ShmVecEnv, SHM)):
        venv = closing(make_vec_env(env_id, n_envs=2, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_kwargs))
        model = cls("MlpPolicy", venv, seed=0, device="cpu", policy_kwargs={"net_arch": [16]}, **kwargs)
        model.learn(steps)
        assert model.num_timesteps >= steps
        assert pathlib.Path(model.logger.get_dir()).is_relative_to(tmp_path_factory.getbasetemp())
        weights.append(model.policy.state_dict())
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


@pytest.mark.parametrize("action_space", [spaces.MultiBinary(4), spaces.Box(0, 5, (2,), np.int32)],
                         ids=["MultiBinary", "integer Box"])
@pytest.mark.parametrize("algo", [PPO, A2C], ids=["PPO", "A2C"])
def test_training_on_float_sampled_actions_is_the_same_as_with_dummy(algo, action_space, closing):
    """SB3's on-policy algorithms sample MultiBinary actions as float32 (a
    Bernoulli distribution), and any Box's as floats, an integer Box's too:
    each env gets its float32 row, as DummyVecEnv hands it, and the weights
    come out bit for bit the same."""
    fns = [functools.partial(SpacesEnv, spaces.Box(-1, 1, (3,), np.float32), action_space, max_steps=9)] * 2
    weights = []
    for kind in ("dummy", "shmvec"):
        venv = closing(make(kind, fns))
        extra = {"batch_size": 16, "n_epochs": 2} if algo is PPO else {}
        model = algo("MlpPolicy", venv, n_steps=8, seed=0, device="cpu", policy_kwargs={"net_arch": [8]}, **extra)
        model.learn(48)
        weights.append(model.policy.state_dict())
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


def test_cnn_training_with_torch_threads_none_is_the_same_as_with_dummy(closing):
    """A CnnPolicy's weights depend on torch's thread count (convolutions
    round by it); with torch_threads=None shmvec leaves that count alone,
    and training is bit for bit DummyVecEnv's (the README says so)."""
    image_env = functools.partial(SpacesEnv, spaces.Box(0, 255, (36, 36, 3), np.uint8), spaces.Discrete(3),
                                  max_steps=20, terminate_prob=0.05)
    weights = []
    for vec_env_cls, vec_kwargs in ((DummyVecEnv, None), (ShmVecEnv, {**SHM, "torch_threads": None})):
        venv = closing(make_vec_env(image_env, n_envs=3, seed=1, vec_env_cls=vec_env_cls, vec_env_kwargs=vec_kwargs))
        model = PPO("CnnPolicy", venv, n_steps=32, batch_size=32, n_epochs=1, seed=0, device="cpu",
                    policy_kwargs={"features_extractor_kwargs": {"features_dim": 16}})
        model.learn(96)
        weights.append(model.policy.state_dict())
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


# -- bad input and env errors ----------------------------------------------------------

@pytest.mark.parametrize("actions", [np.zeros(N + 1, dtype=np.int64), np.zeros(N - 1, dtype=np.int64),
                                     np.zeros((N, 2), dtype=np.int64)], ids=["too-many", "too-few", "shape"])
def test_wrong_actions_raise_value_error_before_stepping(actions, closing):
    fns = [spaces_env("box")] * N
    venv, ref = closing(make("shmvec", fns)), closing(make("dummy", fns))
    venv.seed(0), ref.seed(0)
    venv.reset(), ref.reset()
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        venv.step(actions)
    good = np.ones(N, dtype=np.int64)
    assert_equal(venv.step(good), ref.step(good))  # nothing was stepped by the bad call


@pytest.mark.parametrize("kind", ["dummy", "shmvec"])
def test_env_error_keeps_its_type(kind, closing):
    venv = closing(make(kind, [ProbeEnv] * N))
    venv.reset()
    venv.set_attr("fail_on_step", True, indices=[-1])
    with pytest.raises(EnvBoom, match="step failed"):
        venv.step(np.zeros(N, dtype=np.int64))


@pytest.mark.parametrize("option, match", [("autoreset_mode", "same-step"), ("copy", "fresh"),
                                           ("batch_size", "every env"), ("bogus", "unexpected")])
def test_options_that_break_the_contract_are_refused(option, match):
    with pytest.raises(TypeError, match=match):
        ShmVecEnv([ProbeEnv] * 2, **{option: 1})


def test_start_method_may_be_positional_as_in_subproc_vec_env(closing):
    """SubprocVecEnv(env_fns, "fork") works; so does the class name changed."""
    venv = closing(ShmVecEnv([ProbeEnv] * 2, "fork", num_workers=1))
    assert venv._engine.pool.start_method == "fork"
    with pytest.raises(TypeError):
        ShmVecEnv([ProbeEnv] * 2, "fork", 1)  # the rest stay keyword-only


@pytest.mark.parametrize("kind", ["dummy", "shmvec"])
@pytest.mark.parametrize("wrap", [lambda env: env, Monitor], ids=["bare", "new-wrapper-each-call"])
@pytest.mark.parametrize("layout", [{"num_workers": 0}, {"num_workers": 1, "caller_steps": False}])
def test_one_env_instance_for_several_envs_is_refused(kind, wrap, layout):
    """As DummyVecEnv checks env.unwrapped: make_vec_env(lambda: env) puts a
    new Monitor around the same env each time, and envs of one process would
    step one env."""
    env = ProbeEnv()
    with pytest.raises(ValueError, match="same"):
        make(kind, [lambda: wrap(env)] * 2, **layout)


def test_misuse_after_close_and_out_of_order(closing):
    venv = make("shmvec", [ProbeEnv] * 2)
    venv.reset()
    with pytest.raises(RuntimeError, match="step_async"):
        venv.step_wait()
    venv.close()
    venv.close()
    with pytest.raises(RuntimeError, match="closed"):
        venv.reset()


# -- imports -------------------------------------------------------------------------------

def test_import_shmvec_does_not_import_sb3_or_torch(tmp_path):
    code = "import sys, shmvec; print(sorted({'torch', 'stable_baselines3'} & set(sys.modules)))"
    # Away from the source tree, so that the installed package is the one imported.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "[]"


@pytest.mark.heavy
def test_sb3_front_end_is_reached_from_import_shmvec_alone(tmp_path):
    # As the README writes it: `import shmvec`, then `shmvec.sb3.ShmVecEnv`.
    code = ("import sys, shmvec; assert 'stable_baselines3' not in sys.modules; "
            "from stable_baselines3.common.vec_env import VecEnv; "
            "assert 'sb3' in dir(shmvec); assert issubclass(shmvec.sb3.ShmVecEnv, VecEnv); "
            "assert not hasattr(shmvec, 'no_such_module')")
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)


def test_sb3_front_end_without_sb3_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['stable_baselines3'] = None; import shmvec\n"
            "try:\n    shmvec.sb3\nexcept ModuleNotFoundError as exc:\n    print(exc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert "shmvec.sb3 needs Stable-Baselines3" in out.stdout, out
    assert 'pip install "shmvec[sb3]"' in out.stdout, out


def test_workers_do_not_import_sb3_or_torch(closing):
    # forkserver workers start from a clean process: nothing but the env
    # factories may pull modules in, and shmvec's SB3 glue pulls in none.
    venv = closing(ShmVecEnv([functools.partial(gym.make, "CartPole-v1")] * 2, num_workers=1,
                             start_method="forkserver"))
    venv.reset()
    venv.step(np.zeros(2, dtype=np.int64))
    assert venv.env_is_wrapped(gym.wrappers.TimeLimit) == [True, True]
    assert venv.get_attr("spec", indices=1)[0].id == "CartPole-v1"
    (worker,) = venv._engine.pool.processes
    with open(f"/proc/{worker.pid}/maps") as f:
        assert "libtorch" not in f.read()


# -- learning ------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ppo_learns_cartpole_through_shmvec(closing):
    """rl-zoo's CartPole settings; training stops early once an evaluation
    reaches 475, and the policy must then average >= 450 on 10 fresh episodes."""
    from stable_baselines3.common.callbacks import EvalCallback, StopTrainingOnRewardThreshold

    venv = closing(make_vec_env("CartPole-v1", n_envs=8, seed=0, vec_env_cls=ShmVecEnv))
    eval_env = closing(make_vec_env("CartPole-v1", n_envs=2, seed=100, vec_env_cls=ShmVecEnv,
                                    vec_env_kwargs={"num_workers": 1}))
    model = PPO("MlpPolicy", venv, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
                ent_coef=0.0, learning_rate=lambda p: 1e-3 * p, clip_range=lambda p: 0.2 * p,
                seed=0, device="cpu")
    stop = StopTrainingOnRewardThreshold(reward_threshold=475, verbose=0)
    model.learn(100_000, callback=EvalCallback(eval_env, callback_on_new_best=stop, n_eval_episodes=10,
                                               eval_freq=5_000 // 8, verbose=0))
    mean, _ = evaluate_policy(model, eval_env, n_eval_episodes=10, deterministic=True)
    assert mean >= 450, f"mean return {mean} after {model.num_timesteps} steps"


@pytest.mark.parametrize("space", [
    spaces.Dict({"move": spaces.Box(-1, 1, (2,), np.float32), "pick": spaces.Discrete(3)}),
    spaces.Tuple((spaces.Discrete(4), spaces.Box(-1, 1, (2,), np.float32))),
], ids=["dict", "tuple"])
def test_per_env_actions_of_structured_spaces_as_dummy_vec_env(space, closing):
    """SB3 indexes actions by env: a list of per-env Dict/Tuple actions
    works as in DummyVecEnv (its own test_vec_envs.py steps envs so)."""
    fns = [functools.partial(SpacesEnv, spaces.Box(-1, 1, (3,), np.float32), space, max_steps=6)] * N
    shm, dummy = closing(make("shm", fns)), closing(make("dummy", fns))
    shm.seed(1), dummy.seed(1)
    assert_same(shm.reset(), dummy.reset())
    space.seed(0)
    for t in range(10):
        actions = [space.sample() for _ in range(N)]
        got, want = shm.step(actions), dummy.step(actions)
        assert_same(got[:3], want[:3], f"step {t}")
    with pytest.raises(ValueError, match="3 actions for 4 envs"):
        shm.step([space.sample() for _ in range(N - 1)])


class ResetRaisesEnv(gym.Env):
    """Env 0 raises from its second reset on; each env counts its resets."""

    observation_space = spaces.Box(-1, 1, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, index: int):
        self.index, self.resets = index, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if self.index == 0 and self.resets:
            raise EnvBoom("env 0 cannot reset")
        self.resets += 1
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {}


@pytest.mark.parametrize("options, resets", [
    pytest.param(None, [1, 1, 2, 2], marks=pytest.mark.heavy),
    pytest.param({"level": 1}, [1, 1, 2, 2], marks=pytest.mark.heavy),
    # each env with options of its own is reset apart: all but env 0
    ([{"level": k} for k in range(4)], [1, 2, 2, 2]),
    # env 1 shares env 0's options and its process, after it
    pytest.param([{"level": 0}] * 2 + [{"level": 1}] * 2, [1, 1, 2, 2], marks=pytest.mark.heavy),
])
def test_an_env_raising_in_reset_leaves_the_other_processes_envs_reset_whatever_their_options(
        options, resets, closing):
    """The README: in reset(), the envs of other processes have been reset
    (the env's error raised after them), whatever options set_options()
    gave each; in its own process, those reset with it after it have not."""
    venv = ShmVecEnv([functools.partial(ResetRaisesEnv, k) for k in range(4)], num_workers=2, caller_steps=False)
    closing(venv)
    venv.reset()
    venv.set_options(options)
    with pytest.raises(EnvBoom, match="env 0 cannot reset"):
        venv.reset()
    assert list(venv.get_attr("resets")) == resets
