"""The local (no Transformer Engine) layer spec pieces of multi-latent attention.

MLASelfAttention builds its core attention with `k_channels` / `v_channels`
(query/key heads of qk_nope + qk_rope dimensions, value heads of v_head_dim);
TE's attention takes them, megatron_rl's LocalCoreAttention (like megatron's
DotProductAttention) has no such arguments, although its computation (torch's
scaled_dot_product_attention) already takes keys and values of different
widths. This subclass accepts them; its output is heads x v_head_dim wide.
Imported only when a local MLA spec is built.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_rl.models.attention import LocalCoreAttention


class LatentCoreAttention(LocalCoreAttention):
    """LocalCoreAttention that takes MLA's k_channels / v_channels (the softmax scale comes from MLA)."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.k_channels, self.v_channels = k_channels, v_channels


def with_latent_attention(block_spec):
    """A copy of a local-spec block spec with LatentSelfAttention and LatentCoreAttention in its MLA layers."""

    def swap(layer_spec):
        attention = layer_spec.submodules.self_attention
        if attention.module is not MLASelfAttention or attention.submodules.core_attention is not LocalCoreAttention:
            return layer_spec
        inner = dataclasses.replace(attention.submodules, core_attention=LatentCoreAttention)
        attention = dataclasses.replace(attention, module=LatentSelfAttention, submodules=inner)
        return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention))

    return dataclasses.replace(block_spec, layer_specs=[swap(spec) for spec in block_spec.layer_specs])


class ReplicatedLinear(MegatronModule):
    """y = x W^T with the whole W on every tensor-parallel rank (returns (y, None) as megatron's linears do).

    Under sequence parallelism each rank multiplies its slice of the sequence, so W's
    gradient is a partial sum: W carries `sequence_parallel`, and megatron's
    finalize_model_grads sums it over the TP group (as for norms).
    """

    def __init__(self, input_size: int, output_size: int, config, init_method) -> None:
        super().__init__(config=config)
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor):
        return torch.matmul(x, self.weight.t()), None


class LatentSelfAttention(MLASelfAttention):
    """MLASelfAttention whose query and key/value down-projections are replicated over TP (TE's 'duplicated' mode).

    With the local spec megatron-core 0.16 builds them column-parallel, gathers
    their output and uses the gathered rotary key part k_rope directly: each TP
    rank's heads then back-propagate only their share of k_rope's gradient and
    nothing sums it (the TP > 1 gradient differs from the single rank's). With
    replicated down-projections megatron takes its other path, where k_rope is
    all-gathered over the sequence-parallel region and its gradient reduce-scattered.
    """

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        if config.q_lora_rank is not None:
            self.linear_q_down_proj = ReplicatedLinear(config.hidden_size, config.q_lora_rank, config, config.init_method)
        width = config.kv_lora_rank + config.qk_pos_emb_head_dim
        self.linear_kv_down_proj = ReplicatedLinear(config.hidden_size, width, config, config.init_method)
