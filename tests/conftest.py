import os
import pathlib

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


@pytest.fixture
def closing():
    """Registers vector envs to close after the test, whatever happens."""
    made = []
    yield made.append
    for envs in made:
        envs.close()
