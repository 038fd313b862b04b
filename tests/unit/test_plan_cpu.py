"""`megatron-rl plan` on CPU clusters: the machine's memory is the budget, shared by the trainer processes on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.plan.memory import GIB
from megatron_rl.plan.report import plan_preset

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _machine_bytes() -> int:
    """MemTotal of /proc/meminfo, or the cgroup's memory limit where lower (read here, not through the planner)."""
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = Path(path).read_text().strip() if Path(path).exists() else ""
        if text.isdigit():
            total = min(total, int(text))
    return total


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="no /proc/meminfo on this system (Linux only)")
@pytest.mark.parametrize(("preset", "processes"), [("tiny-gspo.yaml", 1), ("tiny-gspo-cpu2.yaml", 2)])
def test_a_cpu_run_is_judged_by_the_machines_memory(preset, processes):
    plan = plan_preset(str(CONFIGS / preset))
    assert plan.budget == _machine_bytes() - processes * GIB  # each process's runtime (python, torch, megatron-core)
    peak = plan.peak
    # every rank holds an actor; rank 0 also the engine: the others' actors count against the same memory
    assert plan.need(peak) == pytest.approx(peak.total + (processes - 1) * peak.actor)
    assert plan.fits and "of this machine's memory" in plan.verdict()


def test_the_cpu_engine_counts_its_packed_embedding_and_output_layer():
    plan = plan_preset(str(CONFIGS / "tiny-gspo.yaml"))
    spec, engine = plan.spec, plan.engine
    vocab_matrix = 256 * 64 * 4  # the tiny model: vocabulary 256 (padded to 256) x hidden 64, fp32
    assert spec.padded_vocab(1) * spec.hidden_size * 4 == vocab_matrix
    # weights + a packed copy of the embedding and of the output layer + rollout.kv_cache_gib (1.0) + vLLM's 0.7 GiB
    assert engine.reserved == pytest.approx(spec.total_params() * 4 + 2 * vocab_matrix + 1.0 * GIB + 0.7 * GIB)


def test_a_cpu_run_over_the_machines_memory_says_so_in_its_terms():
    plan = plan_preset(str(CONFIGS / "tiny-gspo.yaml"), ["rollout.kv_cache_gib=100000"])
    verdict = plan.verdict()
    assert not plan.fits and "does not fit: in the training phase the run needs" in verdict
    assert "but this machine has" in verdict and "device" not in verdict
    assert verdict.endswith("100000 of them its KV cache: lower rollout.kv_cache_gib")


# ---- what a CPU training step holds (plan.memory: the unfused layers, the logits, the heap kept) ----

SMOLLM2_135M = {  # SmolLM2-135M-Instruct's config.json (the quickstart's model, converted from its GGUF file)
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "rope_theta": 100000.0,
}

LAYER_PROBE = """
import json, warnings
import torch
from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.models import build_model
from megatron_rl.models.tiny import tiny_hf_config
from megatron_rl.parallel import init_parallel

hf = tiny_hf_config("llama")
ctx = init_parallel(ParallelConfig())
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    (model,) = build_model(ModelConfig(path="unused", dtype="float32"), ctx, hf_config=hf, load_weights=False)
params = {p.untyped_storage().data_ptr() for p in model.parameters()}
layers = list(model.decoder.layers)
current = [None]
for index, layer in enumerate(layers):
    layer.register_forward_pre_hook(lambda module, args, index=index: current.__setitem__(0, index))
    layer.register_forward_hook(lambda module, args, out: current.__setitem__(0, None))
saved = {}
def pack(tensor):  # every storage autograd keeps for backward, once, by the layer that saved it
    storage = tensor.untyped_storage()
    if current[0] is not None and storage.data_ptr() not in params:
        saved.setdefault(storage.data_ptr(), (current[0], storage.nbytes()))
    return tensor
batch, seq = 4, 64
tokens = torch.randint(0, hf["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
positions = torch.arange(seq).unsqueeze(0).expand_as(tokens)
with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
    model(tokens, positions, attention_mask=None)
per_layer = [sum(n for i, n in saved.values() if i == index) for index in range(len(layers))]
print(json.dumps({"hf_config": hf, "batch": batch, "seq": seq, "per_layer_bytes": per_layer}))
"""


def test_what_autograd_saves_in_a_cpu_layer_is_the_plans_count(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.plan.memory import layer_activation_bytes
    from megatron_rl.plan.model_spec import spec_from_hf_config

    (tmp_path / "probe.py").write_text(LAYER_PROBE)
    # the CPU's layers (megatron's local spec, no fusions) on any machine: no GPU visible to the probe
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, str(tmp_path / "probe.py")], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.splitlines()[-1])
    hf, tokens, seq = probe["hf_config"], probe["batch"] * probe["seq"], probe["seq"]
    h, f, d = hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
    q, kv, heads = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d, hf["num_attention_heads"]
    # fp32 per token: norms 2 x (input, normalised input, output) + 2 x 1/rms; Q, K (after RoPE), the fused QKV
    # output (V is a view of it), the attention output; gate+up, silu(gate), up + offset, their product; statistics
    by_hand = 4 * (6 * h + 2 + (q + kv) + (q + 2 * kv) + q + 2 * f + f + f + f + heads)
    cpu = load_config(RLConfig, None, ["cluster.gpus_per_node=0"])
    assert layer_activation_bytes(spec_from_hf_config(hf), False, cpu, 4) == by_hand
    rope_tables = 4 * seq * d * 4  # cos and sin [positions, head_dim], saved by the products with Q and with K
    assert probe["per_layer_bytes"] == [tokens * by_hand + rope_tables] * hf["num_hidden_layers"]


def test_the_cpu_logits_and_the_heap_kept_by_hand():
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.plan.memory import stage_memory, phase_memory, engine_memory
    from megatron_rl.plan.model_spec import spec_from_hf_config

    hf = dict(SMOLLM2_135M, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=1000)
    spec = spec_from_hf_config(hf)
    cfg = load_config(RLConfig, None, ["model.path=x", "cluster.gpus_per_node=0", "train.micro_batch_size=2",
                                       "rollout.max_prompt_tokens=20", "rollout.max_new_tokens=12"])
    tokens, vocab, h = 2 * (20 + 12), 1024, 64  # megatron pads the vocabulary to a multiple of 128
    stage = stage_memory(spec, cfg, world=1, microbatches=4, stage=0)
    # 2 float32 copies of the [tokens, V] logits, the output layer's [V, h] weight gradient, and the final norm's
    # input, normalised input and the output layer's input
    assert stage.logits == 2 * tokens * vocab * 4 + vocab * h * 4 + 3 * tokens * h * 4
    per_layer = 4 * (6 * 64 + 2 + 3 * 64 + 3 * 32 + 5 * 128 + 4)  # h 64, q 64, kv 32, f 128, 4 heads (as above)
    assert stage.activations == 2 * tokens * per_layer
    assert stage.heap == 0.5 * stage.activations
    phases = {p.name: p for p in phase_memory(stage, engine_memory(spec, cfg), cfg, spec.total_params() * 4)}
    states = stage.weights + stage.grads + stage.optimizer
    assert phases["training"].actor == states + stage.activations + stage.logits + stage.heap + stage.batch_share
    # what the step freed stays resident (not the logits, given back): the push and the next generation hold it
    assert phases["push"].actor == phases["generation"].actor == states + stage.activations + stage.heap


@pytest.mark.parametrize(("algorithm", "measured_gib"), [("grpo", 13.9), ("dapo", 13.5), ("dr_grpo", 13.5)])
def test_the_quickstart_plan_covers_the_measured_peak(tmp_path, algorithm, measured_gib):
    """Maximum resident set size of `megatron-rl train` on the quickstart presets, measured with /usr/bin/time -v on a
    2-core machine (the vLLM CPU engine inside the trainer process; GRPO adds the reference model)."""
    import json

    from megatron_rl.plan.memory import CPU_RUNTIME_OVERHEAD_GIB

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    preset = CONFIGS / "quickstart" / f"smollm2-135m-{algorithm}-cpu.yaml"
    plan = plan_preset(str(preset), model_config=str(tmp_path / "config.json"))
    assert plan.launch.procs_per_node == 1
    process = plan.need(plan.peak) + CPU_RUNTIME_OVERHEAD_GIB * GIB  # the one process: its runtime, actor, engine
    assert process >= measured_gib * GIB, plan.verdict()
    assert plan.fits == (plan.need(plan.peak) <= _machine_bytes() - GIB)
    assert "this machine" in plan.verdict() and "device" not in plan.verdict()
