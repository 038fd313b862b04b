"""Weight-sync pieces without an engine: bucketing, wire format, manifest checks, draining the export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.weight_sync import (
    PushValidator,
    WeightManifest,
    WeightPushError,
    bucket_from_bytes,
    bucket_to_bytes,
    bucketize,
    collect_push,
    manifest_from_checkpoint,
    push_weights,
)
from megatron_rl.weight_sync.buckets import bucket_from_b64, bucket_to_b64


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8),
        "model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(4, 8),
        "model.norm.weight": torch.randn(8),
    }


def _manifest() -> WeightManifest:
    return WeightManifest(shapes={k: tuple(v.shape) for k, v in _state().items()})


def test_bucketize_respects_size_and_keeps_order():
    state = _state()
    buckets = list(bucketize(state.items(), bucket_bytes=300))
    assert [n for b in buckets for n, _ in b] == list(state)
    for b in buckets:  # a bucket exceeds the limit only when it is one oversized tensor
        assert sum(t.numel() * 4 for _, t in b) <= 300 or len(b) == 1
    assert len(list(bucketize(state.items(), bucket_bytes=1 << 20))) == 1
    with pytest.raises(ValueError):
        list(bucketize(state.items(), 0))


def test_wire_format_round_trip_including_views():
    base = torch.arange(12.0)
    bucket = [("a", base[:6]), ("b", base[6:].view(2, 3)), ("c", torch.ones(2, 2).t())]
    for decoded in (bucket_from_bytes(bucket_to_bytes(bucket)), bucket_from_b64(bucket_to_b64(bucket))):
        assert [n for n, _ in decoded] == ["a", "b", "c"]
        for (_, want), (_, got) in zip(bucket, decoded):
            assert torch.equal(want, got)


def test_manifest_names_the_bad_tensor():
    manifest = _manifest()
    with pytest.raises(WeightPushError, match=r"'model.layers.0.self_attn.q_prj.weight'.*closest.*q_proj"):
        manifest.check_tensor("model.layers.0.self_attn.q_prj.weight", (8, 8))
    with pytest.raises(WeightPushError, match=r"'model.norm.weight' has shape \[9\].*expects \[8\]"):
        manifest.check_tensor("model.norm.weight", (9,))
    validator = PushValidator(manifest)
    validator.check_bucket([("model.norm.weight", torch.zeros(8))])
    with pytest.raises(WeightPushError, match="appears twice"):
        validator.check_bucket([("model.norm.weight", torch.zeros(8))])
    with pytest.raises(WeightPushError, match=r"3 of the model's 4 tensors are missing.*embed_tokens"):
        validator.check_complete()


def test_collect_push_drains_the_export_before_raising():
    state = _state()
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 9)
    consumed = []

    def export():
        for name, tensor in state.items():
            consumed.append(name)
            yield [(name, tensor)]

    with pytest.raises(WeightPushError, match="q_proj"):
        collect_push(export(), _manifest(), encode=lambda b: b)
    assert consumed == list(state)  # other ranks are still in the export's collectives
    payloads, validator = collect_push(bucketize(_state().items(), 64), _manifest(), encode=lambda b: b)
    assert validator.seen == set(_state()) and validator.num_bytes == sum(t.numel() * 4 for t in _state().values())
    assert sum(len(p) for p in payloads) == 4


def test_push_weights_without_engine_only_drains():
    consumed = []
    push_weights(None, (consumed.append(i) or [] for i in range(5)), version=1)
    assert consumed == list(range(5))

    class Recorder:
        def update_weights(self, buckets, version):
            self.got = (list(buckets), version)
            return "stats"

    engine = Recorder()
    assert push_weights(engine, iter([[("x", torch.zeros(1))]]), version=7) == "stats"
    assert engine.got[1] == 7 and engine.got[0][0][0][0] == "x"


def test_manifest_from_checkpoint(tmp_path):
    state = _state()
    save_file({k: v for k, v in list(state.items())[:2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in list(state.items())[2:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    manifest = manifest_from_checkpoint(tmp_path)
    assert manifest.shapes == {k: tuple(v.shape) for k, v in state.items()}
    assert manifest.dtypes["model.norm.weight"] == "BF16"
    assert manifest.optional == {"lm_head.weight": (16, 8)}  # tied: accepted, not required
    manifest.check_tensor("lm_head.weight", (16, 8))
    assert WeightManifest.from_json(json.loads(json.dumps(manifest.to_json()))) == manifest
    with pytest.raises(WeightPushError, match="no \\*.safetensors"):
        manifest_from_checkpoint(tmp_path / "nowhere")
