"""A torch learner at its default threads competes with shmvec's workers for
the cores. While a vector env is open shmvec holds torch at the CPUs its
workers leave free (``torch_threads="auto"``), says so once, and gives the
threads back when the last env closes; ``torch_threads=None`` leaves torch
alone and warns with the setting that fixes it."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

PRELUDE = textwrap.dedent("""
    import gc, json, warnings
    import gymnasium as gym
    import shmvec
    from shmvec._engine.system import usable_cpus

    warnings.simplefilter("always")
    caught = []
    warnings.showwarning = lambda message, category, *rest: caught.append((category.__name__, str(message)))
    from shmvec._engine import engine, torch_threads
    CPUS = usable_cpus() if CPUS_GIVEN is None else CPUS_GIVEN
    torch_threads.usable_cpus = lambda: CPUS  # the machine's size, as torch_threads sees it
    # CPUs other programs keep busy, as the engine sees them (not this machine's: a CI runner's other jobs)
    engine.cpus_busy_elsewhere = lambda own_pids=(): BUSY
    FREE = max(1, CPUS - 1 - BUSY)  # the CPUs one worker and the busy ones leave free
    MANY = CPUS + 1  # more than any free count: torch competes
    seen = {}

    def make(cls=shmvec.ShmVecEnv, **kwargs):
        return cls([lambda: gym.make("CartPole-v1")] * 2, num_workers=1, start_method="fork", **kwargs)
""")


# This machine, and a larger one (what torch_threads sees of it; the workers
# run on this one's CPUs): with one worker, 2 CPUs leave torch 1, 16 leave 15.
# The larger one runs with -m heavy.
MACHINES = [pytest.param(None, id="this-machine"), pytest.param(16, id="16-cpus", marks=pytest.mark.heavy)]


# A fork server imports what the scripts import (torch first) once; each
# script runs in a child forked from it: as fresh a process as `python -c`,
# with no env made yet, less the 2-3 s that importing torch takes on these
# 2-CPU machines (the file ran 110-120 s, and 26-29 s so).
FORK_SERVER = textwrap.dedent("""
    import atexit, json, os, signal, sys, time, traceback
    import torch, gymnasium, shmvec
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # with its workers, for a kill at the timeout
            os.chdir(request["cwd"])
            written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            for fd, name, flags in [(0, os.devnull, os.O_RDONLY), (1, request["outputs"][0], written),
                                    (2, request["outputs"][1], written)]:
                opened = os.open(name, flags)
                os.dup2(opened, fd)
                os.close(opened)
            try:
                exec(compile(request["script"], "<script>", "exec"), vars(sys.modules["__main__"]))
                code = 0
            except SystemExit as stop:  # sys.exit(n): n, as the interpreter gives it
                code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
            except BaseException:
                traceback.print_exc()
                code = 1
            # As the script's end, less the teardown of every module (0.9 s
            # here: it copies the pages the child shares with the server).
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        deadline = time.monotonic() + request["timeout"]
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        if done[0] == 0:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        print(json.dumps(os.waitstatus_to_exitcode(done[1]) if done[0] else "timed out"), flush=True)
""")
_fork_server: subprocess.Popen | None = None


@pytest.fixture(scope="module", autouse=True)
def _close_the_fork_server():
    global _fork_server
    yield
    if _fork_server is not None:
        _fork_server.stdin.close()  # its loop ends
        _fork_server.wait(timeout=30)
        _fork_server.stdout.close()
        _fork_server = None


def run_forked(script: str, cwd) -> tuple[int | str, str, str]:
    """Runs `script` in a child of the fork server (started at the first
    call, away from the source tree: the installed shmvec, with its built
    extension); returns its exit code and outputs."""
    global _fork_server
    if _fork_server is None:
        _fork_server = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, cwd=cwd)
    outputs = [str(cwd / "stdout.txt"), str(cwd / "stderr.txt")]
    _fork_server.stdin.write(json.dumps({"script": script, "cwd": str(cwd), "outputs": outputs, "timeout": 100}) + "\n")
    _fork_server.stdin.flush()
    answer = _fork_server.stdout.readline()
    assert answer, f"the fork server died (exit code {_fork_server.poll()})"
    return (json.loads(answer), *(pathlib.Path(name).read_text() for name in outputs))


def run(body: str, cwd, cpus: int | None = None, torch_first: bool = True, busy: int = 0) -> dict:
    """Runs `body` after PRELUDE in a fresh process (torch imported first
    unless not `torch_first`, `busy` CPUs kept busy by other programs) and
    returns what it put in `seen`."""
    script = (f"CPUS_GIVEN = {cpus!r}\nBUSY = {busy!r}\n" + ("import torch\n" if torch_first else "") + PRELUDE + textwrap.dedent(body)
              + "\nprint(json.dumps(dict(seen, FREE=FREE, MANY=MANY, caught=caught)))\n")
    if torch_first:
        returncode, stdout, stderr = run_forked(script, cwd)
    else:  # a process that has not imported torch: a fresh interpreter
        # Away from the source tree: the installed shmvec, with its built extension.
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=cwd)
        returncode, stdout, stderr = out.returncode, out.stdout, out.stderr
    assert returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1])


def performance_warnings(result: dict) -> list[str]:
    """The PerformanceWarnings caught, less the one a busy machine gives the
    explicit worker (a CI runner's other jobs): not what these tests are about."""
    return [message for category, message in result["caught"]
            if category == "PerformanceWarning" and "kept busy by other programs" not in message]


@pytest.mark.parametrize("cpus", MACHINES)
def test_auto_lowers_torch_threads_while_open_and_restores_them(tmp_path, cpus):
    result = run("""
        torch.set_num_threads(MANY)
        a = make()
        seen["open"] = torch.get_num_threads()
        b = make()  # a second env neither lowers again nor warns again
        a.close()
        seen["one_left"] = torch.get_num_threads()
        b.close()
        seen["closed"] = torch.get_num_threads()
    """, tmp_path, cpus)
    assert result["open"] == result["FREE"]
    assert result["one_left"] == result["FREE"]
    assert result["closed"] == result["MANY"]
    (message,) = performance_warnings(result)
    assert f"torch.set_num_threads({result['FREE']})" in message and "torch_threads=None" in message


@pytest.mark.heavy
def test_torch_imported_after_the_env_is_held_from_the_next_reset(tmp_path):
    """A script that makes its envs, then builds its policy (importing
    torch), then resets: torch's threads competed with the workers, at half
    the steps/s (CartPole x64 with a 64-64 MLP on 2 vCPUs). (SB3's front end
    imports torch itself, before any env is made.)"""
    result = run("""
        envs = make()
        import torch
        torch.set_num_threads(MANY)
        envs.reset()
        seen["reset"] = torch.get_num_threads()
        envs.reset()  # held once, not again
        envs.close()
        seen["closed"] = torch.get_num_threads()
    """, tmp_path, torch_first=False)
    assert (result["reset"], result["closed"]) == (result["FREE"], result["MANY"])
    (message,) = performance_warnings(result)
    assert f"torch.set_num_threads({result['FREE']})" in message


def test_sb3_front_end_holds_torch_threads_too(tmp_path):
    pytest.importorskip("stable_baselines3")
    result = run("""
        from shmvec.sb3 import ShmVecEnv
        torch.set_num_threads(MANY)
        envs = make(ShmVecEnv)
        seen["open"] = torch.get_num_threads()
        envs.close()
        seen["closed"] = torch.get_num_threads()
    """, tmp_path)
    assert (result["open"], result["closed"]) == (result["FREE"], result["MANY"])


def test_a_setting_made_by_the_user_while_open_is_kept(tmp_path):
    result = run("""
        torch.set_num_threads(MANY)
        envs = make()
        torch.set_num_threads(3)
        envs.close()
        seen["closed"] = torch.get_num_threads()
    """, tmp_path)
    assert result["closed"] == 3


def test_an_env_collected_unclosed_restores_them(tmp_path):
    result = run("""
        torch.set_num_threads(MANY)
        envs = make()
        del envs
        gc.collect()
        seen["after"] = torch.get_num_threads()
    """, tmp_path)
    assert result["after"] == result["MANY"]


def test_an_explicit_number_is_held_while_open(tmp_path):
    result = run("""
        torch.set_num_threads(1)
        envs = make(torch_threads=2)
        seen["open"] = torch.get_num_threads()
        envs.close()
        seen["closed"] = torch.get_num_threads()
    """, tmp_path)
    assert (result["open"], result["closed"]) == (2, 1)


def test_none_leaves_torch_alone_and_warns_once_with_the_fix(tmp_path):
    result = run("""
        torch.set_num_threads(MANY)
        for _ in range(2):
            envs = make(torch_threads=None)
            seen["open"] = torch.get_num_threads()
            envs.close()
    """, tmp_path)
    assert result["open"] == result["MANY"]
    (message,) = performance_warnings(result)
    assert f"torch.set_num_threads({result['FREE']})" in message


@pytest.mark.parametrize("cpus", MACHINES)
def test_torch_within_the_free_cpus_is_not_touched(tmp_path, cpus):
    # On 16 CPUs "auto" once raised a user's 1 thread to the 15 left free.
    result = run("""
        torch.set_num_threads(1)
        envs = make()
        seen["open"] = torch.get_num_threads()
        envs.close()
        seen["closed"] = torch.get_num_threads()
    """, tmp_path, cpus)
    assert (result["open"], result["closed"]) == (1, 1)
    assert performance_warnings(result) == []


@pytest.mark.parametrize("cpus, busy", [(None, 1), (16, 14), (16, 15)], ids=["this-machine", "16-cpus", "16-all-busy"])
def test_cpus_other_programs_keep_busy_are_not_left_to_torch(tmp_path, cpus, busy):
    # Beside CPU hogs torch's threads wait at barriers for threads the hogs
    # hold (SyncVectorEnv with a 64-64 MLP at torch's 2 threads beside two
    # hogs on 2 CPUs: 1.6k steps/s in most passes).
    result = run("""
        torch.set_num_threads(MANY)
        envs = make()
        seen["open"] = torch.get_num_threads()
        envs.close()
    """, tmp_path, cpus, busy=busy)
    assert result["open"] == result["FREE"] == max(1, (cpus or result["MANY"] - 1) - 1 - busy)
    (message,) = performance_warnings(result)
    assert f"torch.set_num_threads({result['FREE']})" in message and "other programs' threads" in message


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "all"])
def test_a_bad_setting_is_refused_before_any_worker_starts(bad):
    import gymnasium as gym

    import shmvec

    with pytest.raises(ValueError, match="torch_threads"):
        shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")], num_workers=1, torch_threads=bad)


# A policy that keeps the caller away from its envs longer than the workers'
# spin cap (2 ms): the workers sleep meanwhile, so torch's threads no longer
# wait on them, and the policy's own work (a CNN's forward and update) needs
# them. SB3's PPO with its CnnPolicy on 8 Pongs ran at 0.67x DummyVecEnv with
# torch held at 1 thread on 2 vCPUs, 1.07x with its 2.
STEPS = """
        envs.reset()
        for _ in range(40):
            time.sleep(AWAY)  # the policy's time between steps
            envs.step(envs.action_space.sample())
        seen["stepping"] = torch.get_num_threads()
        envs.close()
        seen["closed"] = torch.get_num_threads()
"""


@pytest.mark.parametrize("cpus", MACHINES)
@pytest.mark.parametrize("front", ["gymnasium", "sb3"])
def test_a_policy_that_keeps_the_caller_away_long_gets_torch_threads_back(tmp_path, cpus, front):
    if front == "sb3":
        pytest.importorskip("stable_baselines3")
    result = run("""
        import time
        AWAY = 0.005
        torch.set_num_threads(MANY)
        if FRONT == "sb3":
            from shmvec.sb3 import ShmVecEnv as SB3VecEnv
            envs = make(SB3VecEnv)
            envs.action_space.sample = lambda n=envs.num_envs: [0] * n  # a batch, as Gymnasium's gives
        else:
            envs = make()
        seen["open"] = torch.get_num_threads()
    """.replace("FRONT", repr(front)) + STEPS, tmp_path, cpus)
    # Back to what torch had, up to the CPUs other programs leave (all here): MANY is one more.
    assert result["open"] == result["FREE"]
    assert result["stepping"] == result["MANY"] - 1
    assert result["closed"] == result["MANY"]
    lowered, back = performance_warnings(result)
    assert f"torch.set_num_threads({result['FREE']})" in lowered
    assert f"{result['MANY'] - 1} intra-op threads back" in back and "between steps" in back


@pytest.mark.parametrize("away, kwargs", [(0.0, {}), (0.005, {"batch_size": 1})], ids=["short-gaps", "async-mode"])
def test_torch_stays_held_where_its_threads_would_wait_on_the_workers(tmp_path, away, kwargs):
    # Short gaps: the workers spin through them (a 64-64 MLP at torch's 2
    # threads beside them ran 4x slower). Async mode: the workers step while
    # the caller is away.
    body = """
        import time
        AWAY = {away}
        torch.set_num_threads(MANY)
        envs = make(**{kwargs!r})
    """.format(away=away, kwargs=kwargs)
    if kwargs:  # async mode: send/recv instead of step
        body += """
        envs.async_reset(seed=0)
        for _ in range(40):
            obs, *_, infos = envs.recv()
            time.sleep(AWAY)
            envs.send(envs.action_space.sample()[:len(infos["env_id"])], infos["env_id"])
        envs.recv()
        seen["stepping"] = torch.get_num_threads()
        envs.close()
        """
    else:
        body += STEPS
    result = run(body, tmp_path)
    assert result["stepping"] == result["FREE"]
    assert len(performance_warnings(result)) == 1


def test_a_setting_made_by_the_user_while_judging_is_kept(tmp_path):
    result = run("""
        import time
        AWAY = 0.005
        torch.set_num_threads(MANY)
        envs = make()
        torch.set_num_threads(2)
    """ + STEPS, tmp_path, 16)
    assert result["stepping"] == result["closed"] == 2


def test_the_gaps_timed_run_from_a_steps_return_to_the_next_step(monkeypatch):
    """What shmvec does between two steps (a reset, a call) is not the
    policy's time."""
    from shmvec._engine import torch_threads

    now = [0]
    monkeypatch.setattr(torch_threads.time, "perf_counter_ns", lambda: now[0])
    decided = []
    judge = torch_threads.GapJudge(decided.append)
    for k in range(3 * torch_threads.GapJudge.STEPS):
        judge.command_begins(step=True)
        now[0] += 300_000  # the step
        judge.step_returns()
        now[0] += 1_000_000  # the policy
        if k % 2:
            judge.command_begins(step=False)  # a reset, or a call
            now[0] += 10_000_000
        if decided:
            break
    assert decided == [1_000_000] and k == 2 * torch_threads.GapJudge.STEPS - 1


# A loop that steps a rollout, then updates its policy (PPO's shape): torch
# held at one thread while the workers step, and at one for the update too.
# SB3's PPO on 8 HalfCheetahs (256-256 MLP, batch_size=2048) ran at 0.80x
# DummyVecEnv so on 2 vCPUs, its update 1.6x slower; in async mode a loop of
# that shape ran 0.72x as fast as with torch's threads back for its updates.
# Once the updates have come at a steady period, shmvec times some cycles (an
# update and the rollout after it) with torch's threads back for the update
# and as many without, and gives them back for every later update if that was
# faster. In async mode a send() and a recv() each count as a step: the
# update may come after a rollout's last send() or between its last recv()
# and the send() after it.
ROLLOUTS = """
        import time
        from shmvec._engine.torch_threads import GapJudge
        TRIALS = GapJudge.TRIALS
        ROLLOUT = 40  # steps a rollout
        torch.set_num_threads(MANY)
        START
        in_rollouts, in_updates = set(), []
        for rollout in range(4 + 2 * TRIALS):
            for k in range(ROLLOUT):
                STEP
                if k < ROLLOUT - 1:
                    in_rollouts.add(torch.get_num_threads())
            in_updates.append(torch.get_num_threads())
            UPDATE  # the policy's update
        seen["rollouts"], seen["updates"] = sorted(in_rollouts), in_updates
        STEP
        seen["stepping"] = torch.get_num_threads()
        envs.close()
        seen["closed"] = torch.get_num_threads()
        seen["TRIALS"] = TRIALS
"""
FASTER_WITH_THREADS = "time.sleep(0.02 if torch.get_num_threads() > FREE else 0.06)"
SLOWER_WITH_THREADS = "time.sleep(0.06 if torch.get_num_threads() > FREE else 0.02)"
# How each mode makes its envs and steps them: (START, STEP).
MODES = {
    "lock-step": ("envs = make()\n        envs.reset()", "envs.step(envs.action_space.sample())"),
    "async": ("envs = make(batch_size=1)\n        envs.async_reset(seed=0)",
              'envs.send(envs.action_space.sample()[:1], envs.recv()[-1]["env_id"])'),
    # The update between a rollout's last recv() and its send().
    "async-update-after-recv": (
        'envs = make(batch_size=1)\n        envs.async_reset(seed=0)\n        ids = envs.recv()[-1]["env_id"]',
        'envs.send(envs.action_space.sample()[:1], ids); ids = envs.recv()[-1]["env_id"]'),
}


def rollouts(update: str, mode: str = "lock-step") -> str:
    """ROLLOUTS with `update` as the update, in `mode`."""
    start, step = MODES[mode]
    return ROLLOUTS.replace("START", start).replace("STEP", step).replace("UPDATE", update)


def updates(result: dict, chosen: str, mode: str = "lock-step") -> list[int]:
    """Torch's threads as each update begins: the first two show the
    period; then the trials, threads back ("B") or held ("H") alternately;
    then the trials' choice, `chosen` ("B" or "H"), for the last two. With
    the update after a recv(), the first is one step further from the
    making than the period (the first recv()), and the third shows it."""
    threads = {"B": result["MANY"] - 1, "H": result["FREE"]}
    trials = [threads[t] for t in "BH" * result["TRIALS"]]
    found = 3 if mode == "async-update-after-recv" else 2
    return [threads["H"]] * found + trials + [threads[chosen]] * (4 - found)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cpus", MACHINES)
def test_torch_gets_its_threads_back_for_updates_that_run_faster_with_them(tmp_path, cpus, mode):
    result = run(rollouts(FASTER_WITH_THREADS, mode), tmp_path, cpus)
    free, back = result["FREE"], result["MANY"] - 1
    assert result["rollouts"] == [free]
    assert result["updates"] == updates(result, "B", mode)
    assert (result["stepping"], result["closed"]) == (free, result["MANY"])
    lowered, given = performance_warnings(result)
    assert f"torch.set_num_threads({free})" in lowered
    assert f"{back} intra-op threads back" in given
    assert ("every 40 steps" if mode == "lock-step" else "every 80 recv() and send() calls") in given


@pytest.mark.parametrize("mode", MODES)
def test_updates_slower_with_torch_threads_keep_them_held(tmp_path, mode):
    # A small policy's update (SB3's PPO on 8 CartPoles, a 64-64 MLP: 0.83x
    # as fast with them, torch's idle OpenMP thread spinning into the rollout).
    # (Slower by far, not level: a level update's choice is the noise's, and
    # once came out "faster with them" in a CI run.)
    result = run(rollouts(SLOWER_WITH_THREADS, mode), tmp_path)
    assert result["updates"] == updates(result, "H", mode)
    assert len(performance_warnings(result)) == 1


def test_long_gaps_at_no_steady_period_are_not_foreseen(tmp_path):
    result = run(rollouts(FASTER_WITH_THREADS).replace("range(ROLLOUT)", "range(ROLLOUT + 7 * rollout)"), tmp_path)
    assert result["rollouts"] == [result["FREE"]] and set(result["updates"]) == {result["FREE"]}
    assert len(performance_warnings(result)) == 1


def test_a_setting_made_by_the_user_in_a_foreseen_gap_is_kept(tmp_path):
    result = run(rollouts(FASTER_WITH_THREADS + """
            if rollout == 2:
                torch.set_num_threads(3)"""), tmp_path, 16)
    assert result["updates"][:3] == [result["FREE"], result["FREE"], 16]
    assert set(result["updates"][3:]) == {3} and result["stepping"] == result["closed"] == 3


def test_an_env_closed_in_a_foreseen_gap_restores_torch(tmp_path):
    body = rollouts(FASTER_WITH_THREADS).replace("4 + 2 * TRIALS", "3").replace(
        "        envs.step(envs.action_space.sample())\n        seen[\"stepping\"]", "        seen[\"stepping\"]")
    result = run(body, tmp_path)
    assert result["updates"][-1] == result["stepping"] == result["MANY"] - 1
    assert result["closed"] == result["MANY"]


# A user who asks torch for reproducible numbers (CleanRL's scripts set
# cuDNN's flag by default) gets the same numbers from every run of a seed:
# "auto" then uses nothing that differs between runs, neither other programs'
# load when the env is made nor timings while it steps. (CleanRL's
# ppo_continuous_action.py on 4 HalfCheetahs gave one result in 5 runs and
# another in the sixth, as the timed trials went.)
DETERMINISM = {"algorithms": "torch.use_deterministic_algorithms(True)",
               "cudnn": "torch.backends.cudnn.deterministic = True"}


@pytest.mark.heavy
@pytest.mark.parametrize("asked", DETERMINISM)
@pytest.mark.parametrize("cpus, busy, envs, held", [(16, 14, "make()", 15), (None, 1, "make_one()", "CPUS")],
                         ids=["busy-cpus", "no-worker-beside-busy-cpus"])
def test_with_torch_determinism_auto_holds_what_an_idle_machine_gets(tmp_path, asked, cpus, busy, envs, held):
    # busy-cpus: one explicit worker, 14 of 16 CPUs busy: the load alone
    # would leave torch 1. no-worker...: one env, which the caller steps
    # (CleanRL's DQN, SAC, TD3): the load alone would lower torch.
    result = run(f"""
        {DETERMINISM[asked]}
        def make_one():
            return shmvec.ShmVecEnv([lambda: gym.make("CartPole-v1")], start_method="fork")
        torch.set_num_threads(MANY)
        envs = {envs}
        seen["open"] = torch.get_num_threads()
        seen["held"] = {held}
        envs.close()
        seen["closed"] = torch.get_num_threads()
    """, tmp_path, cpus, busy=busy)
    assert result["open"] == result["held"] and result["held"] != result["FREE"]
    assert result["closed"] == result["MANY"]
    (message,) = performance_warnings(result)
    assert f"torch.set_num_threads({result['held']})" in message and "deterministic mode" in message


@pytest.mark.parametrize("asked", ["before", "after"], ids=["asked-before-the-env", "asked-after-the-env"])
def test_with_torch_determinism_updates_get_no_timed_trial(tmp_path, asked):
    # The trials' choice turns on a few percent of noisy timings. After: SB3's
    # set_random_seed sets cuDNN's flag when its model is made, after the env.
    determinism = "torch.backends.cudnn.deterministic = True"
    body = textwrap.dedent(rollouts(FASTER_WITH_THREADS))
    made = body.index("\n", body.index("envs = make()")) + 1
    body = body[:made] + determinism + "\n" + body[made:] if asked == "after" else determinism + "\n" + body
    result = run(body, tmp_path)
    assert result["rollouts"] == [result["FREE"]] and set(result["updates"]) == {result["FREE"]}
    assert result["stepping"] == result["FREE"] and result["closed"] == result["MANY"]
    (message,) = performance_warnings(result)
    assert f"torch.set_num_threads({result['FREE']})" in message


@pytest.mark.heavy
def test_with_torch_determinism_a_long_policy_still_gets_torch_threads_back(tmp_path):
    # One choice, after the first 32 steps, far from its 2 ms bound for a CNN
    # (5 ms): CleanRL's ppo_atari.py on the CPU ran 0.70x SyncVectorEnv with
    # torch held at one thread, 0.90x with them back.
    result = run("torch.use_deterministic_algorithms(True)\nimport time\nAWAY = 0.005\n"
                 "torch.set_num_threads(MANY)\nenvs = make()\n" + textwrap.dedent(STEPS), tmp_path, 16)
    assert result["stepping"] == result["MANY"] - 1 and result["closed"] == result["MANY"]
    lowered, back = performance_warnings(result)
    assert "deterministic mode" in lowered and "intra-op threads back" in back


class JudgedLoop:
    """A GapJudge on a clock the test moves. Each step() takes 50 us, then
    the caller is away for `away(given)` ns, `given`: whether torch got its
    threads back for that gap. Records the steps after which it did
    (`gave`) and the trials' choices (`chosen`)."""

    def __init__(self, monkeypatch, batch_steps: int = 1):
        from shmvec._engine import torch_threads

        self.now = self.steps = 0
        self.given = False
        self.gave, self.chosen = [], []
        monkeypatch.setattr(torch_threads.time, "perf_counter_ns", lambda: self.now)
        self.judge = torch_threads.GapJudge(lambda median: None, self._give, self._hold,
                                            lambda *args: self.chosen.append(args), batch_steps)

    def _give(self) -> bool:
        self.gave.append(self.steps)
        self.given = True
        return True

    def _hold(self) -> None:
        self.given = False

    def step(self, away) -> None:
        self.judge.command_begins(step=True)
        self.now += 50_000
        self.steps += 1
        self.judge.step_returns()
        self.now += away(self.given)


def test_updates_are_foreseen_among_other_long_gaps_and_tried(monkeypatch):
    """A PPO update after each rollout of 10 steps (20 ms with torch's
    threads, 40 ms without), and episodes that end every 12 steps, whose
    last values the learner computes (3 ms): both series are foreseen once
    the first 32 gaps are judged and tried; the updates get torch's threads
    back for good after their trials; no short gap is foreseen."""
    from shmvec._engine import torch_threads

    loop = JudgedLoop(monkeypatch)
    for step in range(1, 201):
        episode_end = 3_000_000 if step % 12 == 3 else 0
        loop.step(lambda given: 100_000 + episode_end + (step % 10 == 0) * (20_000_000 if given else 40_000_000))
    assert sorted(period for period, _, _ in loop.chosen) == [10, 12]
    assert [given < held for period, given, held in loop.chosen if period == 10] == [True]
    # Updates: found at step 20 (0, 10, 20); the median judged at the 33rd step; trials from step 40.
    trials = 2 * torch_threads.GapJudge.TRIALS
    assert [n for n in loop.gave if n % 10 == 0] == list(range(40, 40 + 10 * trials, 20)) + list(
        range(40 + 10 * trials, 201, 10))
    assert {n for n in loop.gave if n % 10} <= {n for n in range(201) if n % 12 == 3}


def test_a_long_policy_at_every_batch_is_not_an_update(monkeypatch):
    """Async mode with a policy that takes longer than the workers' spin
    cap at every batch (a CNN's forward pass, 3 ms, between each recv() and
    send()), and an update after every 40th send(): only the updates are
    foreseen and tried; the policy's gaps keep torch held, as the workers
    step meanwhile."""
    loop = JudgedLoop(monkeypatch, batch_steps=2)
    for batch in range(1, 401):
        loop.step(lambda given: 3_000_000)  # recv(), then the policy
        loop.step(lambda given: 50_000 + (batch % 40 == 0) * (20_000_000 if given else 40_000_000))  # send()
    assert [(period, given < held) for period, given, held in loop.chosen] == [(80, True)]
    assert loop.gave and all(n % 80 == 0 for n in loop.gave)


def test_the_trial_runs_again_and_follows_a_change(monkeypatch):
    """An update that ran faster with torch's threads, then slower (another
    program took the other CPU, say): the next trial holds them again."""
    from shmvec._engine import torch_threads

    monkeypatch.setattr(torch_threads.GapJudge, "AGAIN", 10)
    loop = JudgedLoop(monkeypatch)
    for step in range(1, 501):
        faster = 20_000_000 if step < 200 else 60_000_000  # with the threads
        loop.step(lambda given: 100_000 + (step % 10 == 0) * (faster if given else 40_000_000))
    gave = loop.gave
    trials = 2 * torch_threads.GapJudge.TRIALS
    first = list(range(40, 40 + 10 * trials, 20)) + list(range(40 + 10 * trials, 40 + 10 * trials + 100, 10))
    again = 40 + 10 * trials + 100
    assert gave[:len(first)] == first  # tried, then given for AGAIN gaps
    # Tried again, then held for AGAIN gaps, then tried again.
    tried = list(range(again, again + 10 * trials, 20))
    assert gave[len(first):] == tried + [n + 10 * (trials + 10) for n in tried]


# Torch's OpenMP runtime (libgomp) keeps each helper thread of a parallel op
# spinning for about 5 ms after the op ends. Where torch runs more threads
# than the CPUs the workers leave (given back for a long gap, such as a CNN's
# forward pass, or set so), those helpers spin on the workers' CPUs through
# the step after the policy: with a CNN policy at torch's 2 threads on 2
# vCPUs, 8 Pongs stepped in 5.6-9.6 ms so, 3.4-5.7 ms without them (the loop
# 0.87-1.19x SyncVectorEnv, 1.09-1.62x without). So a
# command that begins then ends the caller's idle helpers first
# (omp_pause_resource_all; the next parallel op starts them again), where
# timing both ways finds that faster (HelperTrial, which starts with it).
HELPERS = """
        import os
        def threads():
            return len(os.listdir("/proc/self/task"))
        torch.set_num_threads(MANY)
        START
        x = torch.ones(4_000_000)
        ended = []
        for _ in range(4):
            x.add_(1)  # a parallel op at torch's count: OpenMP's helpers run it, then idle
            with_helpers = threads()
            STEP
            ended.append(threads() < with_helpers)
        x.add_(1)  # the next op starts them again
        seen["again"] = threads() == with_helpers
        seen["ended"] = ended
        seen["torch"] = torch.get_num_threads()
        envs.close()
"""
HELPER_CASES = {
    # an explicit count over the free CPUs
    "explicit": ("envs = make(torch_threads=MANY)\n        envs.reset(seed=0)",
                 "envs.step(envs.action_space.sample())"),
    # "auto" after a long gap at every step gave torch its threads back
    "given-back": ("envs = make()\n        envs.reset(seed=0)\n        import time\n        for _ in range(40):\n"
                   "            time.sleep(0.005)\n            envs.step(envs.action_space.sample())",
                   "envs.step(envs.action_space.sample())"),
    "async": ("envs = make(torch_threads=MANY, batch_size=1)\n        envs.async_reset(seed=0)\n"
              '        ids = envs.recv()[-1]["env_id"]',
              'envs.send(envs.action_space.sample()[:1], ids); ids = envs.recv()[-1]["env_id"]'),
}


@pytest.mark.parametrize("case", HELPER_CASES)
def test_commands_end_torchs_idle_openmp_helpers_that_would_take_the_workers_cpus(tmp_path, case):
    start, step = HELPER_CASES[case]
    result = run(HELPERS.replace("START", start).replace("STEP", step), tmp_path)
    assert result["torch"] > result["FREE"]
    assert any(result["ended"]), result["ended"]
    assert result["again"]


def test_torch_threads_none_leaves_its_openmp_helpers_alone(tmp_path):
    result = run(HELPERS.replace("START", "envs = make(torch_threads=None)\n        envs.reset(seed=0)").replace(
        "STEP", "envs.step(envs.action_space.sample())"), tmp_path)
    assert not any(result["ended"])


@pytest.mark.parametrize("faster", [True, False], ids=["ended-faster", "kept-faster"])
def test_the_helpers_are_ended_only_where_timing_both_ways_finds_it_faster(monkeypatch, faster):
    from shmvec._engine import torch_threads

    now = [0]
    monkeypatch.setattr(torch_threads.time, "perf_counter_ns", lambda: now[0])
    trial = torch_threads.HelperTrial()
    TRIALS, AGAIN = trial.TRIALS, trial.AGAIN
    ends = []
    for _ in range(2 * TRIALS + AGAIN + 2):
        end = trial.end_now()
        ends.append(end)
        now[0] += 5_000_000 if end == faster else 8_000_000  # the cycle: the step and the policy's time
    tried = 2 * TRIALS
    assert ends[:tried] == [True, False] * TRIALS  # timed both ways, alternately
    assert ends[tried:tried + AGAIN] == [faster] * AGAIN  # then the faster way
    assert ends[tried + AGAIN:] == [True, False]  # and the trial runs again
