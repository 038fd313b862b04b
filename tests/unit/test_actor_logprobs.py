"""Vocab-parallel logprobs/entropy (single process) against the plain full log_softmax: values and gradients.

The TP2 case (a real gloo group) is tests/distributed/test_actor_logprobs.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.logprobs import vocab_parallel_logprobs


def reference_logprobs(logits, targets, *, vocab_size=None, temperature=1.0):
    """The definition, written here: torch's categorical over the real vocabulary at `temperature`."""
    logits = logits[..., :vocab_size] if vocab_size is not None else logits
    dist = torch.distributions.Categorical(logits=logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature)
    return dist.log_prob(targets), dist.entropy()


def _case(dtype, vocab=50, rows=(3, 37), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*rows, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab - 5, rows, generator=g)
    weights = torch.randn(*rows, generator=g, dtype=torch.float64), torch.randn(*rows, generator=g, dtype=torch.float64)
    return logits, targets, weights


def _grads(fn, logits, targets, weights, with_entropy):
    x = logits.clone().requires_grad_()
    logprobs, entropy = fn(x * 1, targets)  # a non-leaf, like a model's output
    total = (logprobs.double() * weights[0]).sum()
    if with_entropy:
        total = total + (entropy.double() * weights[1]).sum()
    total.backward()
    return logprobs.detach(), None if entropy is None else entropy.detach(), x.grad


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("chunk_bytes", [4 * 45 * 5, 1 << 20])  # 5-row chunks, and one chunk
def test_float64_equals_reference_exactly(with_entropy, inplace, chunk_bytes):
    logits, targets, weights = _case(torch.float64)
    kwargs = dict(vocab_size=45, temperature=0.7)
    got = _grads(lambda x, t: vocab_parallel_logprobs(x, t, with_entropy=with_entropy, chunk_bytes=chunk_bytes,
                                                      inplace_backward=inplace, **kwargs), logits, targets, weights, with_entropy)
    want = _grads(lambda x, t: reference_logprobs(x, t, **kwargs), logits, targets, weights, with_entropy)
    assert torch.allclose(got[0], want[0], atol=1e-12, rtol=0)
    if with_entropy:
        assert torch.allclose(got[1], want[1], atol=1e-12, rtol=0)
    assert torch.allclose(got[2], want[2], atol=1e-12, rtol=0)
    assert torch.all(got[2][..., 45:] == 0)  # padded vocabulary columns: no gradient


def test_float32_within_1e5():
    logits, targets, weights = _case(torch.float32, vocab=300, rows=(4, 64), seed=3)
    got = _grads(lambda x, t: vocab_parallel_logprobs(x, t, temperature=1.3, with_entropy=True), logits, targets, weights, True)
    want = _grads(lambda x, t: reference_logprobs(x.double(), t, temperature=1.3), logits, targets, weights, True)
    for a, b in zip(got, want):
        assert (a.double() - b.double()).abs().max() <= 1e-5


def test_bfloat16_logits_are_scored_in_float32():
    logits, targets, _ = _case(torch.bfloat16, vocab=128)
    logprobs, entropy = vocab_parallel_logprobs(logits, targets, with_entropy=True)
    ref_lp, ref_ent = reference_logprobs(logits.double(), targets)
    assert logprobs.dtype == torch.float32
    assert (logprobs.double() - ref_lp).abs().max() <= 1e-4 and (entropy.double() - ref_ent).abs().max() <= 1e-4


def test_temperature_divides_the_logits():
    logits, targets, _ = _case(torch.float64)
    at_t, _ = vocab_parallel_logprobs(logits, targets, temperature=2.0)
    scaled, _ = vocab_parallel_logprobs(logits / 2.0, targets)
    assert torch.allclose(at_t, scaled, atol=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(logits, targets, temperature=0.0)


def test_entropy_is_not_computed_unless_asked():
    logits, targets, _ = _case(torch.float32)
    assert vocab_parallel_logprobs(logits, targets)[1] is None
