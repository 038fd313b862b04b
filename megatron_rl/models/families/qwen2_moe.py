"""Qwen1.5/Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2 attention (q/k/v biases) + experts + a sigmoid-gated shared expert."""

from __future__ import annotations

from megatron_rl.models.families.base import DENSE_DEFAULTS, SoftmaxMoEFamily


class Qwen2Moe(SoftmaxMoEFamily):
    model_type = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    defaults = {
        **DENSE_DEFAULTS,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "qkv_bias": True,
        "shared_expert_intermediate_size": 5632,
    }
    # No renormalisation, a gated shared expert.
    tiny_config = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
    }

    def attention_fields(self, cfg: dict, source: str) -> dict:
        return {**super().attention_fields(cfg, source), "qkv_bias": bool(cfg["qkv_bias"])}
