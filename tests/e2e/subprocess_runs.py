"""Training runs of an e2e module made in a fresh interpreter (`python -m <module> OUT`), for a module fixture.

Under pytest-xdist (make test: 2 workers on a 2-core machine) such a run, one process for minutes, runs on its
worker's share of the cores, as a job given its cores by a scheduler would: the project sizes a process's threads by
the cores it may run on (parallel.threads.available_cores), so it takes one thread there instead of two that spin
against the other worker's processes. In a whole `make test` with every process of each worker pinned, the agent
and async modules took 0.79x and 0.65x their time in the unpinned suite run next; tests of several processes took
up to 1.3x (one core for all their ranks), so they, and shorter runs, stay free to use every core.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.train_runs import REPO, train_env

CORES_VARIABLE = "MEGATRON_RL_TEST_CORES"


def worker_cores() -> list[int]:
    """This pytest-xdist worker's share of the cores this process may run on (worker i of n: the i-th n-th); empty
    outside xdist, with one worker, with fewer cores than workers, or where the platform has no CPU affinity."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_getaffinity"):
        return []
    cores = sorted(os.sched_getaffinity(0))
    index = int(worker[2:])
    return cores[index * len(cores) // count : (index + 1) * len(cores) // count] if len(cores) >= count else []


def pin_run() -> None:
    """In the run's process, first (before torch sizes its thread pool): run on the cores run_module chose."""
    cores = os.environ.get(CORES_VARIABLE, "")
    if cores:
        os.sched_setaffinity(0, {int(core) for core in cores.split(",")})


def run_module(module: str, out: Path, timeout: int) -> Path:
    """Run `python -m module out` from the repository root (offline, vLLM's log at WARNING), on this worker's share of
    the cores where it has one (the module calls pin_run); fail with its output."""
    env = {**train_env(), "VLLM_LOGGING_LEVEL": "WARNING", CORES_VARIABLE: ",".join(map(str, worker_cores()))}
    result = subprocess.run([sys.executable, "-m", module, str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{module} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return out
