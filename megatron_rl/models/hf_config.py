"""Read a Hugging Face `config.json` into the numbers megatron-core needs.

`parse_hf_config` turns the raw dict into an `HFArch`: one validated record per
model, the same for every family, so the rest of models/ never looks at
family-specific keys. Everything megatron cannot reproduce exactly (a sliding
window, biases on the output projection, an activation other than SiLU, ...) is
refused here with the offending key and value, before any process group or
model exists.

Families (HF model_type -> what differs from Llama):
    llama      the base: RMSNorm, SwiGLU, rotary, GQA, no biases
    qwen2      + bias on q/k/v (megatron add_qkv_bias)
    qwen3      + per-head RMSNorm on q and k (megatron qk_layernorm)
    qwen3_moe  qwen3 attention + top-k softmax router over SwiGLU experts,
               optional renormalisation (norm_topk_prob), dense layers from
               mlp_only_layers / decoder_sparse_step, optional shared expert
    qwen2_moe  qwen2 attention + experts + a sigmoid-gated shared expert
    mixtral    llama attention + experts (w1/w3/w2), always renormalised
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.config.core import ConfigError
from megatron_rl.config.layout import ModelShape


class UnsupportedModelError(ConfigError):
    """The model directory or its config.json describes something megatron_rl cannot build."""


@dataclass(frozen=True)
class FamilyInfo:
    """Static facts of one HF model family."""

    architectures: tuple[str, ...]
    """HF class names in config.json's `architectures` that belong to this family."""
    moe: bool = False
    """Has routed experts."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """transformers' defaults for keys a config.json may leave out."""


_DENSE_DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False}

FAMILIES: dict[str, FamilyInfo] = {
    "llama": FamilyInfo(("LlamaForCausalLM",), defaults={**_DENSE_DEFAULTS, "mlp_bias": False}),
    "qwen2": FamilyInfo(("Qwen2ForCausalLM",), defaults=dict(_DENSE_DEFAULTS)),
    "qwen3": FamilyInfo(("Qwen3ForCausalLM",), qk_norm=True, defaults={**_DENSE_DEFAULTS, "head_dim": 128}),
    "qwen3_moe": FamilyInfo(
        ("Qwen3MoeForCausalLM",),
        moe=True,
        qk_norm=True,
        defaults={**_DENSE_DEFAULTS, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    "qwen2_moe": FamilyInfo(
        ("Qwen2MoeForCausalLM",),
        moe=True,
        defaults={
            **_DENSE_DEFAULTS,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "qkv_bias": True,
            "shared_expert_intermediate_size": 5632,
        },
    ),
    "mixtral": FamilyInfo(("MixtralForCausalLM",), moe=True, defaults={**_DENSE_DEFAULTS, "rms_norm_eps": 1e-5}),
}

SUPPORTED = ", ".join(f"{name} ({info.architectures[0]})" for name, info in FAMILIES.items())


@dataclass(frozen=True, kw_only=True)
class HFArch:
    """A validated HF decoder-only model description, family-independent."""

    family: str
    """Key of FAMILIES."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (GQA groups)."""
    head_dim: int
    ffn_hidden_size: int
    """Width of the dense SwiGLU MLPs (intermediate_size)."""
    vocab_size: int
    """Vocabulary size of the checkpoint (before megatron's padding)."""
    max_position_embeddings: int
    norm_eps: float
    rope_base: float
    rope_scaling: tuple[str, float] | None = None
    """None, ("linear", factor) or ("llama3", factor)."""
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    """Routed experts per MoE layer (0 = dense model)."""
    moe_ffn_hidden_size: int = 0
    """Width of one expert's SwiGLU."""
    moe_topk: int = 0
    norm_topk_prob: bool = False
    """Renormalise the top-k probabilities to sum to 1."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: True = MoE block, False = dense MLP (empty for dense models)."""
    shared_expert_size: int = 0
    """Width of the shared expert (0 = none)."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(x . w) (Qwen2-MoE)."""


def _fail(source: str, message: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{source}: {message}")


def detect_family(hf_config: dict, source: str = "config.json") -> str:
    """The FAMILIES key for a config, from model_type (or architectures when model_type is absent)."""
    model_type = hf_config.get("model_type")
    archs = hf_config.get("architectures") or []
    if model_type in FAMILIES:
        return model_type
    for name, info in FAMILIES.items():
        if any(a in info.architectures for a in archs):
            return name
    raise _fail(source, f"model_type={model_type!r}, architectures={archs!r} is not supported; supported families: {SUPPORTED}")


def load_hf_config(model_dir: str | os.PathLike) -> dict:
    """config.json of an HF model directory as a dict, with errors that name the path and the fix."""
    path = Path(model_dir)
    if not str(model_dir):
        raise UnsupportedModelError("model.path is empty: set model.path=<directory with config.json and *.safetensors>")
    if not path.exists():
        raise UnsupportedModelError(f"model directory {str(path)!r} does not exist: set model.path to an HF model directory")
    if path.is_file():
        if path.name != "config.json":
            raise UnsupportedModelError(f"model path {str(path)!r} is a file: point model.path at the directory holding config.json")
        path = path.parent
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UnsupportedModelError(f"{str(path)!r} has no config.json: it is not a Hugging Face model directory")
    try:
        data = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UnsupportedModelError(f"{str(config_file)!r} is not valid JSON ({err}): re-download or re-export the model") from None
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{str(config_file)!r} holds a {type(data).__name__}, not a JSON object")
    return data


def _rope(cfg: dict, source: str) -> tuple[float, tuple[str, float] | None]:
    """(rope base, scaling) from transformers 4.x (rope_theta/rope_scaling) or 5.x (rope_parameters) keys."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    base = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    merged = {**scaling, **params}
    partial = merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise _fail(source, f"partial_rotary_factor={partial} is not supported: megatron_rl's families rotate the whole head (1.0)")
    if rope_type == "default":
        return float(base), None
    if rope_type == "linear":
        return float(base), ("linear", float(merged["factor"]))
    if rope_type == "llama3":
        # megatron-core hard-codes Llama 3.1's low/high frequency factors and original context.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(merged.get(key, value)) != value:
                raise _fail(source, f"llama3 rope scaling with {key}={merged[key]} is not supported (megatron-core fixes it to {value})")
        return float(base), ("llama3", float(merged["factor"]))
    raise _fail(source, f"rope_type={rope_type!r} is not supported; supported: default, linear, llama3")


def _int(cfg: dict, key: str, source: str, minimum: int = 1) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(source, f"{key}={value!r}: expected an integer >= {minimum}")
    return value


def _moe_fields(family: str, cfg: dict, num_layers: int, source: str) -> dict:
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise _fail(source, f"num_experts / num_local_experts={num_experts!r}: a {family} model needs an integer >= 1")
    topk = _int(cfg, "num_experts_per_tok", source)
    if topk > num_experts:
        raise _fail(source, f"num_experts_per_tok={topk} exceeds the number of experts {num_experts}")
    if topk == 1 and (family == "mixtral" or cfg.get("norm_topk_prob")):
        # Renormalising one weight makes it exactly 1.0: the router would get no gradient.
        renormalised = "mixtral renormalises the top-k weights" if family == "mixtral" else "with norm_topk_prob=true"
        fix = "" if family == "mixtral" else ", or norm_topk_prob=false (top-1 weight = the softmax probability)"
        raise _fail(
            source,
            f"num_experts_per_tok=1 ({renormalised}) is not supported: each token's expert weight would be exactly 1.0, "
            f"leaving the router no gradient; supported: num_experts_per_tok >= 2{fix}",
        )
    if family == "mixtral":
        if cfg.get("router_jitter_noise", 0.0):
            raise _fail(source, f"router_jitter_noise={cfg['router_jitter_noise']} is not supported: set it to 0.0")
        return dict(
            num_experts=num_experts,
            moe_ffn_hidden_size=_int(cfg, "intermediate_size", source),
            moe_topk=topk,
            norm_topk_prob=True,
            moe_layers=(True,) * num_layers,
        )
    step = _int(cfg, "decoder_sparse_step", source)
    mlp_only = cfg.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in mlp_only):
        raise _fail(source, f"mlp_only_layers={mlp_only!r}: expected a list of layer indices in [0, {num_layers})")
    # transformers: layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    moe_layers = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))
    if not any(moe_layers):
        raise _fail(source, f"mlp_only_layers={mlp_only} and decoder_sparse_step={step} leave no MoE layer: use a dense family")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return dict(
        num_experts=num_experts,
        moe_ffn_hidden_size=_int(cfg, "moe_intermediate_size", source),
        moe_topk=topk,
        norm_topk_prob=bool(cfg["norm_topk_prob"]),
        moe_layers=moe_layers,
        shared_expert_size=shared,
        # Qwen2-MoE gates its shared expert; a qwen3_moe config with a shared expert follows the same layout.
        shared_expert_gate=shared > 0,
    )


def parse_hf_config(hf_config: dict, source: str = "config.json") -> HFArch:
    """Validate an HF config dict and return its family-independent description."""
    if not isinstance(hf_config, dict):
        raise UnsupportedModelError(f"{source}: expected a JSON object, got {type(hf_config).__name__}")
    family = detect_family(hf_config, source)
    info = FAMILIES[family]
    cfg = {**info.defaults, **{k: v for k, v in hf_config.items() if v is not None or k not in info.defaults}}
    if cfg.get("hidden_act") != "silu":
        raise _fail(source, f"hidden_act={cfg.get('hidden_act')!r} is not supported: megatron_rl builds SwiGLU (silu) MLPs only")
    if cfg.get("attention_bias"):
        raise _fail(source, "attention_bias=true (bias on the output projection) is not supported: only q/k/v biases (qwen2) are")
    if cfg.get("mlp_bias"):
        raise _fail(source, "mlp_bias=true is not supported: megatron_rl builds bias-free MLPs")
    if cfg.get("use_sliding_window") or (family == "mixtral" and cfg.get("sliding_window")):
        raise _fail(source, f"sliding-window attention (sliding_window={cfg.get('sliding_window')}) is not supported by megatron's local attention")
    layer_types = cfg.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        kinds = sorted(set(layer_types))
        raise _fail(source, f"layer_types with {kinds} is not supported: megatron_rl builds 'full_attention' layers only")
    hidden = _int(cfg, "hidden_size", source)
    heads = _int(cfg, "num_attention_heads", source)
    groups = cfg.get("num_key_value_heads") or heads
    if not isinstance(groups, int) or heads % groups:
        raise _fail(source, f"num_key_value_heads={groups!r} must be an integer dividing num_attention_heads={heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    num_layers = _int(cfg, "num_hidden_layers", source)
    rope_base, rope_scaling = _rope(cfg, source)
    moe = _moe_fields(family, cfg, num_layers, source) if info.moe else {}
    dense_ffn = _int(cfg, "intermediate_size", source)  # mixtral: the expert width, unused by dense layers
    return HFArch(
        family=family,
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=int(head_dim),
        ffn_hidden_size=int(dense_ffn),
        vocab_size=_int(cfg, "vocab_size", source),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        norm_eps=float(cfg["rms_norm_eps"]),
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(cfg["qkv_bias"])),
        qk_norm=info.qk_norm,
        **moe,
    )


def model_shape(hf_config: dict) -> ModelShape:
    """The numbers a parallel layout must divide (for megatron_rl.config.check_layout)."""
    arch = parse_hf_config(hf_config)
    return ModelShape(
        num_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        num_experts=arch.num_experts,
        hidden_size=arch.hidden_size,
        vocab_size=arch.vocab_size,
    )


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """megatron's vocabulary padding: the next multiple of divisible_by x TP (e.g. 151,936 -> 152,064 at TP 4)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple
