"""GLM-4.5 / GLM-4.5-Air (Glm4MoeForCausalLM).

Attention: GQA with biases on q/k/v (attention_bias; the output projection has
none), an optional per-head RMSNorm on queries and keys (use_qk_norm), and
rotary embeddings on the first partial_rotary_factor of each head (rotate-half
layout; megatron's rotary_percent). MoE: the sigmoid router with expert bias,
groups and scaling of sigmoid_moe.py, a shared expert of n_shared_experts x
moe_intermediate_size, after first_k_dense_replace dense layers.
"""

from __future__ import annotations

from megatron_rl.models.families.base import DENSE_DEFAULTS
from megatron_rl.models.families.sigmoid_moe import TINY_GROUPED_EXPERTS, SigmoidRouterMoE
from megatron_rl.models.arch import HFArch


class Glm4Moe(SigmoidRouterMoE):
    model_type = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    partial_rotary = True
    defaults = {
        **DENSE_DEFAULTS,
        "rms_norm_eps": 1e-5,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "use_qk_norm": False,
        "partial_rotary_factor": 0.5,
    }
    # Head width 32 (vLLM's CPU attention), half of it rotated; q/k/v biases and q/k norms;
    # the grouped experts of sigmoid_moe with routed scaling; layer 0 dense.
    tiny_config = {
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "use_qk_norm": True,
        **TINY_GROUPED_EXPERTS,
        "routed_scaling_factor": 1.5,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
    }

    def check(self, cfg: dict, source: str) -> None:
        super().check({**cfg, "attention_bias": False}, source)  # GLM's attention_bias means q/k/v biases only

    def attention_fields(self, cfg: dict, source: str) -> dict:
        return {**super().attention_fields(cfg, source), "qkv_bias": bool(cfg["attention_bias"]), "qk_norm": bool(cfg["use_qk_norm"])}

    def hf_name_ignored(self, arch: HFArch, hf_name: str) -> bool:
        # Multi-token-prediction layers (num_nextn_predict_layers) follow the decoder's layers; transformers skips them too.
        return self.layer_of(hf_name) >= arch.num_layers
