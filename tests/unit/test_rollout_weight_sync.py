"""Weight-sync pieces without an engine: bucketing, wire format, manifest checks, draining the export."""

from __future__ import annotations

import gc
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
    check_announced,
    manifest_from_checkpoint,
    push_weights,
)
from megatron_rl.weight_sync.buckets import bucket_from_b64, bucket_to_b64
from megatron_rl.weight_sync.stream import AnnouncedPush, LiveBytes, PushBrokenError, entries_of


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


def test_the_whole_push_is_checked_from_its_announcement():
    manifest = WeightManifest(shapes={k: tuple(v.shape) for k, v in _state().items()},
                              dtypes={k: "F32" for k in _state()})
    entries = entries_of([list(_state().items())])
    check_announced(manifest, entries)
    check_announced(manifest, [(n, s, "bfloat16") for n, s, _ in entries])  # the engine casts between floats
    with pytest.raises(WeightPushError, match=r"'model.norm.weight' comes as int64.*float32"):
        check_announced(manifest, [(n, s, "int64" if n == "model.norm.weight" else d) for n, s, d in entries])
    with pytest.raises(WeightPushError, match=r"'model.norm.weight' has shape \[9\]"):
        check_announced(manifest, [(n, (9,) if n == "model.norm.weight" else s, d) for n, s, d in entries])
    with pytest.raises(WeightPushError, match="1 of the model's 4 tensors are missing"):
        check_announced(manifest, entries[:3])


def test_a_stream_that_breaks_its_announcement_is_caught_at_that_bucket():
    state = _state()
    announced = AnnouncedPush(entries_of([list(state.items())]))
    announced.check_bucket([("model.norm.weight", state["model.norm.weight"])])
    with pytest.raises(WeightPushError, match="'model.norm.weight' came twice"):
        announced.check_bucket([("model.norm.weight", state["model.norm.weight"])])
    with pytest.raises(WeightPushError, match=r"'model.embed_tokens.weight' came as \[16, 8\] bfloat16, announced as"):
        announced.check_bucket([("model.embed_tokens.weight", state["model.embed_tokens.weight"].bfloat16())])
    with pytest.raises(WeightPushError, match="stream ended without 3 announced"):
        announced.check_complete()


def test_live_bytes_counts_tensors_until_they_are_freed():
    live = LiveBytes()
    a = live.track(torch.zeros(10))  # 40 bytes
    b = live.track(torch.zeros(5, dtype=torch.float64))  # 40 bytes
    view = a[2:4]
    assert live.live == 80 and live.peak == 80
    del a  # the view keeps its base alive
    assert live.live == 80
    del view, b
    gc.collect()
    assert live.live == 0 and live.peak == 80
    live.track(torch.zeros(4))
    assert live.peak == 80


def test_a_broken_push_is_made_again_from_a_fresh_export_and_other_errors_are_not():
    class Flaky:
        def __init__(self, failures):
            self.failures = list(failures)
            self.got = []

        def update_weights(self, buckets, version):
            self.got.append([n for b in buckets for n, _ in b])
            if self.failures:
                raise self.failures.pop(0)
            return version

    exports = []

    def export():
        exports.append(1)
        return bucketize(_state().items(), 64)

    engine = Flaky([PushBrokenError("engine died", [None])])
    assert push_weights(engine, export, version=5, max_attempts=2) == 5
    assert len(exports) == 2 and engine.got[1] == list(_state())
    engine = Flaky([PushBrokenError("engine died", [None])] * 2)
    with pytest.raises(PushBrokenError, match="engine died"):
        push_weights(engine, export, version=6, max_attempts=2)
    engine = Flaky([WeightPushError("bad name")])  # refused: not retried
    exports.clear()
    with pytest.raises(WeightPushError, match="bad name"):
        push_weights(engine, export, version=7, max_attempts=3)
    assert len(exports) == 1


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
