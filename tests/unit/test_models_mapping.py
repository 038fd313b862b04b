"""The HF <-> megatron mapping in isolation: names, layouts per TP rank, and exact round trips.

Layouts are checked against explicit constructions written here from
megatron's documented layouts (not against the mapping's own output), and the
HF names against the state dict transformers itself builds for each family.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import expected_hf_names, global_mcore_names, hf_to_mcore_names, mapping_for, parse_hf_config
from megatron_rl.models.mapping import GatedFC1, QKV, Shard, VocabPadded
from megatron_rl.models.tiny import FAMILIES, tiny_hf_config


class DictReader:
    """HFReader over a dict of tensors."""

    def __init__(self, tensors):
        self.tensors = tensors

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, dim=None, start=0, stop=None):
        tensor = self.tensors[name]
        return tensor if dim is None else tensor.narrow(dim, start, (stop if stop is not None else tensor.shape[dim]) - start)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_names_match_what_transformers_saves(family, tmp_path):
    """transformers >= 5 fuses experts in memory but saves one tensor per expert (what vLLM loads too)."""
    from safetensors import safe_open

    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / family, family, with_tokenizer=False)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as fh:
        saved = set(fh.keys())
    arch = parse_hf_config(tiny_hf_config(family))
    assert saved == set(expected_hf_names(arch))
    assert set(hf_to_mcore_names(arch)) == saved


def test_qkv_layout_is_interleaved_per_query_group():
    heads, groups, d, hidden = 8, 2, 3, 5
    q, k, v = torch.randn(heads * d, hidden), torch.randn(groups * d, hidden), torch.randn(groups * d, hidden)
    reader = DictReader({"q": q, "k": k, "v": v})
    mapping = QKV("q", "k", "v", heads, groups, d)
    per_group = heads // groups
    # megatron: for each group g: its 4 query heads, then k_g, then v_g.
    expected = torch.cat([torch.cat([q[g * per_group * d : (g + 1) * per_group * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]) for g in range(groups)])
    assert torch.equal(mapping.load(reader, Shard(0)), expected)
    # TP2: rank r holds whole group r.
    assert torch.equal(mapping.load(reader, Shard(0, 1, 2)), expected[expected.shape[0] // 2 :])
    out = mapping.export([mapping.load(reader, Shard(0, r, 2)) for r in range(2)])
    assert [name for name, _ in out] == ["q", "k", "v"]
    assert all(torch.equal(a, b) for (_, a), b in zip(out, [q, k, v]))


def test_fc1_tp_rank_holds_its_gate_and_up_rows():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    mapping = GatedFC1("g", "u")
    reader = DictReader({"g": gate, "u": up})
    assert torch.equal(mapping.load(reader, Shard(0)), torch.cat([gate, up]))
    assert torch.equal(mapping.load(reader, Shard(0, 1, 2)), torch.cat([gate[4:], up[4:]]))
    out = dict(mapping.export([mapping.load(reader, Shard(0, r, 2)) for r in range(2)]))
    assert torch.equal(out["g"], gate) and torch.equal(out["u"], up)


def test_vocab_padding_and_stripping():
    embed = torch.randn(200, 4)
    mapping = VocabPadded("e", 200, 256)
    reader = DictReader({"e": embed})
    shards = [mapping.load(reader, Shard(0, r, 2)) for r in range(2)]
    assert shards[0].shape == shards[1].shape == (128, 4)
    assert torch.equal(shards[0], embed[:128]) and torch.equal(shards[1][:72], embed[128:]) and not shards[1][72:].any()
    ((name, back),) = mapping.export(shards)
    assert name == "e" and torch.equal(back, embed)
    assert VocabPadded("e", 200, 256, export_name=None).export(shards) == []


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_every_parameter_is_bit_exact(family, tp):
    config = tiny_hf_config(family, tie_word_embeddings=family == "qwen2", vocab_size=250)
    arch = parse_hf_config(config)
    torch.manual_seed(0)
    tensors = {name: torch.randn(shape) for name, shape in _hf_shapes(config).items()}
    reader = DictReader(tensors)
    padded = 256 * tp if tp > 1 else 256
    back = {}
    for name in global_mcore_names(arch):
        mapping = mapping_for(arch, name, padded)
        shards = [mapping.load(reader, Shard(mapping.tp_dim, r, tp if mapping.tp_dim is not None else 1)) for r in range(tp if mapping.tp_dim is not None else 1)]
        if mapping.tp_dim is not None:
            assert len({s.shape for s in shards}) == 1
        for hf_name, tensor in mapping.export(shards):
            assert hf_name not in back
            back[hf_name] = tensor
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name


def _hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    arch = parse_hf_config(config)
    shapes = {}
    for name in expected_hf_names(arch):
        shapes[name] = _shape_of(name, arch)
    return shapes


def _shape_of(name: str, arch) -> tuple[int, ...]:
    h, d, hq, g = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_query_groups
    expert_width = arch.moe_ffn_hidden_size
    nope, rope, r_q, r_kv = arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.q_lora_rank, arch.kv_lora_rank
    table = {
        # multi-latent attention (transformers' DeepseekV3Attention)
        "q_a_proj.weight": (r_q, h),
        "q_a_layernorm.weight": (r_q,),
        "q_b_proj.weight": (hq * (nope + rope), r_q),
        "kv_a_proj_with_mqa.weight": (r_kv + rope, h),
        "kv_a_layernorm.weight": (r_kv,),
        "kv_b_proj.weight": (hq * (nope + d), r_kv),
        "e_score_correction_bias": (arch.num_experts,),
        "embed_tokens.weight": (arch.vocab_size, h),
        "lm_head.weight": (arch.vocab_size, h),
        "q_proj.weight": (hq * d, h),
        "k_proj.weight": (g * d, h),
        "v_proj.weight": (g * d, h),
        "q_proj.bias": (hq * d,),
        "k_proj.bias": (g * d,),
        "v_proj.bias": (g * d,),
        "o_proj.weight": (h, hq * d),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "gate.weight": (arch.num_experts, h),
        "shared_expert_gate.weight": (1, h),
    }
    if arch.kv_lora_rank:  # multi-latent attention without a query latent: q_proj of nope + rope per head
        table["q_proj.weight"] = (hq * (nope + rope), h)
    for suffix, shape in table.items():
        if name.endswith(suffix):
            return shape
    if name.endswith("norm.weight"):
        return (h,)
    width = arch.shared_expert_size if ("shared_expert." in name or "shared_experts." in name) else expert_width if ".experts." in name else arch.ffn_hidden_size
    if name.endswith(("down_proj.weight", "w2.weight")):
        return (h, width)
    return (width, h)


def test_unknown_megatron_parameter_is_named():
    from megatron_rl.models import UnsupportedModelError

    arch = parse_hf_config(tiny_hf_config("llama"))
    with pytest.raises(UnsupportedModelError, match="decoder.layers.0.mlp.linear_fc1.bias"):
        mapping_for(arch, "decoder.layers.0.mlp.linear_fc1.bias", 256)
