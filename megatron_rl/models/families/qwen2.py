"""Qwen2 (Qwen2ForCausalLM): Llama with biases on q/k/v (megatron add_qkv_bias)."""

from __future__ import annotations

from megatron_rl.models.families.base import DENSE_DEFAULTS, Family


class Qwen2(Family):
    model_type = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    defaults = dict(DENSE_DEFAULTS)
    # vLLM sizes Qwen2 heads as hidden / heads (see llama.py): 2 heads of 32.
    tiny_config = {"num_attention_heads": 2, "num_key_value_heads": 2}

    def attention_fields(self, cfg: dict, source: str) -> dict:
        return {**super().attention_fields(cfg, source), "qkv_bias": True}
