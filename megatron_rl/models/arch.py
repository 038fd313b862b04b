"""A model's family-independent description (HFArch) and the helpers families parse config.json with.

The lowest layer of models/: it imports neither the families nor torch, so
each family (models/families/) builds its HFArch from here, hf_config.py finds
a config's family and asks it, and the mapping (mapping.py) reads the result.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.core import ConfigError


class UnsupportedModelError(ConfigError):
    """The model directory or its config.json describes something megatron_rl cannot build."""


@dataclass(frozen=True, kw_only=True)
class HFArch:
    """A validated HF decoder-only model description, the same fields for every family."""

    family: str
    """HF model_type of the family (a key of megatron_rl.models.families.FAMILIES)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (GQA groups); equals the query heads for multi-latent attention."""
    head_dim: int
    """Width of one attention head (q/k/v); multi-latent attention: its value head width."""
    ffn_hidden_size: int
    """Width of the dense SwiGLU MLPs (intermediate_size)."""
    vocab_size: int
    """Vocabulary size of the checkpoint (before megatron's padding)."""
    max_position_embeddings: int
    norm_eps: float
    rope_base: float
    rope_scaling: tuple[str, float] | None = None
    """None, ("linear", factor), ("llama3", factor) or ("yarn", factor)."""
    rope_yarn: tuple[tuple[str, float], ...] = ()
    """YaRN's further keys (original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that rotary embeddings rotate (the first ones; GLM-4.5: 0.5)."""
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    q_lora_rank: int = 0
    """Multi-latent attention: rank of the compressed query (0 = queries projected directly)."""
    kv_lora_rank: int = 0
    """Multi-latent attention: rank of the compressed key/value latent (0 = not multi-latent attention)."""
    qk_nope_head_dim: int = 0
    """Multi-latent attention: per-head query/key dimensions without rotary embedding."""
    qk_rope_head_dim: int = 0
    """Multi-latent attention: per-head query/key dimensions with rotary embedding (shared key part)."""
    rope_interleaved: bool = False
    """The checkpoint's rotary dimensions come in interleaved pairs (DeepSeek rope_interleave)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0 = dense model)."""
    moe_ffn_hidden_size: int = 0
    """Width of one expert's SwiGLU."""
    moe_topk: int = 0
    norm_topk_prob: bool = False
    """Renormalise the top-k probabilities to sum to 1."""
    router_score: str = "softmax"
    """Router score function: softmax or sigmoid."""
    router_expert_bias: bool = False
    """Sigmoid router with a per-expert bias added for the top-k choice only (aux-loss-free balancing)."""
    router_num_groups: int = 0
    """Group-limited routing: experts in this many groups (0 = no groups)."""
    router_group_topk: int = 0
    """Group-limited routing: groups each token may use."""
    routed_scaling_factor: float = 1.0
    """Routed experts' weights are multiplied by this."""
    moe_layers: tuple[bool, ...] = ()
    """Per layer: True = MoE block, False = dense MLP (empty for dense models)."""
    shared_expert_size: int = 0
    """Width of the shared expert(s) (0 = none)."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(x . w) (Qwen2-MoE)."""


def fail(source: str, message: str) -> UnsupportedModelError:
    """The error for an unsupported or malformed config value, naming where it came from."""
    return UnsupportedModelError(f"{source}: {message}")


def parse_rope(
    cfg: dict, source: str, supported: tuple[str, ...] = ("default", "linear", "llama3"), *, partial_rotary: bool = False
) -> dict:
    """rope_base / rope_scaling / rope_yarn / rotary_percent fields from transformers 4.x (rope_theta/rope_scaling) or 5.x (rope_parameters) keys.

    A rope type outside `supported`, or a partial_rotary_factor != 1 where the
    family does not rotate part of a head (`partial_rotary`), is an error naming the key.
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    base = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    merged = {**scaling, **params}
    partial = merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    rotary_percent = 1.0 if partial is None else float(partial)
    if rotary_percent != 1.0 and not partial_rotary:
        raise fail(source, f"partial_rotary_factor={partial} is not supported: the {cfg.get('model_type')} family rotates the whole head (1.0)")
    if not 0.0 < rotary_percent <= 1.0:
        raise fail(source, f"partial_rotary_factor={partial}: expected a fraction in (0, 1]")
    if rope_type not in supported:
        raise fail(source, f"rope_scaling rope_type={rope_type!r} is not supported for {cfg.get('model_type')}; supported: {', '.join(supported)}")
    if rope_type == "default":
        return dict(rope_base=base, rope_scaling=None, rotary_percent=rotary_percent)
    if rope_type == "llama3":
        # megatron-core hard-codes Llama 3.1's low/high frequency factors and original context.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, value in expected.items():
            if float(merged.get(key, value)) != value:
                raise fail(source, f"llama3 rope scaling with {key}={merged[key]} is not supported (megatron-core fixes it to {value})")
    fields = dict(rope_base=base, rope_scaling=(rope_type, float(merged["factor"])), rotary_percent=rotary_percent)
    if rope_type == "yarn":
        # transformers' YaRN defaults (modeling_rope_utils._compute_yarn_parameters).
        yarn = {"original_max_position_embeddings": cfg.get("max_position_embeddings"), "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
        fields["rope_yarn"] = tuple((key, float(merged.get(key) or default)) for key, default in yarn.items())
    return fields


def read_int(cfg: dict, key: str, source: str, minimum: int = 1) -> int:
    """cfg[key] as an int >= minimum, or an error naming the key and value."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(source, f"{key}={value!r}: expected an integer >= {minimum}")
    return value
