"""Training runs of an e2e module made in a fresh interpreter (`python -m <module> OUT`), for a module fixture."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_module(module: str, out: Path, timeout: int) -> Path:
    """Run `python -m module out` from the repository root (offline, vLLM's log at WARNING); fail with its output."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="WARNING")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    result = subprocess.run([sys.executable, "-m", module, str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{module} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return out
