"""`python bench/gpu_suite.py --tiny` (what `make gpu-check` runs on a GPU, at tiny shapes on any device).

The suite checks its own numbers (actor vs transformers, packed vs padded, the
GSPO step's loss = -mean(A), its FLOP arithmetic vs the model's parameters);
here the JSON it writes is read back and its derived numbers recomputed by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_suite") / "gpu-tiny.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "bench/gpu_suite.py", "--tiny", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_tiny_run_passes_its_own_checks(tiny_run):
    proc, result = tiny_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["tiny"] is True and result["failed_checks"] == []
    names = set(result["checks"])
    for family in ("qwen3_moe", "deepseek_v3", "glm4_moe"):
        assert {f"logprobs/{family}", f"packed/{family}", f"gspo_step/{family}"} <= names
        assert result["logprobs"][family]["max_abs_err_vs_transformers"] <= 1e-5  # fp32, the same device: as the GPU run checks
    assert {"flop_params", "vocab_logprobs", "tests"} <= names and all(c["ok"] for c in result["checks"].values())
    tests = result["tests"]  # --tiny runs one quick test file through the same pytest section
    assert tests["returncode"] == 0 and tests["counts"].get("passed", 0) >= 1 and "failed" not in tests["counts"]


def test_mfu_and_throughput_follow_from_the_recorded_numbers(tiny_run):
    """MFU = (6 N + 12 L H Q S) x tokens/s / peak, with N, L, H, Q, S from the recorded model and batch (PaLM App. B)."""
    _, result = tiny_run
    speed = result["speed"]
    model, batch = speed["model"], speed["batch"]
    h, layers, heads, hd, e, k = (model[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                         "head_dim", "num_experts", "num_experts_per_tok"))
    kv, vocab, inter = model["num_key_value_heads"], model["vocab_size"], model["moe_intermediate_size"]
    # per layer: q, k, v, o projections, q/k norms, router, two norms, k of e experts (gate, up, down)
    per_layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd + h * e + 2 * h + k * 3 * h * inter
    n = layers * per_layer + vocab * h + h  # + output layer and final norm; the input embedding is a lookup
    s = batch["tokens_per_row"]
    train_flops = 6 * n + 12 * layers * heads * hd * s
    assert speed["train_flops_per_token"] == train_flops
    assert speed["forward_flops_per_token"] == 2 * n + 4 * layers * heads * hd * s
    tokens = batch["rows"] * batch["tokens_per_row"]
    for side in ("megatron_rl", "transformers"):
        r = speed[side]
        assert r["train_tokens_per_s"] == pytest.approx(tokens / r["train_step_s"], rel=1e-9)
        assert r["train_mfu_vs_measured"] == pytest.approx(train_flops * r["train_tokens_per_s"] / 1e12 / speed["peak_tflops_measured_bf16_matmul"], rel=1e-9)
        assert 0 < r["train_mfu_vs_measured"] and 0 < r["forward_mfu_vs_measured"]


def test_phases_and_kernel_ablations_are_recorded(tiny_run):
    """One profiled step splits into the named phases (none negative, together within the step's wall time),
    and each kernel choice undone in turn is a before/after ratio recomputed here from the recorded tokens/s."""
    from megatron_rl.actor.phases import PHASES

    _, result = tiny_run
    speed = result["speed"]
    phases = speed["megatron_rl"]["phases"]
    assert set(phases["phases_s"]) == set(PHASES) and all(v >= 0 for v in phases["phases_s"].values())
    assert sum(phases["phases_s"].values()) <= phases["wall_s"] * 1.05 + 1e-3
    assert phases["phases_s"]["experts"] > 0 and phases["phases_s"]["attention"] > 0
    ours, theirs = speed["megatron_rl"]["train_tokens_per_s"], speed["transformers"]["train_tokens_per_s"]
    assert speed["megatron_rl_over_transformers_train"] == pytest.approx(ours / theirs)
    assert set(speed["ablations"]) == {"experts_per_expert_gemm", "attention_per_sequence", "fusions_off", "megatron_dispatch",
                                       "padded_rows"}
    for run in speed["ablations"].values():
        assert run["all_on_over_this"] == pytest.approx(ours / run["train_tokens_per_s"])
