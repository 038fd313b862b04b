"""megatron logits == transformers logits (fp32, 1e-4) for every supported family, single process.

The reference is transformers' own implementation of each family, loaded from
the same tiny checkpoint in this process; megatron's model is built from the
config.json alone and loaded through megatron_rl's mapping.
"""

from __future__ import annotations

import warnings

import pytest
import torch

VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama": ("llama", {}),
    "qwen2_moe": ("qwen2_moe", {}),  # shared expert with a sigmoid gate, no renormalisation
    # Vocabulary 200 (megatron pads to 256), tied embeddings, dense layer 1, no top-k
    # renormalisation, 12 safetensors shards with an index.
    "qwen3_moe_variant": (
        "qwen3_moe",
        dict(vocab_size=200, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=True, max_shard_size="100KB"),
    ),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True, vocab_size=300)),
    # Top-1 without renormalisation: the weight is the chosen expert's softmax probability.
    "qwen3_moe_top1": ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=False)),
    # Multi-latent attention, sigmoid router with a random expert bias, 2 expert groups, routed scaling,
    # a shared expert, dense layer 0; init std 0.1 so routing is far from uniform (logits up to ~3).
    "deepseek_v3": ("deepseek_v3", dict(init_std=0.1)),
    # q/k/v biases, q/k norms, half of each head rotated, sigmoid router with expert bias, 2 groups, dense layer 0.
    "glm4_moe": ("glm4_moe", dict(init_std=0.1)),
    "glm4_moe_air": ("glm4_moe", dict(init_std=0.1, use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0)),
    # Routed experts as megatron-core's GroupedMLP (fused weight1 / weight2; on CPU the compatibility layer's grouped GEMM).
    "qwen3_moe_grouped": ("qwen3_moe", {}, {"moe_grouped_gemm": True}),
    "deepseek_v3_grouped": ("deepseek_v3", dict(init_std=0.1), {"moe_grouped_gemm": True}),
    # Rotary rows stored in halves, queries without a latent, YaRN scaling, no groups.
    "deepseek_v3_variant": (
        "deepseek_v3",
        dict(
            init_std=0.1,
            rope_interleave=False,
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        ),
    ),
}


@pytest.fixture(scope="module")
def parallel_ctx():
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig())
    yield ctx
    destroy_parallel(ctx)


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models_logits")


def grouped_experts_refused_here() -> bool:
    """fp32 grouped experts on a GPU without Transformer Engine: megatron's GroupedMLP kernels are bf16-only
    (and need the grouped_gemm package), so models.build refuses them; on a CPU build the compatibility
    layer's torch grouped GEMM runs them, with TE TEGroupedMLP does."""
    from megatron_rl.parallel.availability import detect

    avail = detect()
    return avail.cuda and not avail.transformer_engine


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, parallel_ctx, model_root):
    from transformers import AutoModelForCausalLM

    from megatron_rl.config import ConfigError, ModelConfig
    from megatron_rl.models import build_model
    from megatron_rl.models.tiny import make_tiny_model_dir

    family, overrides, *settings = VARIANTS[variant]
    model_dir = make_tiny_model_dir(model_root / variant, family, seed=1, with_tokenizer=False, **overrides)
    # float32 on every device (auto would be bfloat16 on a GPU): the 1e-4 tolerance is fp32's.
    model_cfg = ModelConfig(path=str(model_dir), dtype="float32", **(settings[0] if settings else {}))
    if settings and grouped_experts_refused_here():
        with pytest.raises(ConfigError, match="model.moe_grouped_gemm=true"):
            build_model(model_cfg, parallel_ctx)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # on the CPU: the reference
        (model,) = build_model(model_cfg, parallel_ctx)
    if settings:
        grouped = {"GroupedMLP", "TEGroupedMLP"}
        assert all(type(layer.mlp.experts).__name__ in grouped for layer in model.decoder.layers if hasattr(layer.mlp, "experts"))
    model.eval()
    vocab = reference.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    device = parallel_ctx.device  # the model's device
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model(tokens.to(device), positions.to(device), attention_mask=None).cpu()
    assert got.shape[-1] == model.hf_info.padded_vocab_size
    err = (got[..., :vocab] - expected).abs().max().item()
    assert err < 1e-4, f"{variant}: max |megatron - transformers| = {err:.3g}"
    # The padding rows are zero, so padded logits are exactly 0 (the actor masks them).
    assert torch.all(got[..., vocab:] == 0)


def test_checkpoint_that_does_not_fit_its_config_is_named(parallel_ctx, model_root):
    import json

    from megatron_rl.config import ModelConfig
    from megatron_rl.models import UnsupportedModelError, build_model
    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = make_tiny_model_dir(model_root / "mismatch", "llama", with_tokenizer=False)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(UnsupportedModelError, match=r"model.layers.0.mlp.gate_proj.weight.*linear_fc1.weight: shape \(256, 64\) does not fit .* \(192, 64\)"):
        build_model(ModelConfig(path=str(model_dir)), parallel_ctx)


def test_a_model_build_leaves_megatrons_attention_environment_as_it_found_it(parallel_ctx, model_root):
    """megatron's GPTModel writes its attention backend into the environment (NVTE_FLASH_ATTN=0 ... for the local
    spec) and refuses a later build with another backend in the same process; without Transformer Engine the
    variables mean nothing, and a build of megatron's default backend after ours must still run."""
    import os

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    from megatron_rl.config import ModelConfig
    from megatron_rl.models import build_model
    from megatron_rl.models.build import TE_ATTENTION_ENV, use_transformer_engine
    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = make_tiny_model_dir(model_root / "environment", "llama", with_tokenizer=False)
    model_cfg = ModelConfig(path=str(model_dir), dtype="float32")
    before = {name: os.environ.get(name) for name in TE_ATTENTION_ENV}
    try:
        build_model(model_cfg, parallel_ctx)
        if not use_transformer_engine(model_cfg):  # with TE the model is built with megatron's default backend (auto)
            assert {name: os.environ.get(name) for name in TE_ATTENTION_ENV} == before
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True)
        assert config.attention_backend == AttnBackend.auto
        GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8)
    finally:  # what megatron's auto build set goes, for the rest of the session as before
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def test_a_build_without_a_jit_compiler_runs_megatrons_jit_functions_eagerly(parallel_ctx, model_root):
    """megatron torch.compile's its @jit_fuser functions whatever the fusion fields say (the router's expert bias,
    the grouped experts' activation). Where the kernel choice has no compiler for them (CPU), the build makes them
    eager: a training forward and backward of DeepSeek-V3 with grouped experts compiles no frame, and
    use_megatron_jit(True) puts megatron's compiled functions back."""
    from megatron.core.transformer.moe.router import TopKRouter
    from torch._dynamo.utils import counters

    from megatron_rl.config import ModelConfig
    from megatron_rl.models import build_model
    from megatron_rl.models.kernels import detect_kernels, use_megatron_jit
    from megatron_rl.models.tiny import make_tiny_model_dir

    if detect_kernels().jit_compiler:
        pytest.skip("a GPU with triton is present: megatron's jit functions compile there; this checks a machine without")
    use_megatron_jit(True)  # megatron's own state, whatever an earlier build in this process did
    compiled = TopKRouter.__dict__["_apply_expert_bias"]
    assert "_torchdynamo_orig_callable" in compiled.__dict__  # megatron compiles it: the check below can fail
    model_dir = make_tiny_model_dir(model_root / "jit", "deepseek_v3", seed=1, with_tokenizer=False, init_std=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (model,) = build_model(ModelConfig(path=str(model_dir), dtype="float32", moe_grouped_gemm=True), parallel_ctx)
    assert TopKRouter.__dict__["_apply_expert_bias"] is compiled.__dict__["_torchdynamo_orig_callable"]
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0).expand_as(tokens)
    frames = counters["frames"]["total"]
    model.train()
    model(tokens, positions, attention_mask=None).float().square().mean().backward()
    assert counters["frames"]["total"] == frames, dict(counters["frames"])
    experts = [layer.mlp.experts for layer in model.decoder.layers if hasattr(layer.mlp, "experts")]
    assert experts and all("_torchdynamo_orig_callable" not in e.activation_func_with_probs.__dict__ for e in experts)
    use_megatron_jit(True)
    assert TopKRouter.__dict__["_apply_expert_bias"] is compiled



def test_an_export_plan_whose_shard_changed_dtype_in_place_is_stale(parallel_ctx, model_root):
    """models.export.plan_is_current: a module may replace a shard's `.data` with another dtype (megatron's router
    keeps a bf16 model's expert bias in fp32 from its first forward; the bf16 build: tests/gpu); the push's kept
    plans are then made again (weight_sync.pusher)."""
    import torch

    from megatron_rl.config import ModelConfig
    from megatron_rl.models import build_model
    from megatron_rl.models.export import funnel_plan, plan_is_current

    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = make_tiny_model_dir(model_root / "bias", "deepseek_v3", seed=0, with_tokenizer=False)
    chunks = build_model(ModelConfig(path=str(model_dir)), parallel_ctx)
    biases = [b for name, b in chunks[0].named_buffers() if name.endswith("router.expert_bias")]
    plan = funnel_plan(chunks, parallel_ctx)
    assert biases and plan_is_current(plan)
    biases[0].data = biases[0].data.to(torch.bfloat16)
    assert not plan_is_current(plan)
