"""The streaming safetensors writer: files that safetensors and transformers read, in planned shards with an index."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megatron_rl.checkpoint.safetensors_writer import (
    INDEX_NAME,
    ShardedSafetensorsWriter,
    TensorSpec,
    parse_size,
    plan_shards,
)
from megatron_rl.config.core import ConfigError


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("100kb") == 100_000
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size(1234) == 1234
    for bad in ("five", "-1GB", "0", "3 parsecs"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_plan_shards_cuts_in_order():
    specs = [TensorSpec(f"t{i}", torch.float32, (10,)) for i in range(5)]  # 40 bytes each
    files = plan_shards(specs, max_shard_bytes=100)
    assert [[t.name for t in f.tensors] for f in files] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    big = plan_shards([TensorSpec("big", torch.float32, (100,)), TensorSpec("small", torch.float32, (1,))], max_shard_bytes=100)
    assert [[t.name for t in f.tensors] for f in big] == [["big"], ["small"]]  # a tensor larger than a shard travels alone
    assert [f.name for f in plan_shards(specs, 10**6)] == ["model.safetensors"]
    with pytest.raises(ValueError, match="planned twice"):
        plan_shards(specs + specs[:1], 100)


def test_written_files_read_back_exactly(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "b.f32": torch.randn(7, generator=generator),
        "c.scalar": torch.tensor(2.5),
        "d.i64": torch.arange(6).reshape(2, 3),
        "e.bool": torch.tensor([True, False, True]),
        "f.f16": torch.randn(4, 4, generator=generator).half(),
        "g.empty": torch.zeros(0, 3),
    }
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    files = plan_shards(specs, max_shard_bytes=40)
    assert len(files) > 2
    with ShardedSafetensorsWriter(tmp_path, files) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
        writer.finish()
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["weight_map"] == {spec.name: f.name for f in files for spec in f.tensors}
    assert index["metadata"]["total_size"] == sum(s.nbytes for s in specs)
    loaded = {}
    for f in files:
        loaded.update(load_file(tmp_path / f.name))
        with safe_open(str(tmp_path / f.name), framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
        header_len = int.from_bytes((tmp_path / f.name).read_bytes()[:8], "little")
        assert header_len % 8 == 0
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_writer_refuses_out_of_plan_tensors(tmp_path):
    specs = [TensorSpec("a", torch.float32, (2,)), TensorSpec("b", torch.float32, (2,))]
    files = plan_shards(specs, 10**6)
    with ShardedSafetensorsWriter(tmp_path, files) as writer:
        with pytest.raises(RuntimeError, match="where the plan expects 'a'"):
            writer.write("b", torch.zeros(2))
        with pytest.raises(RuntimeError, match=r"float64 \(2,\), the plan says torch.float32"):
            writer.write("a", torch.zeros(2, dtype=torch.float64))
        writer.write("a", torch.zeros(2))
        with pytest.raises(RuntimeError, match="1 planned tensors were never written"):
            writer.finish()
