"""Weights by memory handle into the real vLLM engine in its own process (rollout.weight_transport=ipc).

On this machine the handles are host shared memory (on a GPU the same code
hands CUDA IPC handles: tests/gpu/test_weight_ipc_gpu.py). The engine maps
each bucket the trainer shared, so the bytes both hold are one copy, bounded
like any streamed push. References are HF transformers forwards of the model
each push claims to load.
"""

from __future__ import annotations

import pytest

import tests.e2e.requires_vllm  # noqa: F401,E402  (skips the module, naming the extra, without vLLM; a broken install fails)

from megatron_rl.config import RolloutConfig
from megatron_rl.rollout import SamplingSpec, VLLMEngine
from megatron_rl.weight_sync.stream import PushBrokenError
from tests.e2e.test_weight_stream import BUCKET_BYTES, PROMPTS, TOL, _largest_layer_bytes, _stream, models  # noqa: F401
from tests.e2e.vllm_helpers import hf_state_dict, max_logprob_error


@pytest.fixture(scope="module")
def engine(models):  # noqa: F811
    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=128, multiprocessing=True, weight_transport="ipc")
    engine = VLLMEngine(models[0], config)
    yield engine
    engine.shutdown()


def test_an_engine_process_takes_weights_by_handles_with_a_few_buckets_alive(engine, models):  # noqa: F811
    assert engine.weight_transport == "ipc"
    stats = engine.update_weights(_stream(models[1]), version=1)
    spec = SamplingSpec(n=2, max_new_tokens=10, seed=3)
    assert max_logprob_error(models[1], engine.generate(PROMPTS, spec), 1.0) < TOL

    state = hf_state_dict(models[1])
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    largest_tensor = max(t.numel() * t.element_size() for t in state.values())
    assert stats.bytes == model_bytes and model_bytes > 40 * BUCKET_BYTES
    # host bytes the trainer and the engine share (buckets mapped by both, counted once), and what the
    # engine's loading held of them: the bucket it loads, the one queued, the parts of one layer
    shared = engine.last_push.buffer_bytes
    staged = engine.last_push.commits[0]["peak_staged_bytes"]
    bound = 3 * max(BUCKET_BYTES, largest_tensor) + _largest_layer_bytes(state)
    assert 0 < staged <= bound and 0 < shared <= bound + max(BUCKET_BYTES, largest_tensor), (staged, shared, bound)
    assert bound < model_bytes / 2

    # a bucket that breaks the announcement midway: the worker goes back to its directory's weights
    with pytest.raises(PushBrokenError, match="broke midway"):
        engine.update_weights(_stream(models[2], tamper_at=6), version=2)
    assert engine._rpc("mrl_weight_version") == 0
    assert max_logprob_error(models[0], engine._generate_once(PROMPTS, spec), 1.0) < TOL
    engine.update_weights(_stream(models[2]), version=2)
    rollouts = engine.generate(PROMPTS, spec)
    assert rollouts.weight_version == 2 and max_logprob_error(models[2], rollouts, 1.0) < TOL
