"""The README's code runs as written, and its table of options is
``ShmVecEnv``'s: the front door must not drift from the code."""

from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import shmvec

README_PATH = pathlib.Path(__file__).resolve().parent.parent / "README.md"
if not README_PATH.exists():  # the wheel check runs tests/ alone, away from the checkout
    pytest.skip("needs the source tree's README.md", allow_module_level=True)
README = README_PATH.read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.MULTILINE | re.DOTALL)


def options_table() -> dict[str, str]:
    """The rows of the table that follows "Options (all keyword-only):",
    as {option: its default column}."""
    table = README.split("Options (all keyword-only):", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines()[2:]:  # below the header and its rule
        names, default = line.split("|")[1:3]
        for name in re.findall(r"`(\w+)`", names):
            rows[name] = default.strip()
    return rows


def test_the_options_table_lists_every_keyword_of_shmvecenv():
    keywords = {name for name, p in inspect.signature(shmvec.ShmVecEnv.__init__).parameters.items()
                if p.kind is p.KEYWORD_ONLY}
    keywords.discard("worker")  # AsyncVectorEnv's, refused; the text under the first example says why
    assert set(options_table()) == keywords
    assert "`worker` is refused" in README


def test_the_options_tables_literal_defaults_are_the_code_s():
    parameters = inspect.signature(shmvec.ShmVecEnv.__init__).parameters
    # Where the signature's default is None, the table says what None becomes
    # (start_method "forkserver", batch_size `num_envs`, autoreset_mode NEXT_STEP).
    literals = {name: default.strip("`").strip('"') for name, default in options_table().items()
                if re.fullmatch(r"`[^`]+`", default) and parameters[name].default is not None}
    assert len(literals) >= 6
    for name, written in literals.items():
        assert written == str(parameters[name].default), (name, written, parameters[name].default)


def test_every_python_block_is_python():
    assert len(PYTHON_BLOCKS) >= 5
    for block in PYTHON_BLOCKS:
        compile(block, "README.md", "exec")  # raises SyntaxError naming the line


@pytest.mark.timeout(120)
def test_the_first_example_runs_as_written(tmp_path):
    first = PYTHON_BLOCKS[0]
    assert "shmvec.ShmVecEnv(" in first and "envs.close()" in first
    script = tmp_path / "example.py"  # its own file: forkserver's workers import the main module
    script.write_text(first)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
