"""Hugging Face <-> megatron-core parameter names and layouts, per model family.

One table serves every direction: loading an HF checkpoint into any TP/PP/EP
layout (models/loading.py), exporting megatron weights as HF tensors for weight
sync into vLLM and for the HF converters (models/export.py).

Names. A megatron parameter is named here by its *global* name: the name the
single-rank model (TP = PP = EP = 1) gives it, so layer and expert numbers are
global. On a rank, `GlobalNamer` turns local names into global ones:

    PP stage 1 of 2, 4 layers:  decoder.layers.0.*  -> decoder.layers.2.*
    EP rank 1 of 2, 8 experts:  mlp.experts.local_experts.0.* -> ...local_experts.4.*

Layouts (the transforms a mapping applies; HF Linear weights are [out, in]):

    linear_qkv    [G x (q_per_group + 2) x d, H]: per query group g, its q heads,
                  then k_g, then v_g (q/k/v_proj interleaved per group); TP splits
                  whole groups, so a rank with groups [g0, g1) reads only those rows.
    linear_fc1    [gate; up] stacked on dim 0; TP rank r holds [gate_r; up_r].
    linear_proj,  row-parallel: TP splits the input dim (dim 1).
    linear_fc2
    embedding,    vocabulary rows padded with zeros to megatron's padded vocab
    output_layer  (a multiple of 128 x TP); the padding is stripped on export.
    norms, router, shared-expert gate: replicated, copied as they are.

The mapping kinds are in models/layer_maps.py, the per-layer tables in each
family (models/families/); this module names parameters and asks a model's
family for the mapping of each. Each mapping knows its TP split dim;
`check_split_dim` compares it with the attributes megatron sets on the
parameter, so a wrong table entry fails loudly.
"""

from __future__ import annotations

import re

import torch

from megatron_rl.models.arch import HFArch, UnsupportedModelError
from megatron_rl.models.families import get_family
from megatron_rl.models.layer_maps import (
    QKV,
    Direct,
    GatedFC1,
    GroupedExperts,
    HFReader,
    Mapping,
    RopeRows,
    Shard,
    VocabPadded,
    expert_mapping,
    grouped_expert_mapping,
    grouped_mapping_for,
)


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
def mapping_for(arch: HFArch, global_name: str, padded_vocab: int) -> Mapping:
    """The mapping of one megatron parameter (by global name) of a model described by `arch`."""
    vocab = arch.vocab_size
    if global_name == "embedding.word_embeddings.weight":
        return VocabPadded("model.embed_tokens.weight", vocab, padded_vocab)
    if global_name == "output_layer.weight":
        if arch.tie_word_embeddings:  # the last stage's copy of the embedding (PP > 1): loaded, not exported
            return VocabPadded("model.embed_tokens.weight", vocab, padded_vocab, export_name=None)
        return VocabPadded("lm_head.weight", vocab, padded_vocab)
    if global_name == "decoder.final_layernorm.weight":
        return Direct("model.norm.weight")
    match = _LAYER.fullmatch(global_name)
    mapping = get_family(arch.family).layer_mapping(arch, int(match.group(1)), match.group(2)) if match else None
    if mapping is None:
        raise UnsupportedModelError(
            f"megatron parameter {global_name!r} has no Hugging Face counterpart in the {arch.family} mapping "
            f"(megatron_rl/models/families/{arch.family}.py): the model was built with a feature the mapping does not cover"
        )
    return mapping


def global_mcore_names(arch: HFArch) -> list[str]:
    """Every parameter (and mapped buffer) of the single-rank megatron model of `arch`, in model order (local spec names)."""
    family = get_family(arch.family)
    names = ["embedding.word_embeddings.weight"]
    for layer in range(arch.num_layers):
        names += family.layer_names(arch, layer)
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def expected_hf_names(arch: HFArch) -> list[str]:
    """Every tensor an HF checkpoint of `arch` holds, in model order (no lm_head when tied)."""
    out: list[str] = []
    for name in global_mcore_names(arch):
        out += mapping_for(arch, name, arch.vocab_size).hf_names
    return out


def hf_to_mcore_names(arch: HFArch) -> dict[str, str]:
    """HF tensor name -> the global megatron parameter it goes into."""
    return {hf: mc for mc in global_mcore_names(arch) for hf in mapping_for(arch, mc, arch.vocab_size).hf_names}


def check_split_dim(global_name: str, mapping: Mapping, param: torch.Tensor, *, strict: bool = True) -> None:
    """Fail when the table's TP split dim disagrees with the one megatron set on the parameter.

    strict=False (Transformer Engine spec) checks only parameters that carry megatron's
    attributes: TE's expert linears are built unsplit and left unmarked.
    """
    marked = getattr(param, "tensor_model_parallel", None)
    if not strict and marked is None:
        return
    megatron_dim = param.partition_dim if marked else None
    if megatron_dim != mapping.tp_dim:
        raise AssertionError(
            f"mapping of {global_name!r} splits TP along dim {mapping.tp_dim}, megatron along dim {megatron_dim}: "
            "fix the table in megatron_rl/models/mapping.py"
        )


_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)|(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)()")
_LOCAL_GROUPED = re.compile(r".*\.mlp\.experts\.weight[12]")
_LOCAL_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")


class GlobalNamer:
    """Local parameter names of one model chunk -> global names (layer offset for PP, expert offset for EP).

    GroupedMLP's fused weight1 / weight2 hold all of an EP rank's experts: their global name gets the range,
    decoder.layers.3.mlp.experts.weight1 -> decoder.layers.3.mlp.experts.weight1[4:8] on EP rank 1 of 2 (8 experts).
    """

    def __init__(self, model: torch.nn.Module, ep_rank: int, num_local_experts: int) -> None:
        self._layer_numbers = [layer.layer_number - 1 for layer in model.decoder.layers] if hasattr(model, "decoder") else []
        self._expert_offset = ep_rank * num_local_experts
        self._num_local_experts = num_local_experts

    def __call__(self, local_name: str) -> str:
        match = _LOCAL_LAYER.fullmatch(local_name)
        if not match:
            return local_name
        name = f"decoder.layers.{self._layer_numbers[int(match.group(1))]}.{match.group(2)}"
        expert = _LOCAL_EXPERT.fullmatch(name)
        if expert:
            head, index, tail = (expert.group(1, 2, 3) if expert.group(1) is not None else expert.group(4, 5, 6))
            name = f"{head}{int(index) + self._expert_offset}{tail}"
        elif _LOCAL_GROUPED.fullmatch(name):
            name = f"{name}[{self._expert_offset}:{self._expert_offset + self._num_local_experts}]"
        return name


MAPPED_BUFFERS = ("router.expert_bias",)
"""Buffers that are model weights too (the sigmoid router's expert bias: HF e_score_correction_bias)."""


def named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A model's parameters plus the buffers HF checkpoints hold as weights (MAPPED_BUFFERS), local names."""
    weights: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    weights += [(name, buffer) for name, buffer in model.named_buffers() if buffer is not None and name.endswith(MAPPED_BUFFERS)]
    return weights


def is_expert_param(global_name: str) -> bool:
    """Routed-expert weights live in the expert-parallel layout (EP x expert TP); the rest in TP."""
    return ".mlp.experts." in global_name


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


__all__ = [  # the mapping kinds live in models.layer_maps (below the families); named here for callers
    "MAPPED_BUFFERS", "QKV", "Direct", "GatedFC1", "GlobalNamer", "GroupedExperts", "HFReader", "Mapping", "RopeRows",
    "Shard", "VocabPadded", "check_split_dim", "expected_hf_names", "expert_mapping", "global_mcore_names",
    "grouped_expert_mapping", "grouped_mapping_for", "hf_to_mcore_names", "is_expert_param", "mapping_for",
    "named_weights", "unwrap_model",
]
