"""The layout planner: parameter counts, memory terms, layout checks, every preset, the CLI."""

import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_rl.cli import EXIT_CONFIG_ERROR, EXIT_DOES_NOT_FIT, main
from megatron_rl.config import ConfigError, RLConfig, load_config
from megatron_rl.plan.memory import GIB, layer_activation_bytes, stage_memory
from megatron_rl.plan.model_spec import spec_from_hf_config
from megatron_rl.plan.report import plan_preset, render

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
PRESETS = sorted(CONFIGS.glob("*.yaml"))


def _spec(name):
    return spec_from_hf_config(json.loads((CONFIGS / "models" / name / "config.json").read_text()))


# ---- parameter counts ----


@pytest.mark.parametrize(
    "name, total, active",
    [
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),  # model card: 30.5B total, 3.3B activated
        ("qwen3-235b-a22b", 235e9, 22e9),  # model card: 235B total, 22B activated
        ("mixtral-8x7b", 46.7e9, 12.9e9),  # Mistral AI: 46.7B total, 12.9B per token
    ],
)
def test_parameter_counts_match_the_published_totals(name, total, active):
    spec = _spec(name)
    assert spec.total_params() == pytest.approx(total, rel=0.02)
    assert spec.active_params() == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize(
    "name, total, active, active_counts_embeddings",
    [
        ("deepseek-v3", 671e9, 37e9, True),  # model card: 671B total, 37B activated (the multi-token-prediction layer not counted)
        ("glm-4.5-air", 106e9, 12e9, False),  # model card: 106B total, 12B active (embedding and LM head left out)
        ("moonlight-16b-a3b", 16e9, None, None),  # model card: 16B total
    ],
)
def test_sigmoid_router_families_match_the_published_totals(name, total, active, active_counts_embeddings):
    spec = _spec(name)
    assert spec.total_params() == pytest.approx(total, rel=0.02)
    if active is not None:
        counted = spec.active_params() - (0 if active_counts_embeddings else spec.embedding_params())
        assert counted == pytest.approx(active, rel=0.03)


def test_tiny_deepseek_v3_count_equals_a_hand_count_of_every_tensor():
    from megatron_rl.models.tiny import tiny_hf_config

    h, v, heads, nope, rope, vd, r_q, r_kv, e, f_e, f = 64, 256, 4, 32, 32, 32, 48, 32, 8, 32, 128
    attention = (h * r_q + r_q + r_q * heads * (nope + rope)  # q_a_proj, q_a_layernorm, q_b_proj
                 + h * (r_kv + rope) + r_kv + r_kv * heads * (nope + vd)  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
                 + heads * vd * h)  # o_proj
    norms = 2 * h
    dense = 3 * h * f
    moe = h * e + e + e * 3 * h * f_e + 3 * h * f_e  # gate weight + e_score_correction_bias, experts, one shared expert
    total = 2 * v * h + (attention + norms + dense) + 2 * (attention + norms + moe) + h
    spec = spec_from_hf_config(tiny_hf_config("deepseek_v3"))
    assert spec.moe_layers == (False, True, True)
    assert spec.total_params() == total
    assert spec.active_params() == total - 2 * (e - 2) * 3 * h * f_e


TINY_MOE = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 40,
    "moe_intermediate_size": 12,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "norm_topk_prob": True,
    "vocab_size": 100,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


def test_tiny_qwen3_moe_count_equals_a_hand_count_of_every_tensor():
    h, v, q, kv, d = 16, 100, 4 * 8, 2 * 8, 8
    attention = h * q + h * kv + h * kv + q * h + d + d  # q, k, v, o projections; q_norm, k_norm
    norms = h + h  # input_layernorm, post_attention_layernorm
    experts = 6 * (12 * h + 12 * h + h * 12)  # gate_proj, up_proj, down_proj of each expert
    router = h * 6
    dense_mlp = 40 * h * 3
    layers = 2 * (attention + norms + router + experts) + (attention + norms + dense_mlp)  # layer 1 is dense
    total = v * h + v * h + layers + h  # embed_tokens, lm_head, layers, final norm
    active = total - 2 * (6 - 2) * (3 * 12 * h)
    spec = spec_from_hf_config(TINY_MOE)
    assert spec.moe_layers == (True, False, True)
    assert (spec.total_params(), spec.active_params()) == (total, active)


def test_dense_and_shared_expert_families_by_hand():
    llama = dict(TINY_MOE, model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True)
    for key in ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "mlp_only_layers", "decoder_sparse_step"):
        llama.pop(key)
    h = 16
    layer = (h * 32 + 2 * h * 16 + 32 * h) + 2 * h + 3 * h * 40  # no q/k norms, no biases
    assert spec_from_hf_config(llama).total_params() == 100 * h + 3 * layer + h  # tied: one vocab matrix

    qwen2 = dict(llama, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    assert spec_from_hf_config(qwen2).total_params() == 100 * h + 3 * (layer + 32 + 2 * 16) + h  # q/k/v biases

    qwen2_moe = dict(TINY_MOE, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], shared_expert_intermediate_size=20)
    attention = h * 32 + 2 * h * 16 + 32 * h + 32 + 2 * 16  # biases, no q/k norms
    moe = h * 6 + 6 * 3 * h * 12 + 3 * h * 20 + h  # router, experts, shared expert, its gate
    expected = 2 * 100 * h + 2 * (attention + 2 * h + moe) + (attention + 2 * h + 3 * h * 40) + h
    assert spec_from_hf_config(qwen2_moe).total_params() == expected


def test_an_unsupported_architecture_is_named():
    with pytest.raises(ConfigError, match="gemma2"):
        spec_from_hf_config({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]})


# ---- memory terms ----


def _cfg(overrides):
    return load_config(RLConfig, None, overrides)


def test_activation_count_of_a_dense_layer_by_hand():
    llama = dict(TINY_MOE, model_type="llama", architectures=["LlamaForCausalLM"])
    for key in ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "mlp_only_layers", "decoder_sparse_step"):
        llama.pop(key)
    spec = spec_from_hf_config(llama)
    # Korthikanti et al. 2022 recount, bf16, t = 1: norm+qkv inputs 2h, Q/K/V/O 2q + 2kv, norm+fc1 inputs 2h,
    # gate/up/down-input 3f, plus fp32 softmax statistics per head.
    h, q, kv, f, a = 16, 32, 16, 40, 4
    expected = 2 * (2 * h + 2 * q + 2 * kv + 2 * h + 3 * f) + 4 * a
    gpu = ["cluster.gpus_per_node=8"]
    assert layer_activation_bytes(spec, False, _cfg(gpu), 2) == expected
    # tensor + sequence parallelism divides every stored tensor by t (their eq. 4: 34 sbh / t)
    tp2 = _cfg(gpu + ["parallel.tensor_parallel=2"])
    assert layer_activation_bytes(spec, False, tp2, 2) == pytest.approx(expected / 2)
    # On the CPU (no fusions) also each norm's normalised input (2 x h) and fp32 1 / rms (2 x 4 bytes), the fused
    # QKV output behind V's view (q + kv more) and the unfused glu's silu(gate) and up + offset (2f)
    cpu = 2 * (6 * h + 3 * q + 3 * kv + 5 * f) + 2 * 4 + 4 * a
    assert cpu == 904
    assert layer_activation_bytes(spec, False, _cfg([]), 2) == cpu


def test_activation_memory_of_each_recompute_choice_by_hand():
    spec = spec_from_hf_config(TINY_MOE)  # layers: MoE, dense, MoE; q/k norms
    base = ["model.path=x", "cluster.gpus_per_node=8", "train.max_tokens_per_microbatch=32"]
    # bf16 bytes per token, t = u = 1: a norm's input (or output) 2h = 32; Q, K, V, attention output and the
    # q/k norm inputs 2 (2q + 2kv + q + kv) = 2 (64 + 32 + 48) = 288; softmax statistics 4a = 16;
    # MoE block 2 k (2h + 3 f_e) + 8E = 2 x 2 x (32 + 36) + 48 = 320; dense block 2 x 3f = 240.
    norm, attention, stats, moe_block, dense_block = 32, 288, 16, 320, 240
    moe_layer = 4 * norm + attention + stats + moe_block  # 752
    dense_layer = 4 * norm + attention + stats + dense_block  # 672
    expected = {  # (kept over the 3 layers, the largest part rematerialised in one layer's backward)
        "none": (2 * moe_layer + dense_layer, 0),  # 2176
        "selective": (2 * moe_layer + dense_layer - 3 * stats, stats),  # 2128 + 16: the core attention's statistics
        "moe": (3 * (4 * norm + attention), moe_block),  # 1248 + 320: the norms and the attention's part kept
        "full": (3 * norm, moe_layer),  # 96 + 752: each layer's input kept
    }
    for mode, (kept, recomputed) in expected.items():
        mem = stage_memory(spec, _cfg(base + [f"model.recompute={mode}"]), world=1, microbatches=1, stage=0)
        assert mem.activations == 32 * (kept + recomputed), mode
    assert [32 * sum(v) for v in expected.values()] == [69632, 68608, 50176, 27136]


def test_recompute_activations_was_replaced_by_recompute():
    with pytest.raises(ConfigError, match="set model.recompute=full"):
        _cfg(["model.path=x", "model.recompute_activations=true"])


def test_optimizer_state_shards_over_dp_and_expert_dp():
    spec = _spec("qwen3-30b-a3b")
    cfg = load_config(RLConfig, CONFIGS / "qwen3-30b-a3b-gspo-4x8h100.yaml")
    mem = stage_memory(spec, cfg, world=32, microbatches=4, stage=0)
    # TP 2: each rank holds half of the attention and embeddings; EP 8: 16 of 128 experts of every layer
    experts = 48 * 16 * 3 * 2048 * 768
    assert mem.expert_params == experts
    assert mem.weights == pytest.approx(2 * (mem.dense_params + experts))
    assert mem.grads == pytest.approx(4 * (mem.dense_params + experts))
    dp, expert_dp = 32 // 2, 32 // 8
    assert mem.optimizer == pytest.approx(12 * (mem.dense_params / dp + experts / expert_dp))


def test_recompute_and_pipeline_in_flight_microbatches():
    spec = _spec("qwen3-30b-a3b")
    base = ["model.path=x", "cluster.gpus_per_node=8", "parallel.pipeline_parallel=4", "train.max_tokens_per_microbatch=4096"]
    plain = stage_memory(spec, _cfg(base), world=8, microbatches=8, stage=0).activations
    few = stage_memory(spec, _cfg(base), world=8, microbatches=2, stage=0).activations
    last = stage_memory(spec, _cfg(base), world=8, microbatches=8, stage=3).activations
    assert plain == pytest.approx(2 * few)  # 1F1B: the first stage holds min(PP, microbatches) microbatches
    assert plain == pytest.approx(4 * last)  # ... and the last stage one
    recompute = stage_memory(spec, _cfg(base + ["model.recompute=full"]), world=8, microbatches=8, stage=0)
    inputs = 4 * (48 // 4) * 4096 * 2048 * 2  # 4 microbatches x 12 layers x each layer's bf16 input
    one_layer = plain / 4 / 12  # plus one layer rematerialised in backward
    assert recompute.activations == pytest.approx(inputs + one_layer)


# ---- checks ----


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_passes_the_planner(path):
    plan = plan_preset(str(path))
    assert plan.fits, plan.verdict()
    out = io.StringIO()
    from rich.console import Console

    render(plan, Console(file=out, width=200))
    assert "fits:" in out.getvalue()
    # where the old-policy logprobs come from (config.schema.old_logprobs_source), e.g. the large presets' 4 mini-batches
    steps = plan.cfg.train.mini_batches_per_step
    expected = "the training forward's own" if steps == 1 else f"the first of {steps} mini-batches' training forward"
    if plan.cfg.algorithm.tis_mode not in ("none", "token", "sequence"):
        expected = "a forward of their own"
    assert expected in " ".join(out.getvalue().split()), out.getvalue()


def test_the_large_models_do_not_fit_one_node_and_the_message_names_the_numbers(capsys):
    code = main(["plan", "--config", str(CONFIGS / "qwen3-30b-a3b-gspo-4x8h100.yaml"), "cluster.nodes=1"])
    assert code == EXIT_DOES_NOT_FIT
    out = capsys.readouterr().out
    assert "does not fit" in out and "GiB per device" in out and "optimizer" in out


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.expert_parallel=3"], "world size 32 is not divisible"),
        (["cluster.nodes=16", "cluster.gpus_per_node=2", "parallel.tensor_parallel=4"], "straddle nodes"),
        (["parallel.sequence_parallel=false"], "needs sequence parallelism"),
        (["rollout.tensor_parallel=3"], "does not divide gpus_per_node=8"),
        (["rollout.tensor_parallel=8", "rollout.pipeline_parallel=3"], "not divisible by one engine"),
        (["rollout.gpu_memory_utilization=0.05"], "KV cache holds 0 tokens"),
        (["cluster.rollout_gpus=4"], "not a whole number of 8-GPU nodes"),
        (["rollout.max_new_tokens=40000"], "exceeds the model's max_position_embeddings=40960"),
        (["algorithm.overlong_buffer=8192"], "overlong_buffer=8192 must be below"),
        (["train.prompts_per_step=1", "rollout.n_samples=4", "train.mini_batches_per_step=1"], "cannot feed 16"),
        (["train.max_tokens_per_microbatch=4096"], "below one full-length sequence"),
    ],
)
def test_impossible_layouts_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_preset(str(CONFIGS / "qwen3-30b-a3b-gspo-4x8h100.yaml"), overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.pack_sequences=false"], "context_parallel=4 splits packed sequences"),
        # 1,024 + 32,768 = 33,792 tokens, already a multiple of 2 x CP x TP = 16
        (["train.max_tokens_per_microbatch=33791"], "33792 padded to a multiple of 16"),
        (["rollout.max_new_tokens=40000"], "exceeds the model's max_position_embeddings=40960"),
    ],
)
def test_long_response_presets_name_what_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_preset(str(CONFIGS / "qwen3-30b-a3b-gspo-32k-cp4-4x8h100.yaml"), overrides)


def test_batch_share_is_this_dp_ranks_rows_with_their_routes():
    spec = _spec("qwen3-30b-a3b")
    cfg = load_config(RLConfig, CONFIGS / "qwen3-30b-a3b-gspo-32k-cp4-4x8h100.yaml")
    # TP 2 x CP 4 x DP 4 = 32: 64 prompts x 8 samples / 4 DP ranks = 128 rows of 33,792 tokens; float32
    # logprobs + the recorded routes of this rank's tokens (1 / (SP 2 x CP 4)): an 8-byte key and
    # 48 MoE layers x top-8 uint8 expert ids (128 experts) per token.
    assert cfg.parallel.pipeline_parallel == 1 and cfg.algorithm.routing_replay != "R3"
    mem = stage_memory(spec, cfg, world=32, microbatches=32, stage=0)
    assert mem.batch_share == 128 * 33792 * 4 + 128 * 33792 / 8 * (8 + 48 * 8)
    halved = stage_memory(spec, cfg, world=64, microbatches=32, stage=0)  # DP 8: half the rows
    assert halved.batch_share == pytest.approx(mem.batch_share / 2)
    # R3: the engine's routes arrive with the rows and are cut to what this rank replays: the same tokens and
    # layers as recorded ones (not the rows' whole [S, T, 48, 8], 8x more at SP 2 x CP 4)
    r3_overrides = ["algorithm.routing_replay=R3", "rollout.return_routed_experts=true", "rollout.routed_experts_include_prompt=true",
                    "rollout.enforce_eager=true"]  # the capture runs eagerly (config.rollout)
    r3 = load_config(RLConfig, CONFIGS / "qwen3-30b-a3b-gspo-32k-cp4-4x8h100.yaml", r3_overrides)
    assert stage_memory(spec, r3, world=32, microbatches=32, stage=0).batch_share == mem.batch_share
    # engine routes for the drift metrics only (no replay): kept whole (int8 for 128 experts), + the recorded ones
    metrics_only = load_config(RLConfig, CONFIGS / "qwen3-30b-a3b-gspo-32k-cp4-4x8h100.yaml",
                               ["algorithm.routing_replay=none", *r3_overrides[1:]])
    assert stage_memory(spec, metrics_only, world=32, microbatches=32, stage=0).batch_share == mem.batch_share + 128 * 33792 * 48 * 8


def test_dedicated_rollout_gpus_shrink_the_trainer_and_free_its_memory():
    plan = plan_preset(
        str(CONFIGS / "qwen3-30b-a3b-gspo-4x8h100.yaml"),
        ["cluster.rollout_gpus=8", "parallel.expert_parallel=8", "rollout.gpu_memory_utilization=0.9",
         "rollout.engine=vllm_server", "rollout.server_urls=[http://rollout-1:8000]"],
    )
    assert (plan.launch.nodes, plan.launch.world, plan.data_parallel, plan.engines) == (3, 24, 12, 2)
    assert plan.budget == pytest.approx((80 - 3) * GIB)  # the whole GPU minus the runtime


def test_colocated_engines_are_counted_as_the_trainer_starts_them():
    # 32 GPUs, TP 4 engines: one per 4 GPUs, hosted by ranks 0, 4, ..., 28 (megatron_rl.rollout.colocated)
    assert plan_preset(str(CONFIGS / "qwen3-30b-a3b-gspo-4x8h100.yaml")).engines == 8
    assert plan_preset(str(CONFIGS / "qwen3-30b-a3b-gspo-4x8h100.yaml"), ["rollout.engines=2"]).engines == 2
    with pytest.raises(ConfigError, match="sets GPUs aside for rollout"):  # an in-process engine cannot reach them
        plan_preset(str(CONFIGS / "qwen3-30b-a3b-gspo-4x8h100.yaml"), ["cluster.rollout_gpus=8", "parallel.expert_parallel=8"])
    # one TP 8 engine per node (the preset), and TP 8 x PP 2 spanning two nodes: rank 0's single engine, and the plan
    # says the rest wait
    assert plan_preset(str(CONFIGS / "qwen3-235b-a22b-gspo-32x8h100.yaml")).engines == 32
    big = plan_preset(str(CONFIGS / "qwen3-235b-a22b-gspo-32x8h100.yaml"),
                      ["rollout.pipeline_parallel=2", "rollout.gpu_memory_utilization=0.45"])
    assert big.engines == 1
    assert any("spans 16 GPUs over nodes" in w and "the other 240 GPUs wait" in w for w in big.warnings), big.warnings


def test_launch_env_reads_only_the_cluster(capsys):
    assert main(["plan", "--launch-env", "--config", str(CONFIGS / "tiny-gspo-cpu2.yaml")]) == 0
    run = "MAX_RESTARTS=3\nLOG_DIR=outputs\n"  # cluster.max_restarts's default, logging.dir's
    no_servers = "ROLLOUT_NODES=0\nSERVERS_PER_NODE=0\nGPUS_PER_SERVER=0\n" + run
    assert capsys.readouterr().out == "NNODES=1\nNPROC_PER_NODE=2\n" + no_servers
    assert main(["plan", "--launch-env", "--config", str(CONFIGS / "qwen3-235b-a22b-gspo-32x8h100.yaml")]) == 0
    assert capsys.readouterr().out == "NNODES=32\nNPROC_PER_NODE=8\n" + no_servers
    # 8 GPUs of 32 set aside for TP 2 servers: 3 trainer nodes, one rollout node of 4 servers
    servers = ["cluster.rollout_gpus=8", "rollout.engine=vllm_server", "rollout.tensor_parallel=2"]
    assert main(["plan", "--launch-env", "--config", str(CONFIGS / "qwen3-30b-a3b-gspo-4x8h100.yaml"), *servers]) == 0
    assert capsys.readouterr().out == "NNODES=3\nNPROC_PER_NODE=8\nROLLOUT_NODES=1\nSERVERS_PER_NODE=4\nGPUS_PER_SERVER=2\n" + run
    assert main(["plan", "--server-urls", "gpu9", "--server-port", "9000", "--config", str(CONFIGS / "qwen3-30b-a3b-gspo-4x8h100.yaml"), *servers]) == 0
    urls = ", ".join(f"http://gpu9:{port}" for port in (9000, 9001, 9002, 9003))
    assert capsys.readouterr().out == f"rollout.server_urls=[{urls}]\n"
    # servers given by URL are not started by the script
    given = [*servers, "rollout.server_urls=[http://r:8000]"]
    assert main(["plan", "--launch-env", "--config", str(CONFIGS / "qwen3-30b-a3b-gspo-4x8h100.yaml"), *given]) == 0
    assert capsys.readouterr().out == "NNODES=3\nNPROC_PER_NODE=8\n" + no_servers


def test_model_config_option_and_missing_model(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY_MOE))
    preset = str(CONFIGS / "tiny-gspo.yaml")
    assert main(["plan", "--config", preset, "--model-config", str(tmp_path / "config.json"), "parallel.expert_parallel=2"]) == (
        EXIT_CONFIG_ERROR  # one CPU process cannot hold EP 2
    )
    assert "world size 1" in capsys.readouterr().err
    # The tiny presets build their model on first use at their own path (or with model.make_tiny=true), so the
    # planner plans the model they will build ...
    assert main(["plan", "--config", preset, f"model.path={tmp_path / 'nowhere'}", "model.make_tiny=true"]) == 0
    # ... and any other missing model is an error: a typed path that does not exist, or no tiny family.
    assert main(["plan", "--config", preset, f"model.path={tmp_path / 'nowhere'}"]) == EXIT_CONFIG_ERROR
    assert f"model.path={str(tmp_path / 'nowhere')!r} does not exist" in capsys.readouterr().err
    assert main(["plan", "--config", preset, f"model.path={tmp_path / 'nowhere'}", 'model.make_tiny_if_missing=""']) == EXIT_CONFIG_ERROR
    assert "does not exist" in capsys.readouterr().err


# ---- the command line ----


def test_help_is_fast_and_imports_nothing_heavy():
    code = (
        "import sys, megatron_rl.cli as c\n"
        "try:\n    c.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'megatron.core', 'transformers', 'vllm') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "train" in result.stdout and "plan" in result.stdout


def test_train_calls_the_trainer_with_the_config_and_overrides(monkeypatch):
    calls = []
    fake = types.ModuleType("megatron_rl.trainer")
    fake.main = lambda config_path, overrides, stop: calls.append((config_path, overrides, type(stop).__name__))
    monkeypatch.setitem(sys.modules, "megatron_rl.trainer", fake)
    import megatron_rl

    monkeypatch.setattr(megatron_rl, "trainer", fake, raising=False)
    assert main(["train", "--config", "configs/tiny-gspo.yaml", "train.steps=2", "algorithm.eps_high=4e-4"]) == 0
    # the trainer also gets the pre-emption signals (SIGTERM / SIGUSR1: save at the next step boundary)
    assert calls == [("configs/tiny-gspo.yaml", ["train.steps=2", "algorithm.eps_high=4e-4"], "StopSignals")]


def test_train_with_a_bad_key_says_which_before_starting(capsys):
    # the config is checked before any process group, model or engine exists
    assert main(["train", "--config", "configs/tiny-gspo.yaml", "algorithm.eps_hgh=1"]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "'algorithm.eps_hgh'" in err and "eps_high" in err


# ---- phases: what offload and sleep free on a colocated GPU ----

ONE_NODE = CONFIGS / "qwen3-30b-a3b-gspo-1x8h100.yaml"


def _qwen3_30b_on_one_node_by_hand():
    """Qwen3-30B-A3B on one device of 1x8 H100 (TP 2, EP 8, DP 4, expert-DP 1), counted from its config.json."""
    h, layers, vocab_padded = 2048, 48, 152064  # vocab 151,936 padded to a multiple of 128 x TP
    split = 2048 * 4096 * 2 + 2 * 2048 * 512  # q and o (32 heads x 128), k and v (4 heads x 128): over TP 2
    replicated = 2 * h + 2 * 128 + h * 128  # two norms, q/k norms, router (128 experts)
    dense = layers * (replicated + split / 2) + 2 * (vocab_padded / 2) * h + h  # untied embedding + output, final norm
    experts = layers * (128 // 8) * 3 * h * 768  # 16 of 128 experts per layer on this rank
    total_hf = layers * (replicated + split + 128 * 3 * h * 768) + 2 * 151936 * h + h  # the whole model, unpadded
    return dense, experts, total_hf


def test_phases_of_the_one_node_preset_equal_a_hand_count():
    plan = plan_preset(str(ONE_NODE))
    cfg = plan.cfg
    assert (cfg.train.offload, cfg.rollout.sleep_level, cfg.cluster.rollout_gpus) == ("all", 2, 0)
    dense, experts, total_hf = _qwen3_30b_on_one_node_by_hand()
    assert (plan.stage.dense_params, plan.stage.expert_params) == (dense, experts)
    weights = 2 * (dense + experts)  # bf16
    grads = 4 * (dense + experts)  # fp32 gradient buffer
    optimizer = 12 * (dense / 4 + experts / 1)  # fp32 main copy + Adam's two moments, over DP 4 / expert-DP 1
    engine_awake = 0.8 * 80 * GIB  # gpu_memory_utilization x the GPU
    engine_weights = 2 * total_hf / 4  # bf16 over the engine's TP 4
    engine_asleep = 2 * GIB  # vLLM's own buffers (plan.memory.ENGINE_OVERHEAD_GIB); eager: no CUDA graphs
    buckets = 5 * 512 * 2**20  # 2 on the pushing rank + 3 on an engine worker, 512 MB each
    phases = {p.name: p for p in plan.phases}
    # generation: every state of the actor on the host, the engine awake
    assert (phases["generation"].actor, phases["generation"].engine) == (0, engine_awake)
    # training: the whole actor, the engine asleep at level 2
    activations = plan.stage.activations + plan.stage.logits + plan.stage.batch_share
    assert phases["training"].actor == pytest.approx(weights + grads + optimizer + activations)
    assert phases["training"].engine == engine_asleep
    # push: optimizer state and gradients already on the host; parameters + the woken engine weights + buckets
    assert phases["push"].actor == pytest.approx(weights)
    assert phases["push"].engine == pytest.approx(engine_weights + engine_asleep)
    assert phases["push"].push_buffers == buckets
    assert plan.budget == (80 - 3) * GIB
    assert plan.peak.name == "training" and plan.fits, plan.verdict()


@pytest.mark.parametrize(
    "overrides, peak, names",
    [
        (["train.offload=none"], "generation", "train.offload=none"),
        (["train.offload=optimizer"], "generation", "train.offload=optimizer"),
        (["rollout.sleep_level=0"], "training", "rollout.sleep_level=0"),
        # CUDA graphs stay while vLLM sleeps: 2 GiB more beside the training actor, 77.5 of 77 GiB
        (["rollout.enforce_eager=false"], "training", "keeps its CUDA graphs"),
    ],
)
def test_without_offload_or_sleep_the_one_node_preset_is_refused_before_launch(overrides, peak, names, capsys):
    dense, experts, _ = _qwen3_30b_on_one_node_by_hand()
    plan = plan_preset(str(ONE_NODE), overrides)
    assert not plan.fits and plan.peak.name == peak
    if overrides == ["train.offload=optimizer"]:  # parameters and gradients stay beside the engine
        assert plan.peak.actor == pytest.approx(6 * (dense + experts))
    if overrides == ["rollout.enforce_eager=false"]:  # the eager engine's 2 GiB asleep, plus its graphs' 2 GiB
        assert plan.peak.engine == 4 * GIB and plan.peak.total > plan.budget
    # what the launch scripts run before they start a process: exit 2, the verdict naming the setting
    assert main(["plan", "--check", "--config", str(ONE_NODE), *overrides]) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert f"does not fit: in the {peak} phase" in err and names in err
    assert ("rollout.enforce_eager=true" if "graphs" in names else "rollout.sleep_level=2") in err
    assert main(["plan", "--check", "--config", str(ONE_NODE)]) == 0
    assert capsys.readouterr() == ("", "")


def test_offload_and_sleep_free_nothing_on_cpu():
    plain = plan_preset(str(CONFIGS / "tiny-gspo.yaml"))
    handed_off = plan_preset(str(CONFIGS / "tiny-gspo.yaml"), ["train.offload=all", "rollout.sleep_level=2"])
    assert [p.total for p in handed_off.phases] == [p.total for p in plain.phases]
    engine = plain.engine.reserved  # the in-process engine shares rank 0's memory in every phase
    assert all(p.engine == engine for p in plain.phases)
    assert plain.phases[1].actor == plain.stage.total
