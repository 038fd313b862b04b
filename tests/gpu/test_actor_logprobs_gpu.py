"""On a CUDA GPU: vocab-parallel logprobs of bf16 logits match log_softmax and stay within 1.5 x the logits' memory."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.logprobs import reference_logprobs, vocab_parallel_logprobs


@pytest.mark.gpu
def test_bf16_logprobs_memory_and_values_on_gpu():
    device = torch.device("cuda")
    tokens, vocab, hidden_size = 4096, 151936, 1024
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = torch.randn(vocab, hidden_size, device=device, dtype=torch.bfloat16, generator=g) * 0.05
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    logits = hidden @ weight.t()
    logits_bytes = logits.numel() * logits.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logprobs, entropy = vocab_parallel_logprobs(logits, targets, temperature=0.9, with_entropy=True)
    (logprobs.sum() + entropy.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert (logits_bytes + peak) / logits_bytes <= 1.5, f"peak {peak / 2**20:.0f} MiB over {logits_bytes / 2**20:.0f} MiB of logits"
    with torch.no_grad():
        expected, expected_entropy = reference_logprobs((hidden @ weight.t()).float(), targets, temperature=0.9)
    assert (logprobs - expected).abs().max() <= 1e-3
    assert (entropy - expected_entropy).abs().max() <= 1e-3


@pytest.mark.gpu
def test_a_bf16_models_expert_bias_is_fp32_from_the_build(tmp_path):
    """A sigmoid router's expert bias (DeepSeek-V3) is fp32 right after a bf16 build (Float16Module made it bf16;
    megatron turns it back at the first forward): every export, the first push's too, sees one dtype."""
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models import build_model
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.parallel import destroy_parallel, init_parallel

    model_dir = make_tiny_model_dir(tmp_path / "bias", "deepseek_v3", seed=0, with_tokenizer=False)
    ctx = init_parallel(ParallelConfig())
    try:
        (chunk,) = build_model(ModelConfig(path=str(model_dir), dtype="bfloat16"), ctx)
        biases = [b for name, b in chunk.named_buffers() if name.endswith("router.expert_bias")]
        assert biases and all(b.dtype == torch.float32 for b in biases)
        assert any(p.dtype == torch.bfloat16 for p in chunk.parameters())
    finally:
        destroy_parallel(ctx)
