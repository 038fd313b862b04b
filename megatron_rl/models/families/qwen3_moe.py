"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention + a top-k softmax router over SwiGLU experts.

Optional renormalisation of the top-k (norm_topk_prob), dense layers from
mlp_only_layers / decoder_sparse_step, an optional (gated) shared expert.
"""

from __future__ import annotations

from megatron_rl.models.families.base import DENSE_DEFAULTS, SoftmaxMoEFamily


class Qwen3Moe(SoftmaxMoEFamily):
    model_type = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    defaults = {**DENSE_DEFAULTS, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
    tiny_config = {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
    }

    def attention_fields(self, cfg: dict, source: str) -> dict:
        return {**super().attention_fields(cfg, source), "qk_norm": True}
