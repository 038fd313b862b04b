"""HF config.json -> HFArch / TransformerConfig / ModelShape, and the errors for what megatron_rl cannot build."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.config import ConfigError, ModelConfig, ParallelConfig
from megatron_rl.models import (
    UnsupportedModelError,
    load_hf_config,
    model_shape,
    padded_vocab_size,
    parse_hf_config,
)
from megatron_rl.models.tiny import tiny_hf_config

# config.json of Qwen/Qwen3-30B-A3B as published (transformers 4.51 keys).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip

# config.json of mistralai/Mixtral-8x7B-v0.1 (abridged to what matters).
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
    "vocab_size": 32000,
}  # fmt: skip

LLAMA_31_8B_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def test_published_qwen3_moe_config():
    arch = parse_hf_config(QWEN3_30B_A3B)
    assert (arch.family, arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size, arch.head_dim) == ("qwen3_moe", 128, 8, 768, 128)
    assert arch.norm_topk_prob and arch.qk_norm and not arch.qkv_bias and arch.rope_base == 1e6
    assert arch.moe_layers == (True,) * 48
    shape = model_shape(QWEN3_30B_A3B)
    assert (shape.num_layers, shape.num_attention_heads, shape.num_query_groups, shape.num_experts) == (48, 32, 4, 128)


def test_published_mixtral_config():
    arch = parse_hf_config(MIXTRAL_8X7B)
    assert (arch.family, arch.num_experts, arch.moe_ffn_hidden_size, arch.norm_topk_prob, arch.norm_eps) == ("mixtral", 8, 14336, True, 1e-5)


def test_rope_keys_of_transformers_4_and_5():
    v4 = parse_hf_config(tiny_hf_config("llama", rope_theta=5e5, rope_scaling=LLAMA_31_8B_ROPE))
    v5 = parse_hf_config(tiny_hf_config("llama", rope_parameters={"rope_theta": 5e5, **LLAMA_31_8B_ROPE}))
    assert v4.rope_base == v5.rope_base == 5e5 and v4.rope_scaling == v5.rope_scaling == ("llama3", 8.0)
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn'"):
        parse_hf_config(tiny_hf_config("qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_dense_layers_from_mlp_only_layers_and_sparse_step():
    arch = parse_hf_config(tiny_hf_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]))
    # transformers: sparse iff i not in mlp_only_layers and (i + 1) % step == 0 -> layers 1 only (3 is forced dense)
    assert arch.moe_layers == (False, True, False, False)
    with pytest.raises(UnsupportedModelError, match="no MoE layer"):
        parse_hf_config(tiny_hf_config("qwen3_moe", mlp_only_layers=[0, 1]))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, r"model_type='gpt2'.*supported families: llama"),
        ({"architectures": ["Gemma2ForCausalLM"]}, r"Gemma2ForCausalLM.*qwen3_moe \(Qwen3MoeForCausalLM\)"),
        (tiny_hf_config("llama", hidden_act="gelu"), "hidden_act='gelu'"),
        (tiny_hf_config("llama", attention_bias=True), "attention_bias=true"),
        (tiny_hf_config("llama", mlp_bias=True), "mlp_bias=true"),
        (tiny_hf_config("qwen2", use_sliding_window=True), "sliding-window"),
        (tiny_hf_config("mixtral", sliding_window=4096), "sliding_window=4096"),
        (tiny_hf_config("mixtral", router_jitter_noise=0.1), "router_jitter_noise=0.1"),
        (tiny_hf_config("llama", hidden_size="64"), "hidden_size='64'"),
        (tiny_hf_config("llama", num_key_value_heads=3), "num_key_value_heads=3"),
        (tiny_hf_config("qwen3_moe", num_experts_per_tok=9), "num_experts_per_tok=9"),
        (tiny_hf_config("qwen3_moe", num_experts=0), "num_experts / num_local_experts=0"),
        (tiny_hf_config("mixtral", num_experts_per_tok=1), r"num_experts_per_tok=1 \(mixtral renormalises.*supported: num_experts_per_tok >= 2$"),
        (tiny_hf_config("qwen3_moe", num_experts_per_tok=1, norm_topk_prob=True), r"num_experts_per_tok=1 \(with norm_topk_prob=true\).*or norm_topk_prob=false"),
        (tiny_hf_config("qwen2_moe", num_experts_per_tok=1, norm_topk_prob=True), r"num_experts_per_tok=1 \(with norm_topk_prob=true\)"),
        (tiny_hf_config("llama", partial_rotary_factor=0.5), r"partial_rotary_factor=0.5 .*whole head"),
        (tiny_hf_config("qwen3", rope_parameters={"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.25}), "partial_rotary_factor=0.25"),
        (tiny_hf_config("qwen3", layer_types=["full_attention", "sliding_attention"]), r"layer_types with \['full_attention', 'sliding_attention'\]"),
        ([1, 2], "expected a JSON object"),
        # DeepSeek-V3 / GLM-4.5: what megatron-core cannot route or rotate the same way, named by key.
        (tiny_hf_config("deepseek_v3", rope_scaling={"rope_type": "llama3", "factor": 8.0}), r"rope_type='llama3' is not supported for deepseek_v3; supported: default, yarn"),
        (tiny_hf_config("deepseek_v3", norm_topk_prob=False), r"norm_topk_prob=false is not supported"),
        (tiny_hf_config("deepseek_v3", n_group=4, topk_group=2, num_experts_per_tok=2), r"n_group=4 with num_experts_per_tok=2 and topk_group=2"),
        (tiny_hf_config("deepseek_v3", scoring_func="softmax"), r"scoring_func='softmax'"),
        (tiny_hf_config("deepseek_v3", first_k_dense_replace=3), r"first_k_dense_replace=3 leaves no MoE layer"),
        (tiny_hf_config("deepseek_v3", num_key_value_heads=2), r"num_key_value_heads=2 differs from num_attention_heads=4"),
        (tiny_hf_config("glm4_moe", partial_rotary_factor=1.5), r"partial_rotary_factor=1.5: expected a fraction"),
    ],
)
def test_unsupported_or_malformed_config(config, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config(config)


def test_quantized_weights_are_refused_by_name_but_planned():
    from megatron_rl.models.hf_config import refuse_quantized

    config = tiny_hf_config("deepseek_v3", quantization_config={"quant_method": "fp8", "fmt": "e4m3"})
    assert parse_hf_config(config).family == "deepseek_v3"  # the planner still reads its shape
    with pytest.raises(UnsupportedModelError, match=r"quantization_config \(quant_method='fp8'\).*dequantize"):
        refuse_quantized(config, "config.json")


def test_model_directory_errors(tmp_path):
    with pytest.raises(UnsupportedModelError, match="model.path is empty"):
        load_hf_config("")
    with pytest.raises(UnsupportedModelError, match="does not exist"):
        load_hf_config(tmp_path / "nope")
    with pytest.raises(UnsupportedModelError, match="has no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(UnsupportedModelError, match="is a file"):
        load_hf_config(tmp_path / "weights.bin")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="is not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(UnsupportedModelError, match="holds a list"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("llama")))
    assert load_hf_config(tmp_path / "config.json")["model_type"] == "llama"


def test_checkpoint_errors(tmp_path):
    from safetensors.torch import save_file

    from megatron_rl.models import SafetensorsCheckpoint, check_checkpoint_names

    with pytest.raises(UnsupportedModelError, match="holds no \\*.safetensors"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(UnsupportedModelError, match="do not exist"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    save_file({"model.norm.weight": torch.ones(4), "model.extra.weight": torch.ones(2)}, tmp_path / "model.safetensors")
    checkpoint = SafetensorsCheckpoint(tmp_path)
    assert checkpoint.read("model.norm.weight", 0, 1, 3).tolist() == [1.0, 1.0]
    with pytest.raises(UnsupportedModelError, match=r"20 missing \(e.g. \['lm_head.weight', 'model.embed_tokens.weight'.*1 unexpected \(e.g. \['model.extra.weight'\]"):
        check_checkpoint_names(parse_hf_config(tiny_hf_config("llama")), checkpoint.names(), str(tmp_path))


def test_padded_vocab_size():
    assert padded_vocab_size(151936, 1) == 151936  # 1187 x 128
    assert padded_vocab_size(151936, 4) == 152064  # next multiple of 512
    assert padded_vocab_size(200, 2) == 256


def _transformer_config(family: str, model_cfg: ModelConfig | None = None, parallel: ParallelConfig | None = None, **overrides):
    from megatron_rl.models import hf_to_transformer_config

    return hf_to_transformer_config(
        tiny_hf_config(family, **overrides), model_cfg or ModelConfig(), parallel or ParallelConfig(), dtype=torch.float32
    )


def test_transformer_config_cpu_requirements():
    config = _transformer_config("qwen3_moe", ModelConfig(token_dispatcher="allgather", moe_aux_loss_coeff=1e-3, moe_z_loss_coeff=1e-4))
    assert config.params_dtype == torch.float32 and not config.bf16
    assert config.hidden_dropout == 0 and config.attention_dropout == 0
    assert not config.add_bias_linear and not config.add_qkv_bias and config.qk_layernorm
    # CPU initialisation exactly where there is no CUDA device (megatron then initialises on the GPU).
    assert config.use_cpu_initialization == (not torch.cuda.is_available()) and not config.moe_grouped_gemm
    assert config.normalization == "RMSNorm" and config.gated_linear_unit and config.kv_channels == 32
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 64)
    assert not config.moe_router_pre_softmax  # norm_topk_prob=True: top-k over logits, then softmax
    assert config.moe_token_dispatcher_type == "allgather"
    assert config.moe_aux_loss_coeff == 1e-3 and config.moe_z_loss_coeff == 1e-4
    assert config.moe_router_load_balancing_type == "aux_loss"


def test_transformer_config_per_family():
    assert _transformer_config("qwen2").add_qkv_bias
    assert not _transformer_config("llama").qk_layernorm and _transformer_config("qwen3").qk_layernorm
    assert _transformer_config("qwen3_moe", norm_topk_prob=False).moe_router_pre_softmax
    assert _transformer_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0, 2]).moe_layer_freq == [0, 1, 0, 1]
    shared = _transformer_config("qwen2_moe")
    assert shared.moe_shared_expert_intermediate_size == 96 and shared.moe_shared_expert_gate and shared.add_qkv_bias
    assert not _transformer_config("mixtral").moe_router_pre_softmax
    assert _transformer_config("qwen3_moe").moe_router_load_balancing_type == "none"  # no aux loss by default
    assert _transformer_config("llama", ModelConfig(recompute="full")).recompute_granularity == "full"


def test_top1_routing_is_built_or_refused_in_the_config_s_own_terms():
    # HF top-1 without renormalisation: weight = softmax probability of the chosen expert = megatron's pre-softmax top-1.
    config = _transformer_config("qwen3_moe", num_experts_per_tok=1, norm_topk_prob=False)
    assert config.moe_router_topk == 1 and config.moe_router_pre_softmax
    # With renormalisation the weight is 1.0, which megatron-core refuses with its own command-line flag.
    for family, extra in (("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": True})):
        with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=1") as err:
            _transformer_config(family, num_experts_per_tok=1, **extra)
        assert "--moe" not in str(err.value) and "moe_router" not in str(err.value)


def test_moe_with_tp_needs_sequence_parallel():
    tp2 = ParallelConfig(tensor_parallel=2, expert_tensor_parallel=2)
    assert _transformer_config("qwen3_moe", parallel=tp2).sequence_parallel
    with pytest.raises(ConfigError, match="sequence_parallel=true"):
        _transformer_config("qwen3_moe", parallel=ParallelConfig(tensor_parallel=2, sequence_parallel=False))
    assert not _transformer_config("llama", parallel=ParallelConfig(tensor_parallel=2, sequence_parallel=False)).sequence_parallel


def test_unknown_override_is_an_error():
    from megatron_rl.models import hf_to_transformer_config

    with pytest.raises(ConfigError, match="no_such_field"):
        hf_to_transformer_config(tiny_hf_config("llama"), ModelConfig(), ParallelConfig(), dtype=torch.float32, no_such_field=1)


def test_float32_only_on_cpu():
    """auto = bfloat16 on a GPU, float32 on a CPU build, where half precision is refused naming the key."""
    from megatron_rl.models import resolve_dtype

    assert resolve_dtype(ModelConfig(dtype="float32")) == torch.float32
    if torch.cuda.is_available():
        assert resolve_dtype(ModelConfig()) == torch.bfloat16 == resolve_dtype(ModelConfig(dtype="bfloat16"))
        return
    assert resolve_dtype(ModelConfig()) == torch.float32
    with pytest.raises(ConfigError, match="model.dtype=bfloat16"):
        resolve_dtype(ModelConfig(dtype="bfloat16"))


def test_grouped_gemm_and_permute_fusion_settings():
    """What is built or refused follows the platform (availability.detect), on a CPU build and on a GPU alike:
    fp32 grouped experts run on a CPU build (torch grouped GEMM) or with TE (TEGroupedMLP), and are refused on
    a GPU without TE (megatron's GroupedMLP kernels are bf16-only); the fused permute needs TE."""
    from megatron_rl.parallel.availability import detect

    avail = detect()
    if avail.cuda and not avail.transformer_engine:
        with pytest.raises(ConfigError, match=r"model.moe_grouped_gemm=true .*model.moe_grouped_gemm=false|model.moe_grouped_gemm=true with model.dtype=float32"):
            _transformer_config("qwen3_moe", ModelConfig(moe_grouped_gemm=True))
    else:
        config = _transformer_config("qwen3_moe", ModelConfig(moe_grouped_gemm=True))
        assert config.moe_grouped_gemm and not config.moe_permute_fusion
    if avail.transformer_engine:
        assert _transformer_config("qwen3_moe", ModelConfig(moe_permute_fusion=True)).moe_permute_fusion
    else:
        with pytest.raises(ConfigError, match=r"model.moe_permute_fusion=true needs Transformer Engine.*set model.moe_permute_fusion=false"):
            _transformer_config("qwen3_moe", ModelConfig(moe_permute_fusion=True))
