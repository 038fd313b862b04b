"""The local (no Transformer Engine) core attention of multi-latent attention.

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

from megatron_rl.models.attention import LocalCoreAttention


class LatentCoreAttention(LocalCoreAttention):
    """LocalCoreAttention that takes MLA's k_channels / v_channels (the softmax scale comes from MLA)."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.k_channels, self.v_channels = k_channels, v_channels


def with_latent_core_attention(block_spec):
    """A copy of a local-spec block spec whose LocalCoreAttention layers take MLA's channel arguments."""

    def swap(layer_spec):
        attention = layer_spec.submodules.self_attention
        if attention.submodules.core_attention is not LocalCoreAttention:
            return layer_spec
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(attention.submodules, core_attention=LatentCoreAttention))
        return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention))

    return dataclasses.replace(block_spec, layer_specs=[swap(spec) for spec in block_spec.layer_specs])
