"""What every family shares: the Llama decoder (RMSNorm, rotary, GQA, SwiGLU), as a class to refine.

A family is one `Family` subclass in its own module of this package. It owns,
for the checkpoints of its HF model_type:

  * `parse`: config.json -> HFArch, refusing what megatron cannot reproduce;
  * `transformer_fields` / `config_class`: HFArch -> megatron TransformerConfig
    fields that describe the model (parallel, dtype and CPU settings are added
    by models/build.py for every family);
  * `layer_spec`, `gpt_model_kwargs`: the layer spec and GPTModel arguments;
  * `layer_names` / `layer_mapping`: the megatron parameters of one layer and
    their HF tensors (models/mapping.py holds the layouts and the model-wide names);
  * `tiny_config`: config.json keys of a tiny random model (models/tiny.py);
  * `attention_params` / `attention_replicated_params`: the planner's counts.

Importing a family imports neither torch nor megatron-core; methods that need
them import them when called.
"""

from __future__ import annotations

from typing import Any, ClassVar

from megatron_rl.models.arch import HFArch, fail, parse_rope, read_int

DENSE_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False}


class Family:
    """A Llama-shaped decoder: RMSNorm, rotary, GQA, SwiGLU, no biases. Subclasses change what differs."""

    model_type: ClassVar[str] = ""
    """HF model_type (the registry key)."""
    architectures: ClassVar[tuple[str, ...]] = ()
    """HF class names in config.json's `architectures`."""
    moe: ClassVar[bool] = False
    """Has routed experts."""
    defaults: ClassVar[dict[str, Any]] = DENSE_DEFAULTS
    """transformers' defaults for keys a config.json may leave out."""
    tiny_config: ClassVar[dict[str, Any]] = {}
    """config.json keys of a tiny random model beyond models/tiny.py's common sizes."""
    rope_types: ClassVar[tuple[str, ...]] = ("default", "linear", "llama3")
    """RoPE scaling types this family's megatron model reproduces."""
    partial_rotary: ClassVar[bool] = False
    """Rotary embeddings may cover only the first partial_rotary_factor of each head."""
    moe_block: ClassVar[str] = "mlp"
    """HF module holding a layer's router and experts."""
    expert_matrices: ClassVar[tuple[str, str, str]] = ("gate_proj", "up_proj", "down_proj")
    """HF names of an expert's gate, up and down projections."""
    expert_width_key: ClassVar[str] = "moe_intermediate_size"
    """config.json key of an expert's width."""
    shared_expert_module: ClassVar[str] = "shared_expert"
    """HF module of the shared expert(s) inside the MoE block."""

    # ---- config.json -> HFArch --------------------------------------------------------------

    def with_defaults(self, hf_config: dict) -> dict:
        """config.json with transformers' defaults for absent (or null) keys."""
        return {**self.defaults, **{k: v for k, v in hf_config.items() if v is not None or k not in self.defaults}}

    def check(self, cfg: dict, source: str) -> None:
        """Refuse what megatron cannot build the same way (keys named in the error)."""
        if cfg.get("hidden_act") != "silu":
            raise fail(source, f"hidden_act={cfg.get('hidden_act')!r} is not supported: megatron_rl builds SwiGLU (silu) MLPs only")
        if cfg.get("attention_bias"):
            raise fail(source, "attention_bias=true (bias on the output projection) is not supported: only q/k/v biases (qwen2) are")
        if cfg.get("mlp_bias"):
            raise fail(source, "mlp_bias=true is not supported: megatron_rl builds bias-free MLPs")
        if cfg.get("use_sliding_window"):
            raise fail(source, f"sliding-window attention (sliding_window={cfg.get('sliding_window')}) is not supported by megatron's local attention")
        layer_types = cfg.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise fail(source, f"layer_types with {sorted(set(layer_types))} is not supported: megatron_rl builds 'full_attention' layers only")

    def parse(self, hf_config: dict, source: str) -> HFArch:
        """Validate a config.json of this family and describe it."""
        cfg = self.with_defaults(hf_config)
        self.check(cfg, source)
        num_layers = read_int(cfg, "num_hidden_layers", source)
        fields: dict[str, Any] = dict(
            family=self.model_type,
            num_layers=num_layers,
            hidden_size=read_int(cfg, "hidden_size", source),
            ffn_hidden_size=read_int(cfg, "intermediate_size", source),
            vocab_size=read_int(cfg, "vocab_size", source),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            norm_eps=float(cfg["rms_norm_eps"]),
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
            **parse_rope(cfg, source, self.rope_types, partial_rotary=self.partial_rotary),
        )
        fields.update(self.attention_fields(cfg, source))
        if self.moe:
            fields.update(self.moe_fields(cfg, num_layers, source))
        return HFArch(**fields)

    def attention_fields(self, cfg: dict, source: str) -> dict:
        """Heads, groups, head width, q/k/v bias and q/k norm."""
        hidden = read_int(cfg, "hidden_size", source)
        heads = read_int(cfg, "num_attention_heads", source)
        groups = cfg.get("num_key_value_heads") or heads
        if not isinstance(groups, int) or heads % groups:
            raise fail(source, f"num_key_value_heads={groups!r} must be an integer dividing num_attention_heads={heads}")
        head_dim = cfg.get("head_dim") or hidden // heads
        return dict(num_attention_heads=heads, num_query_groups=groups, head_dim=int(head_dim))

    def moe_fields(self, cfg: dict, num_layers: int, source: str) -> dict:
        """Experts, top-k, router and which layers are MoE (families with experts override)."""
        raise NotImplementedError(f"{type(self).__name__} declares moe=True but does not parse its experts")

    @staticmethod
    def refuse_renormalised_top1(topk: int, renormalised: bool, source: str, why: str, fix: str = "") -> None:
        """Renormalising one weight makes it exactly 1.0: the router would get no gradient."""
        if topk == 1 and renormalised:
            raise fail(
                source,
                f"num_experts_per_tok=1 ({why}) is not supported: each token's expert weight would be exactly 1.0, "
                f"leaving the router no gradient; supported: num_experts_per_tok >= 2{fix}",
            )

    @staticmethod
    def experts_and_topk(cfg: dict, source: str, family: str) -> tuple[int, int]:
        """(routed experts, experts per token), validated."""
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise fail(source, f"num_experts / num_local_experts={num_experts!r}: a {family} model needs an integer >= 1")
        topk = read_int(cfg, "num_experts_per_tok", source)
        if topk > num_experts:
            raise fail(source, f"num_experts_per_tok={topk} exceeds the number of experts {num_experts}")
        return num_experts, topk

    def randomise_tiny(self, model, generator) -> None:
        """Draw the tiny random model's tensors that transformers initialises to constants (none here)."""

    # ---- HFArch -> megatron -----------------------------------------------------------------

    def config_class(self):
        """megatron-core's config class for this family."""
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig

    def transformer_fields(self, arch: HFArch) -> dict[str, Any]:
        """TransformerConfig fields that describe the model (architecture, router), not the run."""
        import torch

        fields: dict[str, Any] = dict(
            num_layers=arch.num_layers,
            hidden_size=arch.hidden_size,
            num_attention_heads=arch.num_attention_heads,
            num_query_groups=arch.num_query_groups,
            kv_channels=arch.head_dim,
            ffn_hidden_size=arch.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=arch.norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=arch.qkv_bias,
            qk_layernorm=arch.qk_norm,
        )
        if arch.num_experts:
            fields.update(self.router_fields(arch))
            fields.update(
                num_moe_experts=arch.num_experts,
                moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
                moe_router_topk=arch.moe_topk,
                moe_layer_freq=[int(m) for m in arch.moe_layers],
                moe_shared_expert_intermediate_size=arch.shared_expert_size or None,
                moe_shared_expert_gate=arch.shared_expert_gate,
            )
        return fields

    def router_fields(self, arch: HFArch) -> dict[str, Any]:
        """megatron's router settings reproducing this family's routing."""
        return dict(
            # Softmax over all experts then top-k (no renormalisation) is megatron's pre-softmax
            # mode; top-k over logits then softmax over the k equals softmax -> top-k -> renormalise.
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_dtype="fp32",
        )

    def layer_spec(self, config, use_te: bool):
        """The decoder block spec (dense and MoE layers as config.moe_layer_freq says).

        The local spec's core attention is megatron_rl's LocalCoreAttention (packed THD sequences and
        context parallelism, which megatron's local DotProductAttention refuses); TE's spec is as is.
        """
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm")
        if use_te:
            return spec
        from megatron_rl.models.attention import with_local_core_attention

        return with_local_core_attention(spec)

    def gpt_model_kwargs(self, arch: HFArch) -> dict[str, Any]:
        """GPTModel arguments for positions: rotary base and scaling."""
        kwargs: dict[str, Any] = dict(
            position_embedding_type="rope",
            rotary_base=int(arch.rope_base) if float(arch.rope_base).is_integer() else arch.rope_base,
            rotary_percent=arch.rotary_percent,
        )
        if arch.rope_scaling and arch.rope_scaling[0] == "llama3":
            kwargs.update(rope_scaling=True, rope_scaling_factor=arch.rope_scaling[1])
        elif arch.rope_scaling:
            kwargs.update(seq_len_interpolation_factor=arch.rope_scaling[1])
        return kwargs

    # ---- megatron <-> HF names --------------------------------------------------------------

    def attention_names(self, arch: HFArch, prefix: str) -> list[str]:
        """megatron parameters of one layer's attention (local spec names), `prefix` = decoder.layers.<i>."""
        names = [f"{prefix}.self_attention.linear_qkv.weight"]
        if arch.qkv_bias:
            names.append(f"{prefix}.self_attention.linear_qkv.bias")
        if arch.qk_norm:
            names += [f"{prefix}.self_attention.q_layernorm.weight", f"{prefix}.self_attention.k_layernorm.weight"]
        return names + [f"{prefix}.self_attention.linear_proj.weight"]

    def layer_names(self, arch: HFArch, layer: int) -> list[str]:
        """megatron parameters (and mapped buffers) of one layer of the single-rank model, in order."""
        p = f"decoder.layers.{layer}"
        names = [f"{p}.input_layernorm.weight", *self.attention_names(arch, p), f"{p}.pre_mlp_layernorm.weight"]
        if arch.moe_layers and arch.moe_layers[layer]:
            names.append(f"{p}.mlp.router.weight")
            if arch.router_expert_bias:
                names.append(f"{p}.mlp.router.expert_bias")
            for e in range(arch.num_experts):
                names += [f"{p}.mlp.experts.local_experts.{e}.linear_fc1.weight", f"{p}.mlp.experts.local_experts.{e}.linear_fc2.weight"]
            if arch.shared_expert_size:
                names += [f"{p}.mlp.shared_experts.linear_fc1.weight", f"{p}.mlp.shared_experts.linear_fc2.weight"]
                if arch.shared_expert_gate:
                    names.append(f"{p}.mlp.shared_experts.gate_weight")
        else:
            names += [f"{p}.mlp.linear_fc1.weight", f"{p}.mlp.linear_fc2.weight"]
        return names

    def attention_mapping(self, arch: HFArch, hf: str, rest: str):
        """Mapping of one attention parameter (`rest` after decoder.layers.<i>.), or None."""
        from megatron_rl.models.layer_maps import QKV, Direct

        attn = f"{hf}.self_attn"
        simple = {
            "self_attention.linear_proj.weight": Direct(f"{attn}.o_proj.weight", tp_dim=1),
            "self_attention.q_layernorm.weight": Direct(f"{attn}.q_norm.weight"),
            "self_attention.k_layernorm.weight": Direct(f"{attn}.k_norm.weight"),
        }
        if rest in simple:
            return simple[rest]
        for kind in ("weight", "bias"):
            if rest == f"self_attention.linear_qkv.{kind}":
                projections = (f"{attn}.q_proj.{kind}", f"{attn}.k_proj.{kind}", f"{attn}.v_proj.{kind}")
                return QKV(*projections, arch.num_attention_heads, arch.num_query_groups, arch.head_dim)
        return None

    def layer_mapping(self, arch: HFArch, layer: int, rest: str):
        """Mapping of one parameter of layer `layer` (`rest` after decoder.layers.<i>.), or None."""
        from megatron_rl.models.layer_maps import Direct, GatedFC1, expert_mapping, grouped_mapping_for

        hf = f"model.layers.{layer}"
        moe = f"{hf}.{self.moe_block}"
        shared = f"{moe}.{self.shared_expert_module}"
        simple = {
            "input_layernorm.weight": Direct(f"{hf}.input_layernorm.weight"),
            "self_attention.linear_qkv.layer_norm_weight": Direct(f"{hf}.input_layernorm.weight"),  # TE spec
            "self_attention.linear_q_down_proj.layer_norm_weight": Direct(f"{hf}.input_layernorm.weight"),  # TE spec, MLA
            "pre_mlp_layernorm.weight": Direct(f"{hf}.post_attention_layernorm.weight"),
            "mlp.linear_fc1.layer_norm_weight": Direct(f"{hf}.post_attention_layernorm.weight"),  # TE spec, dense
            "mlp.linear_fc1.weight": GatedFC1(f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"),
            "mlp.linear_fc2.weight": Direct(f"{hf}.mlp.down_proj.weight", tp_dim=1),
            "mlp.router.weight": Direct(f"{moe}.gate.weight"),
            "mlp.router.expert_bias": Direct(f"{moe}.gate.e_score_correction_bias"),
            "mlp.shared_experts.linear_fc1.weight": GatedFC1(f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"),
            "mlp.shared_experts.linear_fc2.weight": Direct(f"{shared}.down_proj.weight", tp_dim=1),
            "mlp.shared_experts.gate_weight": Direct(f"{moe}.shared_expert_gate.weight"),
        }
        if rest in simple:
            return simple[rest]
        attention = self.attention_mapping(arch, hf, rest)
        if attention is not None:
            return attention
        grouped = grouped_mapping_for(rest, f"{moe}.experts", arch.num_experts, self.expert_matrices)  # GroupedMLP
        return grouped if grouped is not None else expert_mapping(rest, f"{moe}.experts", self.expert_matrices)

    def hf_name_ignored(self, arch: HFArch, hf_name: str) -> bool:
        """A checkpoint tensor transformers does not load either (e.g. multi-token-prediction layers)."""
        return False

    @staticmethod
    def layer_of(hf_name: str) -> int:
        """The layer number of model.layers.<i>.* (-1 for other names)."""
        parts = hf_name.split(".")
        return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else -1

    # ---- planner counts ---------------------------------------------------------------------

    def attention_params(self, arch: HFArch) -> int:
        """Weights of one layer's attention: q h x a d, k and v h x g d, o a d x h (+ q/k/v biases, + q/k norms 2d)."""
        h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
        params = h * q + 2 * h * kv + q * h
        if arch.qkv_bias:
            params += q + 2 * kv
        return params + self.attention_replicated_params(arch)

    def attention_replicated_params(self, arch: HFArch) -> int:
        """The part of `attention_params` every TP rank holds whole (q/k norms)."""
        return 2 * arch.head_dim if arch.qk_norm else 0

    def kv_cache_values_per_token(self, arch: HFArch, tensor_parallel: int) -> float:
        """Values one token takes in one layer of one engine rank's KV cache: k and v of its KV heads.

        vLLM replicates KV heads when TP exceeds them: ceil(g / TP) heads per rank.
        """
        return 2 * -(-arch.num_query_groups // tensor_parallel) * arch.head_dim


class SoftmaxMoEFamily(Family):
    """Qwen-style MoE: softmax router, optional renormalisation, dense layers from mlp_only_layers / decoder_sparse_step."""

    moe = True

    def moe_fields(self, cfg: dict, num_layers: int, source: str) -> dict:
        num_experts, topk = self.experts_and_topk(cfg, source, self.model_type)
        step = read_int(cfg, "decoder_sparse_step", source)
        mlp_only = cfg.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or any(not isinstance(i, int) or not 0 <= i < num_layers for i in mlp_only):
            raise fail(source, f"mlp_only_layers={mlp_only!r}: expected a list of layer indices in [0, {num_layers})")
        # transformers: layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
        moe_layers = tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))
        if not any(moe_layers):
            raise fail(source, f"mlp_only_layers={mlp_only} and decoder_sparse_step={step} leave no MoE layer: use a dense family")
        self.refuse_renormalised_top1(
            topk, bool(cfg["norm_topk_prob"]), source, "with norm_topk_prob=true", ", or norm_topk_prob=false (top-1 weight = the softmax probability)"
        )
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        return dict(
            num_experts=num_experts,
            moe_ffn_hidden_size=read_int(cfg, "moe_intermediate_size", source),
            moe_topk=topk,
            norm_topk_prob=bool(cfg["norm_topk_prob"]),
            moe_layers=moe_layers,
            shared_expert_size=shared,
            # Qwen2-MoE gates its shared expert; a qwen3_moe config with a shared expert follows the same layout.
            shared_expert_gate=shared > 0,
        )
