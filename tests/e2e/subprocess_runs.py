"""Training runs of an e2e module made in a fresh interpreter (`python -m <module> OUT`), for a module fixture."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable, NoReturn

from tests.e2e.train_runs import REPO, train_env


def run_module(module: str, out: Path, timeout: int, *args: str | Path) -> Path:
    """Run `python -m module out [args]` from the repository root (offline, vLLM's log at WARNING); fail with its output."""
    env = {**train_env(), "VLLM_LOGGING_LEVEL": "WARNING"}
    result = subprocess.run([sys.executable, "-m", module, str(out), *map(str, args)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{module} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return out


def run_as_main(main: Callable[..., None]) -> NoReturn:
    """A runs module's command (`python -m <module> OUT [PATH ...]`): main(OUT, *PATHS), then the end of a CLI command
    (cli.finished)."""
    from megatron_rl.cli import finished

    main(*map(Path, sys.argv[1:]))
    sys.exit(finished(0))
