"""A training loop that tests/test_interrupt_storm.py hits with SIGINTs at
random moments. It goes on after each KeyboardInterrupt as the README tells a
user to, then checks that every env's trajectory is exactly
SyncVectorEnv's for the same seed and actions: no step lost or made twice.

    python interrupted_loops.py lockstep STEPS INTERRUPTS NUM_ENVS NUM_WORKERS AUTORESET
    python interrupted_loops.py async STEPS INTERRUPTS NUM_ENVS NUM_WORKERS AUTORESET BATCH_SIZE

It steps until it has made STEPS steps (in async mode, every env) and its
calls have been interrupted INTERRUPTS times.

Prints READY once stepping begins, "I" each time a SIGINT reaches Python
(the storm sends the next only then: two at once are the documented second
Ctrl-C), and "OK <interrupts> <lost>" at the end (an assertion error
otherwise). <lost>: steps whose result Python itself lost, raising the
KeyboardInterrupt in this loop's frame as step() returned into it (before
3.11 only: tests/test_interrupt_sweep.py); the check skips those steps."""

import functools
import os
import signal
import sys

import gymnasium as gym
import numpy as np
from gymnasium.error import NoAsyncCallError

import shmvec

in_call = False  # inside a call of shmvec's
deferred = 0  # SIGINTs that came while the loop did its own bookkeeping
calling = False  # interruptible() is about to call, or has called, shmvec
returned = False  # the last SIGINT was raised in interruptible(), after shmvec's call returned


def on_sigint(signum, frame):
    """A SIGINT inside a shmvec call is a Ctrl-C there; one in the loop's own
    code (a result shmvec returned must reach the loop) is raised inside the
    next call instead."""
    global deferred, returned
    os.write(1, b"I\n")
    if in_call:
        returned = calling and frame.f_code is interruptible.__code__
        raise KeyboardInterrupt
    deferred += 1


def interruptible(fn, *args):
    """fn(*args) as a call that a Ctrl-C may cut; (its result or None,
    interrupted?, whether fn had returned: Python lost its result here)."""
    global in_call, deferred, calling, returned
    result, calling, returned, n = None, False, False, len(args)
    try:
        in_call = True
        if deferred:
            deferred -= 1
            raise KeyboardInterrupt
        # Plain calls: Python 3.11 also runs the handler as a call made
        # through f(*args) returns, which would lose a result here. Nothing
        # between `calling = True` and the call is a point where Python runs
        # the handler, so one in this frame after it came as fn returned.
        if n == 0:
            calling = True
            result = fn()
        elif n == 1:
            calling = True
            result = fn(args[0])
        else:
            calling = True
            result = fn(args[0], args[1])
    except KeyboardInterrupt:
        return result, True, returned  # (a result fn returned just before stays the loop's)
    finally:
        in_call = False
    return result, False, False


NOT_SENT = object()
ACTIONS = np.random.default_rng(0).integers(0, 2, size=(4096, 64))


def action(k: int, i: int) -> int:
    """Env i's action at its step k (k from 0)."""
    return int(ACTIONS[k % len(ACTIONS), i])


def lockstep(envs, done) -> tuple[list, int, int]:
    """Each step's (obs, rewards, terminations, truncations), None where
    Python lost it in this frame, until done(steps, interrupts); the
    interrupts; the steps lost so."""
    out, interrupts, lost, pending = [], 0, 0, False
    while not done(len(out), interrupts):
        if pending:  # an interrupted step() may or may not have handed out its step: step_wait() says
            try:
                result, hit, returned = interruptible(envs.step_wait)
            except NoAsyncCallError:
                result, hit, returned = NOT_SENT, False, False
        else:
            t = len(out)
            result, hit, returned = interruptible(envs.step, np.array([action(t, i) for i in range(envs.num_envs)]))
        interrupts += hit
        if returned:  # the step was made; Python dropped its result on the way here
            lost += 1
            out.append(None)
            pending = False
            continue
        pending = result is None  # interrupted before the results came back
        if result is not None and result is not NOT_SENT:
            out.append(tuple(np.copy(x) for x in result[:4]))
    return out, interrupts, lost


def send_recv(envs, done) -> tuple[list, int]:
    """Each env's own rows (obs, reward, terminated, truncated), its reset
    first, until done(fewest steps of an env, interrupts); the interrupts."""
    rows: list[list] = [[] for _ in range(envs.num_envs)]
    _, interrupts, _ = interruptible(functools.partial(envs.async_reset, seed=1))
    while not done(min(len(r) for r in rows) - 1, interrupts):
        result, hit, returned = interruptible(envs.recv)
        interrupts += hit
        assert not returned, "Python lost a recv() batch in this frame (Python 3.10: see the storm's test)"
        if result is None:
            continue  # the next recv() returns what this one gathered
        obs, rewards, terminations, truncations, infos = result
        ids = infos["env_id"]
        for j, i in enumerate(ids):
            rows[i].append((obs[j].copy(), rewards[j], terminations[j], truncations[j]))
        batch = np.array([action(len(rows[i]) - 1, i) for i in ids])
        while True:
            _, hit, _ = interruptible(envs.send, batch, ids)
            interrupts += hit
            if not hit:
                break
            try:  # interrupted: sent or not? Sending again tells
                envs.send(batch, ids)
                break
            except ValueError as exc:
                if "already in flight" not in str(exc):
                    raise
                break
    return rows, interrupts


def main() -> None:
    mode, steps, interrupts_wanted, num_envs, num_workers, autoreset = sys.argv[1:7]
    steps, interrupts_wanted = int(steps), int(interrupts_wanted)
    num_envs, num_workers = int(num_envs), int(num_workers)

    def done(steps_done: int, interrupts: int) -> bool:
        return steps_done >= steps and interrupts >= interrupts_wanted

    fns = [lambda: gym.make("CartPole-v1")] * num_envs
    kwargs = {"autoreset_mode": autoreset, "num_workers": num_workers}
    if mode == "async":
        kwargs["batch_size"] = int(sys.argv[7])
    envs = shmvec.ShmVecEnv(fns, **kwargs)
    signal.signal(signal.SIGINT, on_sigint)
    autoreset_mode = envs.autoreset_mode
    if mode == "lockstep":
        envs.reset(seed=1)
    print("READY", flush=True)
    lost = 0
    if mode == "lockstep":
        out, interrupts, lost = lockstep(envs, done)
        lengths = [len(out)]
    else:
        rows, interrupts = send_recv(envs, done)
        lengths = [len(r) - 1 for r in rows]
    envs.close()

    ref = gym.vector.SyncVectorEnv(fns, autoreset_mode=autoreset_mode)
    expected = [ref.reset(seed=1)[0]]
    for t in range(max(lengths)):
        expected.append(ref.step(np.array([action(t, i) for i in range(num_envs)]))[:4])
    if mode == "lockstep":
        for t, (got, want) in enumerate(zip(out, expected[1:])):
            for g, w in zip(got or (), want):
                assert g.dtype == w.dtype and np.array_equal(g, w), (t, got, want)
    else:
        for i in range(num_envs):
            assert np.array_equal(rows[i][0][0], expected[0][i]), (i, rows[i][0], expected[0][i])
            for k in range(1, len(rows[i])):
                want = tuple(x[i] for x in expected[k])
                got = rows[i][k]
                assert np.array_equal(got[0], want[0]) and got[1:] == want[1:], (i, k, got, want)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a late SIGINT must not end the exit
    print(f"OK {interrupts} {lost}", flush=True)


if __name__ == "__main__":
    main()
