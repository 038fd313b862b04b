"""Dist checkpoints in megatron-core's GroupedMLP layout: the converter's read as GroupedMLP reads them, and
one written as GroupedMLP writes it converted back to HF bit-exact.

GroupedMLP needs the grouped_gemm kernels (a GPU), so the module itself is not
built here: its sharded state dict is built by hand as transformer/moe/experts.py
documents it (GroupedMLP.sharded_state_dict, non-singleton shards): per EP rank
and TP rank, weight1.view(E_local, H, 2F/TP).transpose(-1, -2) split in its
gate (w) and up (v) halves at TP offsets r and TP + r of 2 TP, and
weight2.view(E_local, F/TP, H).transpose(-1, -2) at TP offset r; then merged
back as GroupedMLP's sh_ten_merge_fn does. The tensors megatron's own loader
reads from the converter's checkpoint must equal what the mapping's
GroupedExperts builds from the HF tensors, on every EP x TP rank; and pieces
saved in that layout by megatron's saver must convert back to the HF tensors.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import parse_hf_config
from megatron_rl.models.mapping import Shard, grouped_expert_mapping
from megatron_rl.models.tiny import make_tiny_model_dir
from tests.unit.test_models_mapping import DictReader


def _grouped_state_dict(prefix, hidden, ffn_tp, local, ep_rank, ep, tp_rank, tp):
    """Empty tensors of one EP x TP rank in GroupedMLP's layout, for megatron's loader to fill."""
    weight1, weight2 = torch.empty(hidden, local * 2 * ffn_tp), torch.empty(local * ffn_tp, hidden)
    return _grouped_pieces(prefix, weight1, weight2, hidden, local, ep_rank, ep, tp_rank, tp)




@pytest.mark.parametrize("ep,tp", [(1, 1), (2, 2), (4, 1)])
def test_converted_checkpoint_reads_as_grouped_mlp_weights(tmp_path, ep, tp):
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    from megatron_rl.checkpoint.convert import convert_hf_to_mcore, resolve_mcore_dir
    from megatron_rl.checkpoint.dist_format import single_process_megatron
    from megatron_rl.models.hf_config import load_hf_config

    model_dir = make_tiny_model_dir(tmp_path / "hf", "qwen3_moe", with_tokenizer=False)
    hf_config = load_hf_config(model_dir)
    arch = parse_hf_config(hf_config)
    hf = load_file(str(model_dir / "model.safetensors"))
    ckpt = resolve_mcore_dir(convert_hf_to_mcore(model_dir, tmp_path / "mcore"))

    hidden, ffn, local = arch.hidden_size, hf_config["moe_intermediate_size"], arch.num_experts // ep
    matrices = ("gate_proj", "up_proj", "down_proj")
    with single_process_megatron(hf_config):
        for layer in range(arch.num_layers):
            prefix = f"decoder.layers.{layer}.mlp.experts."
            ranks = [(ep_rank, tp_rank) for ep_rank in range(ep) for tp_rank in range(tp)]
            # megatron validates that one load covers every stored tensor whole: all ranks' pieces at once
            request = {f"ep{e}_tp{t}": _grouped_state_dict(prefix, hidden, ffn // tp, local, e, ep, t, tp) for e, t in ranks}
            loaded = dist_checkpointing.load(request, str(ckpt))
            for ep_rank, tp_rank in ranks:
                fc1 = grouped_expert_mapping(f"model.layers.{layer}.mlp.experts", "weight1", ep_rank * local, local, matrices)
                fc2 = grouped_expert_mapping(f"model.layers.{layer}.mlp.experts", "weight2", ep_rank * local, local, matrices)
                pieces = loaded[f"ep{ep_rank}_tp{tp_rank}"]
                weight1 = torch.cat([pieces["fc1_w"], pieces["fc1_v"]], -2).transpose(-1, -2).reshape(hidden, -1)
                weight2 = pieces["fc2"].transpose(-1, -2).reshape(-1, hidden)
                assert torch.equal(weight1, fc1.load(DictReader(hf), Shard(1, tp_rank, tp)))
                assert torch.equal(weight2, fc2.load(DictReader(hf), Shard(0, tp_rank, tp)))


def _grouped_pieces(prefix, weight1, weight2, hidden, local, ep_rank, ep, tp_rank, tp):
    """GroupedMLP.sharded_state_dict's ShardedTensors of one EP x TP rank holding `weight1`, `weight2` (documented layout)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    replica = (0, 0, 0)
    gate_up = weight1.view(local, hidden, -1).transpose(-1, -2)
    w, v = torch.chunk(gate_up, 2, -2)
    down = weight2.view(local, -1, hidden).transpose(-1, -2)
    fc1, fc2 = f"{prefix}experts.linear_fc1.weight", f"{prefix}experts.linear_fc2.weight"
    return {
        "fc1_w": ShardedTensor.from_rank_offsets(fc1, w.contiguous(), (0, ep_rank, ep), (1, tp_rank, 2 * tp), replica_id=replica),
        "fc1_v": ShardedTensor.from_rank_offsets(fc1, v.contiguous(), (0, ep_rank, ep), (1, tp + tp_rank, 2 * tp), replica_id=replica),
        "fc2": ShardedTensor.from_rank_offsets(fc2, down.contiguous(), (0, ep_rank, ep), (2, tp_rank, tp), replica_id=replica),
    }


def test_checkpoint_written_in_grouped_mlp_layout_converts_back_bit_exact(tmp_path):
    """EP2 x TP2 GroupedMLP pieces (from the mapping) + the other tensors whole -> megatron's saver -> the converter -> HF."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from safetensors.torch import load_file

    from megatron_rl.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf, resolve_mcore_dir
    from megatron_rl.checkpoint.dist_format import single_process_megatron
    from megatron_rl.models.hf_config import load_hf_config

    ep, tp = 2, 2
    model_dir = make_tiny_model_dir(tmp_path / "hf", "qwen3_moe", with_tokenizer=False)
    hf_config = load_hf_config(model_dir)
    arch = parse_hf_config(hf_config)
    hf = load_file(str(model_dir / "model.safetensors"))
    sequential = resolve_mcore_dir(convert_hf_to_mcore(model_dir, tmp_path / "mcore"))

    hidden, local = arch.hidden_size, arch.num_experts // ep
    matrices = ("gate_proj", "up_proj", "down_proj")
    grouped_dir = tmp_path / "grouped"
    grouped_dir.mkdir()
    with single_process_megatron(hf_config):
        plain = dist_checkpointing.load_plain_tensors(str(sequential))
        state = {key: ShardedTensor.from_rank_offsets(key, value) for key, value in plain.items() if ".mlp.experts." not in key}
        for layer in range(arch.num_layers):
            prefix = f"decoder.layers.{layer}.mlp.experts."
            for ep_rank in range(ep):
                fc1 = grouped_expert_mapping(f"model.layers.{layer}.mlp.experts", "weight1", ep_rank * local, local, matrices)
                fc2 = grouped_expert_mapping(f"model.layers.{layer}.mlp.experts", "weight2", ep_rank * local, local, matrices)
                for tp_rank in range(tp):
                    weight1, weight2 = fc1.load(DictReader(hf), Shard(1, tp_rank, tp)), fc2.load(DictReader(hf), Shard(0, tp_rank, tp))
                    state[f"{prefix}ep{ep_rank}_tp{tp_rank}"] = _grouped_pieces(prefix, weight1, weight2, hidden, local, ep_rank, ep, tp_rank, tp)
        dist_checkpointing.save(state, str(grouped_dir))
    back = convert_mcore_to_hf(grouped_dir, tmp_path / "back", hf_dir=model_dir)
    out = load_file(str(back / "model.safetensors"))
    assert out.keys() == hf.keys()
    assert all(torch.equal(out[name], hf[name]) for name in hf)
