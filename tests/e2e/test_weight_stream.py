"""Streamed weight pushes into the real vLLM engine: memory bounded by the bucket, never mixed weights.

The model has 8 decoder layers so that one layer (the most vLLM's layerwise
reload keeps while a fused layer completes) is a small part of it. Pushes are
streams announced up front whose buckets are fresh copies made as the push
pulls them, as the trainer's export makes them. References are HF
transformers forwards of the model each push claims to load.
"""

from __future__ import annotations

import re

import pytest
import torch

import tests.e2e.requires_vllm  # noqa: F401,E402  (skips the module, naming the extra, without vLLM; a broken install fails)

from megatron_rl.config import RolloutConfig
from megatron_rl.models.tiny import make_tiny_model_dir
from megatron_rl.rollout import SamplingSpec, VLLMEngine
from megatron_rl.weight_sync.engine_side import WeightsLostError
from megatron_rl.weight_sync import WeightStream, bucketize, push_weights
from megatron_rl.weight_sync.stream import PushBrokenError, entries_of
from tests.e2e.vllm_helpers import hf_state_dict, max_logprob_error

TOL = 1e-4
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13, 14, 15], [1, 20]]
BUCKET_BYTES = 16 << 10
LAYERS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream-models")
    return {seed: make_tiny_model_dir(root / f"moe{seed}", family="qwen3_moe", seed=seed, init_std=0.05,
                                      num_hidden_layers=LAYERS) for seed in (0, 1, 2)}


@pytest.fixture(scope="module")
def engine(models):
    engine = VLLMEngine(models[0], RolloutConfig(kv_cache_gib=0.25, max_model_len=128, max_restarts=1))
    yield engine
    engine.shutdown()


def _stream(model_dir, *, tamper_at: int | None = None) -> WeightStream:
    """The model's weights announced, then made bucket by bucket; bucket `tamper_at` breaks the announcement."""
    state = hf_state_dict(model_dir)
    buckets = list(bucketize(state.items(), BUCKET_BYTES))

    def make():
        for index, bucket in enumerate(buckets):
            copies = [(name, tensor.clone()) for name, tensor in bucket]
            if index == tamper_at:  # a tensor that is not what was announced: the push breaks here
                copies[0] = (copies[0][0], torch.zeros(3))
            yield copies

    return WeightStream(entries_of(buckets), make())


def _spec() -> SamplingSpec:
    return SamplingSpec(n=2, max_new_tokens=10, seed=3)


def _largest_layer_bytes(state: dict[str, torch.Tensor]) -> int:
    per_layer: dict[str, int] = {}
    for name, tensor in state.items():
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match:
            per_layer[match.group(1)] = per_layer.get(match.group(1), 0) + tensor.numel() * tensor.element_size()
    return max(per_layer.values())


def test_a_streamed_push_holds_a_few_buckets_and_one_layer_not_the_model(engine, models):
    stats = engine.update_weights(_stream(models[1]), version=1)
    assert max_logprob_error(models[1], engine.generate(PROMPTS, _spec()), 1.0) < TOL

    state = hf_state_dict(models[1])
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    layer_bytes = _largest_layer_bytes(state)
    largest_tensor = max(t.numel() * t.element_size() for t in state.values())
    assert stats.bytes == model_bytes and model_bytes > 40 * BUCKET_BYTES
    # in-process the engine takes the tensors by reference: what the trainer side holds (the bucket it is
    # sending, the one queued for the reload, the parts of the layer vLLM is completing) is the measure
    held = engine.last_push.peak_bytes
    staged = engine.last_push.commits[0]["peak_staged_bytes"]
    bound = 3 * max(BUCKET_BYTES, largest_tensor) + layer_bytes
    assert 0 < staged <= held <= bound, (staged, held, bound)
    assert bound < model_bytes / 2  # the bound says something: far from a whole-model copy


def test_a_push_broken_midway_leaves_a_complete_version_then_is_made_again(engine, models):
    engine.update_weights(_stream(models[1]), version=1)
    with pytest.raises(PushBrokenError, match="broke midway.*was not announced|broke midway.*came as"):
        engine.update_weights(_stream(models[2], tamper_at=6), version=2)
    assert engine.weight_version == 1 and engine.weights_lost
    # the worker went back to the model directory's weights: complete, not a mix of versions 1 and 2
    assert engine._rpc("mrl_weight_version") == 0
    assert max_logprob_error(models[0], engine._generate_once(PROMPTS, _spec()), 1.0) < TOL
    with pytest.raises(WeightsLostError, match="push the trainer's weights again"):
        engine.generate(PROMPTS, _spec())

    # push_weights with a function that makes the export: the broken attempt is made again from a fresh export
    attempts = []

    def export():
        attempts.append(len(attempts))
        return _stream(models[2], tamper_at=3 if len(attempts) == 1 else None)

    push_weights(engine, export, version=2, max_attempts=2)
    assert attempts == [0, 1] and engine.weight_version == 2 and not engine.weights_lost
    rollouts = engine.generate(PROMPTS, _spec())
    assert rollouts.weight_version == 2 and max_logprob_error(models[2], rollouts, 1.0) < TOL


def test_a_refused_push_moves_nothing(engine, models):
    engine.update_weights(_stream(models[1]), version=3)
    state = hf_state_dict(models[2])
    name = "model.layers.3.mlp.gate.weight"
    state[name] = state[name][:, :-1]  # announced with the wrong shape: refused before the first byte
    pulled = []

    def make():
        for bucket in bucketize(state.items(), BUCKET_BYTES):
            pulled.append(1)
            yield bucket

    with pytest.raises(Exception, match=r"model.layers.3.mlp.gate.weight.*shape"):
        engine.update_weights(WeightStream(entries_of([list(state.items())]), make()), version=4)
    assert len(pulled) == len(list(bucketize(state.items(), BUCKET_BYTES)))  # drained: other ranks are in it
    assert engine.weight_version == 3 and not engine.weights_lost
    assert max_logprob_error(models[1], engine.generate(PROMPTS, _spec()), 1.0) < TOL
