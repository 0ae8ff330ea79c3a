"""The examples in the public docstrings run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest
from helpers import needs_autoreset_modes

MODULES = ["shmvec.vector_env", "shmvec.make", "shmvec.sb3",
           pytest.param("shmvec.ray.errors", marks=needs_autoreset_modes("shmvec.ray"))]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name == "shmvec.sb3":
        pytest.importorskip("stable_baselines3")
    if name == "shmvec.ray.errors":
        pytest.importorskip("ray")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0
