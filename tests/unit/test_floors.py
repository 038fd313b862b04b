"""tools/floors.py: the constraints `make test-floor` installs pin each of setup.py's core requirements to its floor."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_install import setup_py_requirements

REPO = Path(__file__).resolve().parents[2]


def _floors():
    spec = importlib.util.spec_from_file_location("floors", REPO / "tools" / "floors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_floor_becomes_a_pin_and_a_requirement_without_one_is_refused():
    floors = _floors()
    assert floors.floor_constraints(["torch>=2.11", "safetensors >= 0.8.0", "megatron-core>=0.16.1"]) == [
        "torch==2.11", "safetensors==0.8.0", "megatron-core==0.16.1"]
    for bad in ("numpy", "torch>=2.11,<3", "vllm==0.32.0"):
        with pytest.raises(SystemExit, match=f"core requirement {bad!r} has no single floor"):
            floors.floor_constraints([bad])


def test_setup_pys_floors_as_the_command_prints_them():
    """Run as make test-floor runs it (a bare venv's Python: the standard library only); torch's pin is TORCH_FLOOR."""
    from megatron_rl.parallel.availability import TORCH_FLOOR

    printed = subprocess.run([sys.executable, "-S", str(REPO / "tools" / "floors.py")], capture_output=True, text=True,
                             check=True, timeout=60).stdout.split()
    core, _ = setup_py_requirements()
    assert [line.split("==")[0] for line in printed] == [requirement.split(">=")[0] for requirement in core], printed
    assert f"torch=={'.'.join(map(str, TORCH_FLOOR))}" in printed
    assert "transformers==5.16.1" in printed and "megatron-core==0.16.1" in printed
