"""The grouped GEMM that megatron's GroupedMLP runs without the grouped_gemm package: both providers
(torch's grouped matmul and the per-expert loop) against per-expert products written out here."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.parallel.grouped_gemm_torch import gmm, grouped_mm_supported, provider_for


def _reference(a: torch.Tensor, b: torch.Tensor, sizes: list[int], trans_b: bool) -> torch.Tensor:
    """Row block e of a times expert e's matrix, one expert at a time (a zero-row block gives zero rows)."""
    out, start = [], 0
    for e, n in enumerate(sizes):
        w = b[e].t() if trans_b else b[e]
        out.append(a[start : start + n] @ w)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("k,n,provider", [(16, 8, "torch_grouped_mm"), (6, 8, "per_expert_loop"), (16, 5, "per_expert_loop")])
def test_values_and_gradients_equal_per_expert_products(trans_b, k, n, provider):
    g = torch.Generator().manual_seed(0)
    sizes = [3, 0, 7, 1, 0, 5]  # empty experts included, as routing produces
    a = torch.randn(sum(sizes), k, generator=g, requires_grad=True)
    b = torch.randn(len(sizes), *((n, k) if trans_b else (k, n)), generator=g, requires_grad=True)
    weights = b.transpose(-1, -2) if trans_b else b
    assert provider_for(a, weights) == provider  # 16-byte aligned rows: torch's kernel, else the loop
    out = gmm(a, b, torch.tensor(sizes), trans_b=trans_b)
    a_ref, b_ref = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = _reference(a_ref, b_ref, sizes, trans_b)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()  # a zero-stride incoming gradient, which torch._grouped_mm's backward refuses alone
    ref.sum().backward()
    torch.testing.assert_close(a.grad, a_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, b_ref.grad, rtol=1e-5, atol=1e-5)


def test_bad_batch_sizes_are_named():
    with pytest.raises(ValueError, match="one entry per expert"):
        gmm(torch.zeros(4, 8), torch.zeros(3, 8, 8), torch.tensor([1, 3]))


@pytest.mark.parametrize("device_type,dtype,capability,has_op,expected", [
    ("cuda", torch.bfloat16, (9, 0), True, True),     # H100 / H200
    ("cuda", torch.bfloat16, (8, 0), True, False),    # A100: no grouped_mm kernel
    ("cuda", torch.float32, (9, 0), True, False),     # Hopper kernel is bf16 only
    ("cpu", torch.float32, None, True, True),
    ("cpu", torch.float32, None, False, False),       # a torch without _grouped_mm
    ("cpu", torch.float64, None, True, False),        # no float64 kernel: the loop
])
def test_where_torch_grouped_mm_runs(device_type, dtype, capability, has_op, expected):
    assert grouped_mm_supported(device_type, dtype, capability, has_op=has_op) is expected


def test_tiny_moe_experts_take_torch_grouped_mm():
    """The tiny models of the layout tests (GroupedMLP cases) run their experts through torch's kernel, so those
    tests compare it with SequentialMLP on 1, EP2 and TP2xEP2."""
    from megatron_rl.models.tiny import tiny_hf_config

    for family in ("qwen3_moe", "deepseek_v3"):
        cfg = tiny_hf_config(family)
        hidden, ffn = cfg["hidden_size"], cfg["moe_intermediate_size"]
        for tp in (1, 2):  # weight1 [E, hidden, 2 ffn / TP], weight2 [E, ffn / TP, hidden]
            assert provider_for(torch.zeros(1, hidden), torch.zeros(2, hidden, 2 * ffn // tp)) == "torch_grouped_mm"
            assert provider_for(torch.zeros(1, ffn // tp), torch.zeros(2, ffn // tp, hidden)) == "torch_grouped_mm"


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_the_probe_runs_whatever_autograd_context_its_first_caller_is_in(context):
    """Its answer is cached for the process: a first call from an old-policy forward (no_grad, inference_mode) must
    not leave the per-expert loop for the whole run (the probe's backward used to fail there)."""
    from megatron_rl.parallel import grouped_gemm_torch

    grouped_gemm_torch._probe_grouped_mm.cache_clear()
    try:
        with context():
            assert grouped_gemm_torch._probe_grouped_mm("cpu", None, torch.float32) is None
            assert provider_for(torch.zeros(4, 16), torch.zeros(2, 16, 16)) == "torch_grouped_mm"
    finally:
        grouped_gemm_torch._probe_grouped_mm.cache_clear()
