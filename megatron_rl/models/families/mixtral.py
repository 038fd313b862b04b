"""Mixtral (MixtralForCausalLM): Llama attention + experts named w1/w3/w2 in block_sparse_moe, always renormalised."""

from __future__ import annotations

from megatron_rl.models.families.base import DENSE_DEFAULTS, Family
from megatron_rl.models.arch import fail, read_int


class Mixtral(Family):
    model_type = "mixtral"
    architectures = ("MixtralForCausalLM",)
    moe = True
    defaults = {**DENSE_DEFAULTS, "rms_norm_eps": 1e-5}
    tiny_config = {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": False, "router_aux_loss_coef": 0.0}
    moe_block = "block_sparse_moe"
    expert_matrices = ("w1", "w3", "w2")
    expert_width_key = "intermediate_size"

    def check(self, cfg: dict, source: str) -> None:
        super().check(cfg, source)
        if cfg.get("sliding_window"):
            raise fail(source, f"sliding-window attention (sliding_window={cfg.get('sliding_window')}) is not supported by megatron's local attention")
        if cfg.get("router_jitter_noise", 0.0):
            raise fail(source, f"router_jitter_noise={cfg['router_jitter_noise']} is not supported: set it to 0.0")

    def moe_fields(self, cfg: dict, num_layers: int, source: str) -> dict:
        num_experts, topk = self.experts_and_topk(cfg, source, self.model_type)
        self.refuse_renormalised_top1(topk, True, source, "mixtral renormalises the top-k weights")
        return dict(
            num_experts=num_experts,
            moe_ffn_hidden_size=read_int(cfg, "intermediate_size", source),  # the expert width (no dense layers)
            moe_topk=topk,
            norm_topk_prob=True,
            moe_layers=(True,) * num_layers,
        )
