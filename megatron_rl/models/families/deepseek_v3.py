"""DeepSeek-V3 (DeepseekV3ForCausalLM; also Moonlight and Kimi-K2, which share its model_type).

Multi-latent attention (DeepSeek-V2, arXiv 2405.04434, Sec. 2.1.2, Eq. 9-19):
    c_q = RMSNorm(W_DQ h)                     q_a_proj, q_a_layernorm (q_lora_rank)
    [q_nope; q_rope] = W_UQ c_q               q_b_proj, per head qk_nope_head_dim + qk_rope_head_dim
    [c_kv; k_rope] = W_DKV h                  kv_a_proj_with_mqa (kv_lora_rank + qk_rope_head_dim)
    [k_nope; v] = W_UKV RMSNorm(c_kv)         kv_a_layernorm, kv_b_proj, per head nope + v_head_dim
    q_rope, k_rope rotated (k_rope shared by all heads); softmax scale 1/sqrt(nope + rope) x mscale^2 (YaRN)
megatron-core's MLASelfAttention computes the same from linear_q_down_proj,
q_layernorm, linear_q_up_proj, linear_kv_down_proj, kv_layernorm,
linear_kv_up_proj. DeepSeek's checkpoints keep the rotary dimensions in
interleaved pairs (rope_interleave), which is how megatron's MLA reads them;
a checkpoint with rope_interleave=false has its rotary rows put in pair order
by the mapping (mapping.RopeRows).

MoE: the sigmoid router with expert bias, groups and scaling of
sigmoid_moe.py, after first_k_dense_replace dense layers.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.families.base import DENSE_DEFAULTS
from megatron_rl.models.families.sigmoid_moe import TINY_GROUPED_EXPERTS, SigmoidRouterMoE
from megatron_rl.models.arch import HFArch, fail, read_int


class DeepseekV3(SigmoidRouterMoE):
    model_type = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    rope_types = ("default", "yarn")
    defaults = {
        **DENSE_DEFAULTS,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "rope_interleave": True,
    }
    # Head widths >= 32 (vLLM's CPU attention); the grouped experts of sigmoid_moe; layer 0 dense.
    tiny_config = {
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 32,
        **TINY_GROUPED_EXPERTS,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "rope_interleave": True,
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
        # As the published configs say (vLLM builds the expert bias only for noaux_tc).
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }

    def attention_fields(self, cfg: dict, source: str) -> dict:
        heads = read_int(cfg, "num_attention_heads", source)
        if (cfg.get("num_key_value_heads") or heads) != heads:
            raise fail(source, f"num_key_value_heads={cfg['num_key_value_heads']} differs from num_attention_heads={heads}: multi-latent attention has one key/value head per query head")
        q_lora = cfg.get("q_lora_rank", 1536)  # transformers' default when absent; null = queries projected directly
        if q_lora is not None:
            q_lora = read_int(cfg, "q_lora_rank", source)
        return dict(
            num_attention_heads=heads,
            num_query_groups=heads,
            head_dim=read_int(cfg, "v_head_dim", source),
            q_lora_rank=q_lora or 0,
            kv_lora_rank=read_int(cfg, "kv_lora_rank", source),
            qk_nope_head_dim=read_int(cfg, "qk_nope_head_dim", source),
            qk_rope_head_dim=read_int(cfg, "qk_rope_head_dim", source),
            rope_interleaved=bool(cfg.get("rope_interleave", True)),
        )

    # ---- megatron ---------------------------------------------------------------------------

    def config_class(self):
        from megatron.core.transformer import MLATransformerConfig

        return MLATransformerConfig

    def transformer_fields(self, arch: HFArch) -> dict[str, Any]:
        fields = super().transformer_fields(arch)
        yarn = dict(arch.rope_yarn)
        fields.update(
            multi_latent_attention=True,
            qk_layernorm=True,  # the q/kv latents' RMSNorms (q_a_layernorm, kv_a_layernorm)
            kv_channels=arch.head_dim,
            q_lora_rank=arch.q_lora_rank or None,
            kv_lora_rank=arch.kv_lora_rank,
            qk_head_dim=arch.qk_nope_head_dim,
            qk_pos_emb_head_dim=arch.qk_rope_head_dim,
            v_head_dim=arch.head_dim,
            rotary_base=arch.rope_base,
            rope_type="yarn" if arch.rope_scaling else "rope",
            rotary_scaling_factor=arch.rope_scaling[1] if arch.rope_scaling else 1.0,
            original_max_position_embeddings=int(yarn.get("original_max_position_embeddings", arch.max_position_embeddings)),
            beta_fast=yarn.get("beta_fast", 32.0),
            beta_slow=yarn.get("beta_slow", 1.0),
            mscale=yarn.get("mscale", 1.0),
            mscale_all_dim=yarn.get("mscale_all_dim", 0.0),
        )
        return fields

    def layer_spec(self, config, use_te: bool):
        spec = super().layer_spec(config, use_te)
        if use_te:
            return spec
        from megatron_rl.models.families.mla_local import with_latent_attention

        return with_latent_attention(spec)

    def gpt_model_kwargs(self, arch: HFArch) -> dict[str, Any]:
        # Rotary embeddings live inside MLASelfAttention (from the config's rope_type).
        return dict(position_embedding_type="rope", rotary_base=arch.rope_base)

    # ---- names ------------------------------------------------------------------------------

    def attention_names(self, arch: HFArch, prefix: str) -> list[str]:
        a = f"{prefix}.self_attention"
        if arch.q_lora_rank:
            q = [f"{a}.linear_q_down_proj.weight", f"{a}.q_layernorm.weight", f"{a}.linear_q_up_proj.weight"]
        else:
            q = [f"{a}.linear_q_proj.weight"]
        kv = [f"{a}.linear_kv_down_proj.weight", f"{a}.kv_layernorm.weight", f"{a}.linear_kv_up_proj.weight"]
        return q + kv + [f"{a}.linear_proj.weight"]

    def attention_mapping(self, arch: HFArch, hf: str, rest: str):
        from megatron_rl.models.layer_maps import Direct, RopeRows

        attn = f"{hf}.self_attn"
        rope, nope = arch.qk_rope_head_dim, arch.qk_nope_head_dim

        def rotary_rows(name: str, block: int, tp_dim: int | None = 0):
            # megatron's MLA reads rotary dimensions in pairs, as DeepSeek stores them (rope_interleave).
            return Direct(name, tp_dim=tp_dim) if arch.rope_interleaved else RopeRows(name, block=block, rope=rope, tp_dim=tp_dim)

        table = {
            # The down-projections are replicated over TP (TE's duplicated linears; mla_local.LatentSelfAttention).
            "self_attention.linear_q_down_proj.weight": Direct(f"{attn}.q_a_proj.weight"),
            "self_attention.q_layernorm.weight": Direct(f"{attn}.q_a_layernorm.weight"),
            "self_attention.linear_q_up_proj.layer_norm_weight": Direct(f"{attn}.q_a_layernorm.weight"),  # TE spec
            "self_attention.linear_q_up_proj.weight": rotary_rows(f"{attn}.q_b_proj.weight", nope + rope),
            "self_attention.linear_q_proj.weight": rotary_rows(f"{attn}.q_proj.weight", nope + rope),
            "self_attention.linear_kv_down_proj.weight": rotary_rows(f"{attn}.kv_a_proj_with_mqa.weight", arch.kv_lora_rank + rope, None),
            "self_attention.kv_layernorm.weight": Direct(f"{attn}.kv_a_layernorm.weight"),
            "self_attention.linear_kv_up_proj.layer_norm_weight": Direct(f"{attn}.kv_a_layernorm.weight"),  # TE spec
            "self_attention.linear_kv_up_proj.weight": Direct(f"{attn}.kv_b_proj.weight", tp_dim=0),
            "self_attention.linear_proj.weight": Direct(f"{attn}.o_proj.weight", tp_dim=1),
        }
        return table.get(rest)

    def hf_name_ignored(self, arch: HFArch, hf_name: str) -> bool:
        # Multi-token-prediction layers (num_nextn_predict_layers) follow the decoder's layers; transformers skips them too.
        return self.layer_of(hf_name) >= arch.num_layers

    # ---- planner ----------------------------------------------------------------------------

    def attention_params(self, arch: HFArch) -> int:
        """q: h x r_q + r_q x a (n + p) (or h x a (n + p)); kv: h x (r_kv + p) + r_kv x a (n + v); o: a v x h; norms r_q + r_kv."""
        h, a, n, p, v = arch.hidden_size, arch.num_attention_heads, arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.head_dim
        r_q, r_kv = arch.q_lora_rank, arch.kv_lora_rank
        q = h * r_q + r_q * a * (n + p) if r_q else h * a * (n + p)
        kv = h * (r_kv + p) + r_kv * a * (n + v)
        return q + kv + a * v * h + r_q + r_kv

    def attention_replicated_params(self, arch: HFArch) -> int:
        """The latents' norms and the down-projections (replicated over TP, as TE's duplicated linears)."""
        h, p, r_q, r_kv = arch.hidden_size, arch.qk_rope_head_dim, arch.q_lora_rank, arch.kv_lora_rank
        return r_q + r_kv + h * r_q + h * (r_kv + p)

    def kv_cache_values_per_token(self, arch: HFArch, tensor_parallel: int) -> float:
        """vLLM's MLA caches one latent per token and layer (kv_lora_rank + qk_rope_head_dim), on every TP rank."""
        return arch.kv_lora_rank + arch.qk_rope_head_dim
