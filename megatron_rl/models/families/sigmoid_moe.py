"""What DeepSeek-V3 and GLM-4.5 share: a sigmoid router with an expert bias, groups, scaling, leading dense layers.

The router (DeepSeek-V3, arXiv 2412.19437, Sec. 2.1.2, Eq. 15-16 and 2.1.2's
auxiliary-loss-free balancing):
    s_i = sigmoid(u . e_i)                                 affinity of expert i
    top-k over s_i + b_i (b = e_score_correction_bias)     the bias only chooses
    g_i = s_i / sum_{j in top-k} s_j x routed_scaling_factor
With n_group > 1 the top-k is taken only among the topk_group groups whose two
best (s + b) scores sum highest (node-limited routing). megatron-core computes
the same with moe_router_score_function="sigmoid", moe_router_enable_expert_bias,
moe_router_num_groups / group_topk and moe_router_topk_scaling_factor; it scores
a group by its top (topk / group_topk) experts and always renormalises, so
configs where that differs from transformers are refused.

The bias is updated by megatron-core after each step as DeepSeek-V3 describes
(finalize_model_grads: b_i += rate x sign(mean load - load_i), rate
moe_router_bias_update_rate) and travels with the weights as HF's
e_score_correction_bias.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.families.base import Family
from megatron_rl.models.arch import HFArch, fail, read_int


TINY_GROUPED_EXPERTS: dict[str, Any] = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
}
"""The experts of the families' tiny models (models/tiny.py): 8 routed ones in 2 groups of 4, one group per token,
top-2 (megatron and transformers both score a group by its 2 best experts), and one shared expert."""


class SigmoidRouterMoE(Family):
    """MoE layers after `first_k_dense_replace` dense ones; n_shared_experts x moe_intermediate_size shared expert."""

    moe = True
    shared_expert_module = "shared_experts"

    def moe_fields(self, cfg: dict, num_layers: int, source: str) -> dict:
        num_experts, topk = self.experts_and_topk(cfg, source, self.model_type)
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise fail(source, f"scoring_func={cfg['scoring_func']!r} is not supported for {self.model_type}: only sigmoid")
        if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            raise fail(source, f"topk_method={cfg['topk_method']!r} is not supported: only noaux_tc (sigmoid scores + expert bias)")
        self.refuse_renormalised_top1(topk, bool(cfg.get("norm_topk_prob", True)), source, "with norm_topk_prob=true")
        if topk > 1 and not cfg.get("norm_topk_prob", True):
            raise fail(source, "norm_topk_prob=false is not supported: megatron-core's sigmoid router always renormalises the top-k")
        dense = read_int(cfg, "first_k_dense_replace", source, minimum=0)
        if cfg.get("moe_layer_freq", 1) != 1:
            raise fail(source, f"moe_layer_freq={cfg['moe_layer_freq']} is not supported: every layer after first_k_dense_replace is MoE")
        if dense >= num_layers:
            raise fail(source, f"first_k_dense_replace={dense} leaves no MoE layer among num_hidden_layers={num_layers}: use a dense family")
        groups, group_topk = self._groups(cfg, num_experts, topk, source)
        shared = read_int(cfg, "n_shared_experts", source, minimum=0) * read_int(cfg, "moe_intermediate_size", source)
        return dict(
            num_experts=num_experts,
            moe_ffn_hidden_size=read_int(cfg, "moe_intermediate_size", source),
            moe_topk=topk,
            norm_topk_prob=True,
            router_score="sigmoid",
            router_expert_bias=True,
            router_num_groups=groups,
            router_group_topk=group_topk,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            moe_layers=tuple(i >= dense for i in range(num_layers)),
            shared_expert_size=shared,
        )

    @staticmethod
    def _groups(cfg: dict, num_experts: int, topk: int, source: str) -> tuple[int, int]:
        groups = cfg.get("n_group") or 1
        group_topk = cfg.get("topk_group") or 1
        if groups == 1:
            return 0, 0
        if num_experts % groups or not 1 <= group_topk <= groups:
            raise fail(source, f"n_group={groups}, topk_group={group_topk}: n_group must divide {num_experts} experts and topk_group be in [1, n_group]")
        if topk // group_topk != 2 or num_experts // groups < 2:
            # transformers scores a group by its 2 best experts; megatron-core by its top (topk // topk_group).
            raise fail(
                source,
                f"n_group={groups} with num_experts_per_tok={topk} and topk_group={group_topk} is not supported: megatron-core "
                f"scores a group by its top num_experts_per_tok // topk_group = {topk // group_topk} experts, transformers by its top 2",
            )
        return groups, group_topk

    def randomise_tiny(self, model, generator) -> None:
        """transformers starts e_score_correction_bias at zero; a tiny model gets a random one so the bias matters."""
        import torch

        for name, buffer in model.named_buffers():
            if name.endswith("gate.e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))

    def router_fields(self, arch: HFArch) -> dict[str, Any]:
        return dict(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_pre_softmax=False,
            moe_router_dtype="fp32",
            moe_router_num_groups=arch.router_num_groups or None,
            moe_router_group_topk=arch.router_group_topk or None,
            moe_router_topk_scaling_factor=arch.routed_scaling_factor if arch.routed_scaling_factor != 1.0 else None,
        )
