"""Llama (LlamaForCausalLM): the base decoder, RMSNorm, rotary (default, linear, llama3 scaling), GQA, SwiGLU."""

from __future__ import annotations

from megatron_rl.models.families.base import DENSE_DEFAULTS, Family


class Llama(Family):
    model_type = "llama"
    architectures = ("LlamaForCausalLM",)
    defaults = {**DENSE_DEFAULTS, "mlp_bias": False}
    # vLLM sizes Llama heads as hidden / heads (ignoring head_dim) and its CPU attention needs >= 32:
    # 2 heads give 64 / 2 = 32, as head_dim says (2 key/value heads: TP2 splits them).
    tiny_config = {"attention_bias": False, "mlp_bias": False, "num_attention_heads": 2, "num_key_value_heads": 2}
