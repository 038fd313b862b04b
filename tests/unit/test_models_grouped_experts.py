"""Grouped-GEMM expert layouts of megatron-core <-> HF per-expert tensors.

megatron-core's grouped expert modules (TEGroupedMLP: Transformer Engine;
GroupedMLP: the grouped_gemm kernels) need a GPU to run, so these tests check
the name, shape and value mapping only, against tensors built here by hand in
the layout megatron-core documents (transformer/moe/experts.py):

  TEGroupedMLP  mlp.experts.linear_fc1.weight<e>, linear_fc2.weight<e>: per local
                expert e the same tensor SequentialMLP holds ([gate_r; up_r], [H, ffn/TP]).
  GroupedMLP    weight1 [H, E_local x 2 ffn/TP], read as weight1.view(E_local, H, 2 ffn/TP)
                whose [e] is fc1_e transposed; weight2 [E_local x ffn/TP, H], read as
                weight2.view(E_local, ffn/TP, H) whose [e] is fc2_e transposed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.models.hf_config import UnsupportedModelError
from megatron_rl.models.mapping import GatedFC1, Direct, GlobalNamer, Shard, expert_mapping, grouped_expert_mapping
from tests.unit.test_models_mapping import DictReader

HIDDEN, FFN, EXPERTS = 6, 4, 4
MATRICES = ("gate_proj", "up_proj", "down_proj")
HF_EXPERTS = "model.layers.1.mlp.experts"




def hf_experts():
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for e in range(EXPERTS):
        tensors[f"{HF_EXPERTS}.{e}.gate_proj.weight"] = torch.randn(FFN, HIDDEN, generator=gen)
        tensors[f"{HF_EXPERTS}.{e}.up_proj.weight"] = torch.randn(FFN, HIDDEN, generator=gen)
        tensors[f"{HF_EXPERTS}.{e}.down_proj.weight"] = torch.randn(HIDDEN, FFN, generator=gen)
    return tensors


def test_te_grouped_names_map_to_the_sequential_expert_tensors():
    for fc in ("linear_fc1", "linear_fc2"):
        te = expert_mapping(f"mlp.experts.{fc}.weight3", HF_EXPERTS, MATRICES)
        sequential = expert_mapping(f"mlp.experts.local_experts.3.{fc}.weight", HF_EXPERTS, MATRICES)
        assert te == sequential
    assert expert_mapping("mlp.experts.linear_fc1.weight2", HF_EXPERTS, MATRICES) == GatedFC1(
        f"{HF_EXPERTS}.2.gate_proj.weight", f"{HF_EXPERTS}.2.up_proj.weight"
    )
    assert expert_mapping("mlp.experts.linear_fc2.weight0", HF_EXPERTS, MATRICES) == Direct(f"{HF_EXPERTS}.0.down_proj.weight", tp_dim=1)
    assert expert_mapping("mlp.experts.linear_fc1.bias0", HF_EXPERTS, MATRICES) is None


def test_te_grouped_local_expert_numbers_become_global_on_an_ep_rank():
    """EP rank 1 of 2 with 2 local experts, PP stage holding global layers 2 and 3."""
    chunk = SimpleNamespace(decoder=SimpleNamespace(layers=[SimpleNamespace(layer_number=3), SimpleNamespace(layer_number=4)]))
    namer = GlobalNamer(chunk, ep_rank=1, num_local_experts=2)
    assert namer("decoder.layers.1.mlp.experts.linear_fc1.weight1") == "decoder.layers.3.mlp.experts.linear_fc1.weight3"
    assert namer("decoder.layers.0.mlp.experts.linear_fc2.weight0") == "decoder.layers.2.mlp.experts.linear_fc2.weight2"
    assert namer("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight") == "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    # GroupedMLP's fused tensors hold the rank's experts [2, 4): the range goes into the global name.
    assert namer("decoder.layers.1.mlp.experts.weight1") == "decoder.layers.3.mlp.experts.weight1[2:4]"
    assert namer("decoder.layers.0.mlp.experts.weight2") == "decoder.layers.2.mlp.experts.weight2[2:4]"


@pytest.mark.parametrize("ep,tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_grouped_mlp_layout_and_bit_exact_round_trip(ep, tp):
    tensors = hf_experts()
    reader = DictReader(tensors)
    local, ffn_tp = EXPERTS // ep, FFN // tp
    exported: dict[str, torch.Tensor] = {}
    for ep_rank in range(ep):
        first = ep_rank * local
        fc1 = grouped_expert_mapping(HF_EXPERTS, "weight1", first, local, MATRICES)
        fc2 = grouped_expert_mapping(HF_EXPERTS, "weight2", first, local, MATRICES)
        weight1 = [fc1.load(reader, Shard(fc1.tp_dim, r, tp)) for r in range(tp)]
        weight2 = [fc2.load(reader, Shard(fc2.tp_dim, r, tp)) for r in range(tp)]
        for r in range(tp):
            assert weight1[r].shape == (HIDDEN, local * 2 * ffn_tp)
            assert weight2[r].shape == (local * ffn_tp, HIDDEN)
            rows = slice(r * ffn_tp, (r + 1) * ffn_tp)
            for e in range(local):
                g = first + e
                gate_up = torch.cat([tensors[f"{HF_EXPERTS}.{g}.gate_proj.weight"][rows], tensors[f"{HF_EXPERTS}.{g}.up_proj.weight"][rows]])
                assert torch.equal(weight1[r].view(local, HIDDEN, 2 * ffn_tp)[e], gate_up.T)
                down = tensors[f"{HF_EXPERTS}.{g}.down_proj.weight"][:, rows]
                assert torch.equal(weight2[r].view(local, ffn_tp, HIDDEN)[e], down.T)
        exported.update(fc1.export(weight1))
        exported.update(fc2.export(weight2))
    assert exported.keys() == tensors.keys()
    assert all(torch.equal(exported[name], tensors[name]) for name in tensors)


def test_grouped_mlp_hf_names_and_bad_weight_name():
    fc1 = grouped_expert_mapping(HF_EXPERTS, "weight1", 2, 2, MATRICES)
    assert fc1.hf_names == tuple(f"{HF_EXPERTS}.{e}.{m}.weight" for e in (2, 3) for m in ("gate_proj", "up_proj"))
    with pytest.raises(UnsupportedModelError, match="weight3"):
        grouped_expert_mapping(HF_EXPERTS, "weight3", 0, 2, MATRICES)


def test_family_maps_every_grouped_layout_of_a_moe_layer():
    """A tiny Qwen3-MoE layer: TE's per-expert names and GroupedMLP's fused tensors reach the same HF tensors."""
    from megatron_rl.models import mapping_for, parse_hf_config
    from megatron_rl.models.tiny import tiny_hf_config

    arch = parse_hf_config(tiny_hf_config("qwen3_moe"))
    layer = "decoder.layers.1.mlp.experts"
    sequential = [mapping_for(arch, f"{layer}.local_experts.{e}.linear_fc1.weight", arch.vocab_size) for e in range(arch.num_experts)]
    te = [mapping_for(arch, f"{layer}.linear_fc1.weight{e}", arch.vocab_size) for e in range(arch.num_experts)]
    assert te == sequential
    fused = mapping_for(arch, f"{layer}.weight1", arch.vocab_size)
    assert fused.hf_names == tuple(name for m in sequential for name in m.hf_names)
    down = mapping_for(arch, f"{layer}.weight2", arch.vocab_size)
    assert down.hf_names == tuple(f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(arch.num_experts))
    # One EP rank's range (GlobalNamer's names): experts 4..7 of 8.
    upper = mapping_for(arch, f"{layer}.weight1[4:8]", arch.vocab_size)
    assert upper.hf_names == tuple(name for m in sequential[4:] for name in m.hf_names)
    assert mapping_for(arch, f"{layer}.weight2[4:8]", arch.vocab_size).hf_names == down.hf_names[4:]
    with pytest.raises(UnsupportedModelError, match=r"experts \[4, 9\) of a model with 8"):
        mapping_for(arch, f"{layer}.weight1[4:9]", arch.vocab_size)


def test_te_grouped_names_rest_on_megatron_core_s_te_checkpoint_code():
    """Transformer Engine does not install here, so TEGroupedMLP cannot be built: the names the mapping assumes are
    pinned to the megatron-core source that produces them (a megatron-core upgrade that changes them fails here).

    TE's GroupedLinear registers one parameter per GEMM, weight<i> [out, in], TP-split along dim 0 (column) or
    1 (row) (transformer_engine/pytorch/module/grouped_linear.py); megatron-core's TEGroupedLinear checkpoints
    weight<i> under the SequentialMLP key (experts.linear_fc<k>.weight) at the global expert offset, with the
    TP axis 0 for fc1 and 1 for fc2, and TEGroupedMLP splits fc1 into its gate and up halves as SequentialMLP does.
    """
    import inspect
    from pathlib import Path

    import megatron.core.extensions.transformer_engine as te_ext
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    te_source = Path(inspect.getfile(te_ext)).read_text()
    for fragment in (
        'f"{gemm_idx}.weight": full_state_dict[f"weight{gemm_idx}"]',  # TE's parameter weight<i>
        'f"{prefix}weight{gemm_idx}": sub_sd[f"{gemm_idx}.weight"]',  # the module-local name weight<i>
        "(ep_axis, global_expert_idx, num_global_experts)",  # one key for all experts, sharded by global index
        'tp_axis_map.update({f"{gemm_idx}.weight": 0, f"{gemm_idx}.bias": 0})',  # column-parallel fc1: dim 0
        'tp_axis_map = {f"{gemm_idx}.weight": 1 for gemm_idx in range(self.num_gemms)}',  # row-parallel fc2: dim 1
    ):
        assert fragment in te_source, fragment
    mlp_source = inspect.getsource(TEGroupedMLP.sharded_state_dict)
    assert "apply_swiglu_sharded_factory" in mlp_source  # fc1 = [gate; up] per TP rank, as SequentialMLP
    assert "replace_prefix_for_sharding(sub_sd, f'{name}.', f'{prefix}experts.{name}.')" in mlp_source
    # The mapping: linear_fc<k>.weight<e> is SequentialMLP's tensor with the same TP dims.
    arch_fc1 = expert_mapping("mlp.experts.linear_fc1.weight0", HF_EXPERTS, MATRICES)
    arch_fc2 = expert_mapping("mlp.experts.linear_fc2.weight0", HF_EXPERTS, MATRICES)
    assert (arch_fc1.tp_dim, arch_fc2.tp_dim) == (0, 1)
