"""Random walks over async mode's API, each checked against a model: one
reference env per env, stepped in this process as SyncVectorEnv would
(NEXT_STEP autoresets). A walk mixes send(), recv(), async_reset(),
get_attr(), sends that must be refused (an env not the caller's, bad ids
or actions) and, with restart_failed_workers=True, SIGKILLs of a worker,
over worker counts, caller slices, batch sizes and start methods. Envs
finish in whatever order the processes make; the model checks every
result recv() hands out against what that env's reference gives, every
refusal, and every restart report (README, "Restarts").

Each walk is seeded: a failure names its seed and its last calls, and
`python -c "import test_async_walk as t; t.walk(SEED)"` (from tests/)
runs it again (which envs finish first may differ)."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
from helpers import needs_gymnasium_1, row_info

import shmvec
from shmvec.errors import ShmVecError
from shmvec.testing import SpacesEnv

pytestmark = needs_gymnasium_1("the model steps envs under NEXT_STEP autoresets")

NUM_ENVS = 6
CALLS = 150
REPORT = "report"  # a restart report is due (reward 0, truncated, infos["shmvec_restarted"])
UNKNOWN = None  # a result whose values the model cannot know (an env rebuilt by a restart)


class WalkEnv(SpacesEnv):
    """SpacesEnv's varied infos (numbers in columns, nested dicts and strings
    in records) and, now and then, one too large for its record slot."""

    def _info(self, kind: int) -> dict:
        info = super()._info(kind)
        if kind and self.np_random.random() < 0.15:
            info = dict(info, blob="x" * 9000)
        return info


def make() -> WalkEnv:
    return WalkEnv(max_steps=7, terminate_prob=0.15)


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    return np.array_equal(np.asarray(a), np.asarray(b))


class Model:
    """The vector env under test and what each of its envs must give next."""

    def __init__(self, seed: int):
        self.r = r = random.Random(seed)
        self.batch = r.choice([1, 2, 3, 5])
        workers, caller_steps = r.choice([(0, None), (1, None), (1, False), (2, None), (2, False), (3, True)])
        self.workers = workers
        self.kills = workers > 0 and r.random() < 0.5
        self.log = [f"seed {seed}: batch_size={self.batch} num_workers={workers} caller_steps={caller_steps} "
                    f"restarts={self.kills}"]
        self.envs = shmvec.ShmVecEnv([make] * NUM_ENVS, batch_size=self.batch, num_workers=workers,
                                     caller_steps=caller_steps, start_method=r.choice(["fork", "forkserver"]),
                                     restart_failed_workers=self.kills, max_restarts=100)
        self.refs = [make() for _ in range(NUM_ENVS)]
        self.reports_due = [0] * NUM_ENVS  # per env, deaths of its worker not yet reported
        self.maybe_report = [False] * NUM_ENVS  # its worker died while its report was in flight
        self.unknown = [False] * NUM_ENVS
        self.async_reset(r.randrange(100))

    def async_reset(self, seed: int) -> None:
        self.log.append(f"async_reset(seed={seed})")
        self.envs.async_reset(seed=seed)
        # A worker found dead during the reset resets its envs again without
        # the seeds (README, "Restarts"): their values are unknown from here.
        self.unknown = [bool(due) or maybe for due, maybe in zip(self.reports_due, self.maybe_report)]
        self.reports_due = [0] * NUM_ENVS
        self.maybe_report = [False] * NUM_ENVS
        self.pending = {}  # env -> what recv() must hand out for it
        self.held = set()  # envs the caller holds (may send)
        self.ended = [False] * NUM_ENVS
        for i, ref in enumerate(self.refs):
            obs, info = ref.reset(seed=seed + i)
            self.pending[i] = UNKNOWN if self.unknown[i] else (obs, 0.0, False, False, info)

    def send(self) -> None:
        ids = self.r.sample(sorted(self.held), self.r.randint(1, len(self.held)))
        actions = [self.r.randrange(3) for _ in ids]
        self.log.append(f"send({actions}, {ids})")
        self.envs.send(np.array(actions), ids)
        for i, action in zip(ids, actions):
            self.held.discard(i)
            if self.maybe_report[i]:
                self.maybe_report[i] = False
                self.pending[i] = UNKNOWN
            elif self.reports_due[i]:
                self.reports_due[i] -= 1
                self.unknown[i] = True
                self.pending[i] = REPORT
            elif self.unknown[i]:
                self.pending[i] = UNKNOWN
            else:
                ref = self.refs[i]
                if self.ended[i]:  # NEXT_STEP: this step resets it
                    obs, info = ref.reset()
                    result = (obs, 0.0, False, False, info)
                else:
                    result = ref.step(action)
                self.ended[i] = bool(result[2] or result[3])
                self.pending[i] = result

    def send_refused(self) -> None:
        """Envs the caller does not hold (in flight, or results not received)."""
        not_held = self.r.choice(sorted(self.pending))
        ids = self.r.sample(sorted(self.held), self.r.randint(0, len(self.held))) + [not_held]
        self.r.shuffle(ids)
        self.log.append(f"send to {ids}, refused")
        with pytest.raises(ValueError):
            self.envs.send(np.zeros(len(ids), np.int64), ids)

    def send_bad(self) -> None:
        ids = self.r.sample(sorted(self.held), self.r.randint(1, len(self.held)))
        kind = self.r.choice(["too many actions", "an id twice", "an id too large", "a negative id", "no ids"])
        actions, bad_ids = {
            "too many actions": (np.zeros(len(ids) + 1, np.int64), ids),
            "an id twice": (np.zeros(len(ids) + 1, np.int64), ids + [ids[0]]),
            "an id too large": (np.zeros(len(ids) + 1, np.int64), ids + [NUM_ENVS]),
            "a negative id": (np.zeros(len(ids) + 1, np.int64), ids + [-1]),
            "no ids": (np.zeros(0, np.int64), []),
        }[kind]
        self.log.append(f"send to {bad_ids} with {kind}, refused")
        with pytest.raises((ValueError, IndexError)):
            self.envs.send(actions, bad_ids)

    def recv(self) -> None:
        self.log.append(f"recv() with {sorted(self.pending)} not received")
        if len(self.pending) < self.batch:
            with pytest.raises(RuntimeError, match="recv"):
                self.envs.recv()
            return
        obs, rewards, terms, truncs, infos = self.envs.recv()
        ids = infos["env_id"].tolist()
        self.log.append(f"  -> {ids}")
        assert len(ids) == self.batch and len(set(ids)) == self.batch, ids
        for k, i in enumerate(ids):
            assert i in self.pending, f"env {i} handed out, not sent: {self.log[-12:]}"
            expected = self.pending.pop(i)
            self.held.add(i)
            info = row_info(infos, k)
            got = (obs[k], rewards[k], bool(terms[k]), bool(truncs[k]), info)
            if info.get("shmvec_restarted", False):
                assert (rewards[k], terms[k], truncs[k]) == (0, False, True), (i, got)
                assert expected in (REPORT, UNKNOWN) or self.reports_due[i], (i, expected)
                if expected is not REPORT and self.reports_due[i]:
                    self.reports_due[i] -= 1
                self.unknown[i] = True
            else:
                assert expected is not REPORT, f"env {i}: a restart report was due, got {got}"
                if expected is not UNKNOWN:
                    for name, want, have in zip(("obs", "reward", "terminated", "truncated", "info"), expected, got):
                        assert same(want, have), f"env {i}'s {name}: {want} expected, got {have}"

    def get_attr(self) -> None:
        self.log.append("get_attr('t')")
        for attempt in range(2):  # a worker found dead during the call: ShmVecError, call again
            try:
                steps = self.envs.get_attr("t")
                break
            except ShmVecError as exc:
                self.log.append(f"  {exc}")
                if attempt:
                    raise
        for i, ref in enumerate(self.refs):
            if not (self.unknown[i] or self.reports_due[i] or self.maybe_report[i]):
                assert steps[i] == ref.t, (i, steps, [ref.t for ref in self.refs])

    def kill_worker(self) -> None:
        w = self.r.randrange(self.workers)
        process = self.envs._engine.pool.processes[w]
        if not process.is_alive():  # killed, and not yet found dead
            return
        rows = list(self.envs._engine.worker_rows[w])
        self.log.append(f"SIGKILL worker {w} (envs {rows})")
        os.kill(process.pid, signal.SIGKILL)
        for i in rows:
            if self.pending.get(i) is REPORT:
                # Its report in flight comes back once for both deaths (lost,
                # and sent again) or twice (it had finished: the second at its
                # next send): either is right.
                self.unknown[i] = self.maybe_report[i] = True
            else:
                self.reports_due[i] += 1

    def call(self) -> None:
        r = self.r.random()
        if r < 0.35 and self.held:
            self.send()
        elif r < 0.70:
            self.recv()
        elif r < 0.75 and self.pending:
            self.send_refused()
        elif r < 0.80 and self.held:
            self.send_bad()
        elif r < 0.85:
            self.get_attr()
        elif r < 0.88:
            self.async_reset(self.r.randrange(100))
        elif r < 0.90 and self.kills and not any(self.reports_due):
            self.kill_worker()


def walk(seed: int) -> None:
    model = Model(seed)
    try:
        for _ in range(CALLS):
            model.call()
    except BaseException as exc:
        raise AssertionError("\n  ".join(["the walk's last calls:", *model.log[-25:]])) from exc
    finally:
        model.envs.close()


@pytest.mark.parametrize("seed", range(12))
def test_a_random_walk_matches_the_model(seed):
    walk(seed)


@pytest.mark.heavy
@pytest.mark.parametrize("seed", range(1000, 1200))
def test_a_long_run_of_random_walks_matches_the_model(seed):
    walk(seed)
