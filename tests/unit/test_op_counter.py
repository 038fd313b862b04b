"""bench/op_counter.py and bench/op_count_emulation.py on hand-worked cases: kernels, host syncs and bytes per op,
phases through autograd, and the CUDA ops the emulation stands for (one op each way, exact values)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.op_count_emulation import cuda_kernels_on_cpu  # noqa: E402
from bench.op_counter import OpCounter, is_host_sync, tensor_bytes  # noqa: E402

PHASES = ("layer", "other")


def test_tensor_bytes_count_distinct_elements():
    x = torch.zeros(4, 8)
    assert tensor_bytes(x) == 4 * 8 * 4
    assert tensor_bytes(x[:, :2]) == 4 * 2 * 4  # a slice: its own elements
    assert tensor_bytes(torch.zeros(8).expand(5, 8)) == 8 * 4  # expanded: the storage once
    assert tensor_bytes(torch.zeros(3, dtype=torch.int64)) == 24


def test_host_syncs_are_scalar_reads_and_data_sized_outputs():
    assert is_host_sync("_local_scalar_dense", "default", (), {})
    assert is_host_sync("nonzero", "default", (), {}) and is_host_sync("masked_select", "default", (), {})
    assert is_host_sync("repeat_interleave", "Tensor", (torch.tensor([1, 2]),), {})
    assert not is_host_sync("repeat_interleave", "Tensor", (torch.tensor([1, 2]),), {"output_size": 3})
    assert not is_host_sync("repeat_interleave", "self_int", (torch.ones(2), 2), {})
    assert is_host_sync("index", "Tensor", (torch.ones(3), [torch.tensor([True, False, True])]), {})
    assert not is_host_sync("index", "Tensor", (torch.ones(3), [torch.tensor([0, 2])]), {})
    assert not is_host_sync("mm", "default", (), {})


def test_counts_by_phase_forward_and_backward():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 2, requires_grad=True)
    counter = OpCounter(PHASES)
    with counter:
        with counter.region("layer"):
            y = (x @ w).t()  # mm: a kernel; t: a view
            n = int((y > 0).sum())  # gt, sum: kernels; int(): a scalar read
        y.sum().backward()  # the sum is "other"; mm's backward (two mm) lands in "layer", where its forward ran
    counts, names = counter.take()
    assert names["kernels"]["layer"]["mm"] == 3 and names["host_syncs"]["layer"] == {"_local_scalar_dense": 1}
    assert counts["layer"]["host_syncs"] == 1 and 0 <= n <= 8
    # forward mm: reads x (4 x 8) and w (8 x 2), writes 4 x 2, in float32
    assert names["kernels"]["layer"]["gt"] == 1 and counts["layer"]["bytes"] >= (32 + 16 + 8) * 4
    assert counts["other"]["kernels"] >= 1


def test_the_emulated_cuda_ops_are_one_op_each_way_and_exact():
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    grad = torch.randn(6, 16)
    counter = OpCounter(PHASES)
    with cuda_kernels_on_cpu():
        with counter:
            with counter.region("layer"):
                out = torch.nn.functional.rms_norm(x, (16,), w, 1e-6)
            out.backward(grad)  # lands in "layer", where its forward ran
    _, names = counter.take()
    assert names["kernels"]["layer"] == {"_fused_rms_norm": 1, "_fused_rms_norm_backward": 1}
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    want = x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6) * w2
    want.backward(grad)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_the_emulated_varlen_attention_equals_attention_per_sequence():
    from torch.nn.attention.varlen import varlen_attn

    g = torch.Generator().manual_seed(0)
    q = torch.randn(12, 4, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(12, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    counter = OpCounter(PHASES)
    with cuda_kernels_on_cpu():
        with counter, counter.region("layer"):
            out = varlen_attn(q, k, v, cu, cu, 7, 7, scale=0.3, window_size=(-1, 0), enable_gqa=True)
            out.pow(2).sum().backward()
    counts, names = counter.take()
    assert names["kernels"]["layer"]["torch_attn::_varlen_attn"] == 1  # counted as the CUDA build's 2 launches
    grads = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q2[a:b].transpose(0, 1), k2[a:b].transpose(0, 1), v2[a:b].transpose(0, 1), is_causal=True, scale=0.3,
        enable_gqa=True).transpose(0, 1) for a, b in ((0, 5), (5, 12))])
    want.pow(2).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, ref in zip(grads, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(NotImplementedError):  # outside the context the CPU has no such kernel again
        varlen_attn(q, k, v, cu, cu, 7, 7, scale=0.3, window_size=(-1, 0), enable_gqa=True)
