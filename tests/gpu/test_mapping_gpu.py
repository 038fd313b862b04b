"""On a CUDA GPU: every family's HF <-> megatron mappings load and export shards that live on the GPU (a weight push
exports the trainer's CUDA shards), bit-exact: an index or order built on the host would meet a CUDA tensor here."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import global_mcore_names, mapping_for, parse_hf_config
from megatron_rl.models.mapping import Shard
from megatron_rl.models.tiny import FAMILIES, tiny_hf_config
from tests.unit.test_models_mapping import DictReader, _hf_shapes


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_on_the_gpu_is_bit_exact(family):
    config = tiny_hf_config(family, vocab_size=250)
    arch = parse_hf_config(config)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {name: torch.randn(shape, device="cuda", generator=g) for name, shape in _hf_shapes(config).items()}
    reader, back = DictReader(tensors), {}
    for name in global_mcore_names(arch):
        mapping = mapping_for(arch, name, 512)
        tp = 2 if mapping.tp_dim is not None else 1
        shards = [mapping.load(reader, Shard(mapping.tp_dim, r, tp)) for r in range(tp)]
        assert all(s.device.type == "cuda" for s in shards), name
        back.update(mapping.export(shards))
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].device.type == "cuda" and torch.equal(back[name], tensor), name
