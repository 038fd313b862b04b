"""Qwen3 (Qwen3ForCausalLM): Llama with a per-head RMSNorm on queries and keys (megatron qk_layernorm)."""

from __future__ import annotations

from megatron_rl.models.families.base import DENSE_DEFAULTS, Family


class Qwen3(Family):
    model_type = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    defaults = {**DENSE_DEFAULTS, "head_dim": 128}
    tiny_config = {"attention_bias": False}

    def attention_fields(self, cfg: dict, source: str) -> dict:
        return {**super().attention_fields(cfg, source), "qk_norm": True}
