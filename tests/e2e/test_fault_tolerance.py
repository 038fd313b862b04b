"""A two-process run under the launch scripts' torchrun survives a dead rank and a pre-emption on its own.

One launch (`python -m megatron_rl.elastic --max-restarts=1`, what launch/torchrun.sh runs) of 4 steps that saves
every 2:
1. once step_00000002 is complete, rank 1 is killed with SIGKILL in the middle of the next step; torchrun starts both
   ranks again, and they resume from step 2, saying that they restarted and why;
2. the restarted run is sent SIGTERM (as a scheduler pre-empting the job does) while it starts up: both ranks save at
   the next step boundary (step 3, which save_every=2 would not save), the launcher exits 3 and nothing half-written
   is left;
3. the next launch resumes from step 3 and finishes.
The final weights and optimizer state equal those of an uninterrupted run (run beside it), element for element,
read from the two megatron dist checkpoints with torch's own reader; the reward (the parity of the response text's
CRC-32) gives the steps before the save and after the resume gradients, so a resume that restored the optimizer
state wrongly (Adam's step count) would show.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)
from megatron_rl.errors import EXIT_PREEMPTED
from megatron_rl.metrics import read_metrics
from megatron_rl.models.tiny import make_tiny_model_dir
from tests.e2e.train_runs import PARITY

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="WARNING")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def _launch(model_dir: Path, out: Path, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "megatron_rl.elastic", f"--log-file={out / 'logs' / 'torchrun.log'}", "--standalone",
            "--nproc-per-node=2", f"--max-restarts={max_restarts}", "-m", "megatron_rl.cli", "train",
            "--config", str(REPO / "configs" / "tiny-gspo-cpu2.yaml"), f"model.path={model_dir}", f"logging.dir={out}",
            f"checkpoint.dir={out / 'ckpt'}", "logging.progress_bar=false", "train.prompts_per_step=2", "rollout.n_samples=4",
            f"train.steps={STEPS}", "checkpoint.save_every=2", "checkpoint.keep_last=5", "checkpoint.resume=auto",
            PARITY]  # groups that differ: gradients (the exact reward gave none)


def _start(cmd: list[str], console: Path) -> subprocess.Popen:
    with open(console, "w") as sink:
        return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=sink, stderr=subprocess.STDOUT)


def _wait_for(what: str, ready, proc: subprocess.Popen, console: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}:\n{console.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s:\n{console.read_text()[-4000:]}"
        time.sleep(0.01)


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of the trainer process of `rank` among the launcher's children (its RANK environment variable)."""
    for child in psutil.Process(launcher).children():
        try:
            if child.environ().get("RANK") == str(rank):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no child of {launcher} runs rank {rank}")


def _latest(ckpt: Path) -> str:
    latest = ckpt / "latest"
    return latest.read_text().strip() if latest.is_file() else ""


def _saved_state(step_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a megatron dist checkpoint (model and optimizer), read in one process by torch's DCP reader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(scratch))
    return torch.load(scratch, weights_only=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny-moe", "qwen3_moe", seed=0)


def test_dead_rank_and_preemption_end_in_the_weights_of_an_uninterrupted_run(model_dir, tmp_path):
    reference = _start(_launch(model_dir, tmp_path / "reference", 0), tmp_path / "reference.txt")
    run, console = tmp_path / "run", tmp_path / "run.txt"
    ckpt, proc = run / "ckpt", None
    try:
        proc = _start(_launch(model_dir, run, 1), console)
        _wait_for("checkpoint of step 2", lambda: _latest(ckpt) == "step_00000002", proc, console)
        os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)  # in the step after the save
        _wait_for("restart", lambda: "torchrun restart 1 of 1" in console.read_text(), proc, console)
        proc.send_signal(signal.SIGTERM)  # while the restarted ranks start: they stop at the next step boundary
        code = proc.wait(timeout=300)
        text = console.read_text()
        assert code == EXIT_PREEMPTED, text[-4000:]
        assert "resumed from" in text and "step_00000002 at step 2" in text, text[-4000:]
        # the launcher names the killed rank when torchrun restarts the ranks (its error file holds nothing)
        assert "rank 1 (pid" in text and "was killed by SIGKILL" in text and "restart 1 of 1" in text, text[-4000:]
        assert "stopped by SIGTERM" in text.splitlines()[-1], text[-4000:]
        assert "Traceback" not in text, text[-4000:]
        assert _latest(ckpt) == "step_00000003" and not list(ckpt.glob(".*partial")), sorted(p.name for p in ckpt.iterdir())

        console = tmp_path / "resumed.txt"
        proc = _start(_launch(model_dir, run, 0), console)
        assert proc.wait(timeout=300) == 0, console.read_text()[-4000:]
        assert "step_00000003 at step 3" in console.read_text()
        assert "differs" not in text + console.read_text()  # megatron's warning: ranks saved unequal optimizer state
        assert reference.wait(timeout=300) == 0, (tmp_path / "reference.txt").read_text()[-4000:]
    finally:
        for each in (reference, proc):
            if each is not None and each.poll() is None:
                each.kill()
                each.wait()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(STEPS))
    # steps after the resume moved the weights (the exact reward on the random model gave no gradient at all: equal
    # weights proved nothing about the optimizer state a resume reads back, e.g. Adam's step count)
    grad_norms = [r["grad_norm"] for r in read_metrics(tmp_path / "reference" / "metrics.jsonl")]
    assert any(g > 0 for g in grad_norms[:2]) and any(g > 0 for g in grad_norms[2:]), grad_norms  # saved; resumed
    want = _saved_state(tmp_path / "reference" / "ckpt" / f"step_{STEPS:08d}", tmp_path / "want.pt")
    got = _saved_state(ckpt / f"step_{STEPS:08d}", tmp_path / "got.pt")
    tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    assert sorted(got) == sorted(want) and len(tensors) > 10
    assert any(k.startswith("decoder.") for k in tensors) and any("optimizer" in k for k in tensors), tensors[:20]
    for key in tensors:
        assert torch.equal(got[key], want[key]), f"{key} differs from the uninterrupted run"
