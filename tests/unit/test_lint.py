"""`make lint`: ruff with the settings in pyproject.toml passes on the tree, and CI runs it before the tests."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _ruff():
    local = Path(sys.executable).parent / "ruff"  # setup.py's test extra
    return str(local) if local.exists() else shutil.which("ruff")


@pytest.mark.extra("test", "bin:ruff")  # skipped without it, naming the extra (fails under make test)
def test_ruff_passes_on_the_tree():
    assert _ruff() is not None, "ruff is missing: pip install ruff (setup.py's test extra)"
    assert "[tool.ruff" in (REPO / "pyproject.toml").read_text(), "pyproject.toml has no [tool.ruff] settings"
    result = subprocess.run([_ruff(), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_make_lint_runs_ruff_and_shellcheck_and_ci_runs_it_before_the_tests():
    makefile = (REPO / "Makefile").read_text()
    rule = re.search(r"^lint:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    assert rule is not None, "the Makefile's lint target has no recipe"
    assert "ruff check" in rule.group(1) and "shellcheck" in rule.group(1) and "launch/" in rule.group(1)
    commands = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "make lint" in commands and "make test" in commands
    assert commands.index("make lint") < commands.index("make test")


def test_pyproject_leaves_the_build_to_setup_py():
    # A build-system or project table would make pip build from pyproject.toml instead of setup.py.
    tables = re.findall(r"^\[+([^\]]+)\]", (REPO / "pyproject.toml").read_text(), flags=re.MULTILINE)
    assert tables and all(name.startswith("tool.") for name in tables), tables
