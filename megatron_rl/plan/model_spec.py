"""A model's shape and parameter count, from its Hugging Face `config.json` alone.

The config is parsed and validated by megatron_rl.models.hf_config (the same
parser the model builder uses, so the planner refuses exactly what the trainer
would); this module adds the parameter counts and the per-device numbers the
planner needs. No torch, no transformers: `megatron-rl plan` answers in well
under a second on any machine.

Parameters per layer (h hidden, a query heads, g KV heads, d head width,
f dense MLP width, E experts of width f_e, k of them active per token):
    attention   as the family counts it (models/families); GQA: q h x a d, k and v h x g d,
                o a d x h (+ q/k/v biases, + q/k norms 2d)
    norms       2h
    dense MLP   SwiGLU 3 h f
    MoE         router h E (+ expert bias E) + E x 3 h f_e (k x 3 h f_e active) + shared expert 3 h f_s (+ gate h)
plus embeddings V h (twice when the output layer is untied) and the final norm h.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config.core import ConfigError
from megatron_rl.config.layout import ModelShape
from megatron_rl.models.families import get_family
from megatron_rl.models.hf_config import HFArch, load_hf_config, padded_vocab_size, parse_hf_config


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """A parsed model (HFArch) with the parameter counts and shapes the planner needs."""

    arch: HFArch
    """The validated config.json, as megatron_rl.models.hf_config parses it."""

    # ---- shape ----

    @property
    def model_type(self) -> str:
        return self.arch.family

    @property
    def num_layers(self) -> int:
        return self.arch.num_layers

    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    @property
    def num_attention_heads(self) -> int:
        return self.arch.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.arch.num_query_groups

    @property
    def head_dim(self) -> int:
        return self.arch.head_dim

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def tie_embeddings(self) -> bool:
        return self.arch.tie_word_embeddings

    @property
    def qk_norm(self) -> bool:
        return self.arch.qk_norm

    @property
    def ffn_hidden_size(self) -> int:
        return self.arch.ffn_hidden_size

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return self.arch.moe_layers or (False,) * self.arch.num_layers

    @property
    def num_experts(self) -> int:
        return self.arch.num_experts

    @property
    def experts_per_token(self) -> int:
        return self.arch.moe_topk

    @property
    def moe_ffn_hidden_size(self) -> int:
        return self.arch.moe_ffn_hidden_size

    @property
    def shared_expert_ffn_hidden_size(self) -> int:
        return self.arch.shared_expert_size

    @property
    def max_position_embeddings(self) -> int:
        return self.arch.max_position_embeddings

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.num_moe_layers > 0

    def padded_vocab(self, tensor_parallel: int) -> int:
        """Megatron pads the vocabulary to a multiple of 128 x TP (make_vocab_size_divisible_by=128)."""
        return padded_vocab_size(self.vocab_size, tensor_parallel)

    def shape(self) -> ModelShape:
        """The numbers megatron_rl.config.layout.check_layout divides."""
        return ModelShape(
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_kv_heads,
            num_experts=self.num_experts if self.is_moe else 0,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
        )

    # ---- parameter counts (the Hugging Face checkpoint's weights, published vocabulary) ----

    def attention_params(self) -> int:
        """One layer's attention weights, as its family counts them (GQA: q, k, v, o (+ biases, + q/k norms))."""
        return get_family(self.arch.family).attention_params(self.arch)

    def attention_replicated_params(self) -> int:
        """The part of `attention_params` that tensor parallelism does not split (norms inside attention)."""
        return get_family(self.arch.family).attention_replicated_params(self.arch)

    def kv_cache_values_per_token(self, tensor_parallel: int) -> float:
        """KV-cache values of one token in one layer on one engine rank, as the family lays its cache out."""
        return get_family(self.arch.family).kv_cache_values_per_token(self.arch, tensor_parallel)

    def dense_mlp_params(self) -> int:
        """SwiGLU gate, up and down projections of a dense layer: 3 h f."""
        return 3 * self.hidden_size * self.ffn_hidden_size

    def expert_params(self) -> int:
        """One routed expert: SwiGLU 3 h f_e."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    def router_params(self) -> int:
        """Router (gate) h x E of one MoE layer (+ E for a sigmoid router's expert bias)."""
        return self.hidden_size * self.num_experts + (self.num_experts if self.arch.router_expert_bias else 0)

    def shared_expert_params(self) -> int:
        """Shared expert 3 h f_s plus its sigmoid gate h x 1, per MoE layer."""
        if not self.shared_expert_ffn_hidden_size:
            return 0
        gate = self.hidden_size if self.arch.shared_expert_gate else 0
        return 3 * self.hidden_size * self.shared_expert_ffn_hidden_size + gate

    def layer_params(self, moe: bool, active: bool = False) -> int:
        """One transformer layer: 2 RMSNorms + attention + MLP (all experts, or the k active ones)."""
        params = 2 * self.hidden_size + self.attention_params()
        if moe:
            experts = self.experts_per_token if active else self.num_experts
            params += self.router_params() + self.shared_expert_params() + experts * self.expert_params()
        else:
            params += self.dense_mlp_params()
        return params

    def embedding_params(self) -> int:
        """Input embedding plus (untied) output layer: V h each."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    def total_params(self) -> int:
        """Every weight: embeddings, layers, final norm."""
        layers = sum(self.layer_params(moe) for moe in self.moe_layers)
        return self.embedding_params() + layers + self.hidden_size

    def active_params(self) -> int:
        """Weights one token passes through: only k of the E routed experts per MoE layer."""
        layers = sum(self.layer_params(moe, active=True) for moe in self.moe_layers)
        return self.embedding_params() + layers + self.hidden_size


def spec_from_hf_config(config: dict[str, Any], where: str = "config.json") -> ModelSpec:
    """Parse a Hugging Face config.json dict; unsupported families and features are ConfigErrors."""
    return ModelSpec(arch=parse_hf_config(config, where))


def read_hf_config(model_path: str, make_tiny_if_missing: str = "") -> dict[str, Any]:
    """`<model_path>/config.json` as a dict, or a ConfigError saying what is missing.

    A tiny model built at run time (model.make_tiny_if_missing) has no directory
    yet when a preset is planned: megatron_rl.models.tiny supplies the config.json
    it will write (its vocabulary is the sentencepiece model's, at most the 256
    assumed here).
    """
    if model_path and make_tiny_if_missing and not Path(model_path).exists():
        from megatron_rl.models.tiny import tiny_hf_config

        return tiny_hf_config(make_tiny_if_missing)
    try:
        return load_hf_config(model_path)
    except ConfigError as err:
        raise ConfigError(f"{err} (or pass the model's config.json to the planner with --model-config)") from None
