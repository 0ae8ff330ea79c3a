import os
import pathlib
import signal

import pytest

import shmvec

SOURCE_TREE = pathlib.Path(__file__).resolve().parent.parent


def pytest_sessionstart(session):
    # The suite tests the installed package (built extension included), never
    # the source tree by accident.
    where = pathlib.Path(shmvec.__file__).resolve().parent
    if where == SOURCE_TREE / "shmvec" and not os.environ.get("SHMVEC_ALLOW_SOURCE_TREE"):
        pytest.exit(f"shmvec was imported from the source tree ({where}); run `pip install .` and "
                    "run pytest from the repository root with the `pytest` command", returncode=3)
    # A shell starts a background job (`pytest &`, `nohup pytest &` from a
    # script) with SIGINT ignored, and Python then raises no KeyboardInterrupt:
    # the Ctrl-C tests need it, as a user's terminal gives it.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def sb3_logs_in_pytest_temp(tmp_path_factory):
    """SB3 makes a log folder in the system's temp dir for every learn()
    unless SB3_LOGDIR names one: keep them with pytest's temporary files."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3-logs")))
        yield


@pytest.fixture
def closing():
    """Registers vector envs to close after the test, whatever happens."""
    made = []
    yield made.append
    for envs in made:
        envs.close()


@pytest.fixture
def idle_cpus(monkeypatch):
    """For tests of what shmvec does where it may start workers: the
    busy-CPU check finds none, whatever else runs on this machine (a CI
    runner's other jobs). On a busy machine default envs start no worker and
    pin nothing, and an explicit worker count gets a PerformanceWarning."""
    from shmvec._engine import engine

    monkeypatch.setattr(engine, "cpus_busy_elsewhere", lambda own_pids=(): 0)


@pytest.fixture
def idle_machine():
    """Skips a test that measures this machine's real CPU load when other
    programs keep a CPU busy before it starts: what it asserts holds only
    beside idle CPUs."""
    from shmvec._engine.system import cpus_busy_elsewhere

    busy = cpus_busy_elsewhere()
    if busy:
        pytest.skip(f"other programs keep {busy} CPU(s) busy: this test needs them idle")
