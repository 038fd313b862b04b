"""On a CUDA GPU: the kernels models.kernels chooses there against the exact CPU-path forms, in bf16.

* torch._grouped_mm (GroupedMLP's grouped GEMM without the grouped_gemm package, Hopper) against the
  per-expert loop: values and gradients;
* packed attention through torch's flash varlen kernel against one SDPA per sequence: values and gradients.
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_torch_grouped_mm_equals_the_per_expert_loop_on_gpu():
    from megatron_rl.parallel import grouped_gemm_torch

    device = torch.device("cuda")
    if not grouped_gemm_torch.torch_grouped_mm_runs(device, torch.bfloat16):
        pytest.skip(f"torch._grouped_mm has no bf16 kernel on compute capability {torch.cuda.get_device_capability()}")
    g = torch.Generator(device=device).manual_seed(0)
    sizes = [300, 0, 1024, 17, 512, 0, 64, 131]
    a = torch.randn(sum(sizes), 256, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    b = (torch.randn(len(sizes), 256, 384, device=device, dtype=torch.bfloat16, generator=g) * 0.05).requires_grad_()
    grad = torch.randn(sum(sizes), 384, device=device, dtype=torch.bfloat16, generator=g)
    out = grouped_gemm_torch.gmm(a, b, torch.tensor(sizes))
    out.backward(grad)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = torch.cat([rows @ b2[e] for e, rows in enumerate(torch.split(a2, sizes))])
    ref.backward(grad)
    for got, want in ((out, ref), (a.grad, a2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_varlen_packed_attention_equals_per_sequence_on_gpu():
    from tests.unit.test_models_attention import make_attention, random_qkv

    from megatron_rl.config import ParallelConfig
    from megatron_rl.models.attention import packed_seq_params
    from megatron_rl.parallel import destroy_parallel, init_parallel

    pytest.importorskip("torch.nn.attention.varlen", reason="this torch has no varlen attention")
    ctx = init_parallel(ParallelConfig())
    try:
        params = packed_seq_params([1, 370, 3, 640, 90], multiple=8, device="cuda")
        results = []
        for kernel in ("per_sequence", "varlen"):
            attention = make_attention(0.25).cuda()
            attention.packed_kernel = kernel
            q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in random_qkv(int(params.cu_seqlens_q_padded[-1]), 3))
            out = attention(q, k, v, None, packed_seq_params=params)
            out.backward(torch.ones_like(out))
            results.append((out, q.grad, k.grad, v.grad))
        for got, want in zip(*reversed(results)):
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    finally:
        destroy_parallel(ctx)


@pytest.mark.gpu
def test_varlen_takes_mla_head_dims_on_gpu():
    """MLA's shapes (query and key 192 wide, value 128, DeepSeek-V3) through the installed flash varlen kernel, as
    LocalCoreAttention binds it (value zero-padded to 192, output cut back): equal to SDPA per sequence."""
    from megatron_rl.models.varlen import installed_varlen_attn, varlen_binding

    kernel = installed_varlen_attn()
    if kernel is None:
        pytest.skip(f"torch {torch.__version__} has no varlen attention")
    binding, why = varlen_binding()
    assert binding is not None, why
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [5, 300, 41]
    cu = torch.tensor([0, *lengths], dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    q, k = (torch.randn(sum(lengths), 8, 192, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    out = binding.call(kernel, q, k, v, cu, max(lengths), 192**-0.5)
    assert out.shape == (sum(lengths), 8, 128)
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).float(), k[a:b].transpose(0, 1).float(), v[a:b].transpose(0, 1).float(),
            is_causal=True, scale=192**-0.5).transpose(0, 1)
        torch.testing.assert_close(out[a:b].float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_packed_params_and_gmm_offsets_reach_the_device_without_a_host_copy_per_layer():
    """params_on / host_to_device on CUDA: pinned, non-blocking copies that arrive intact."""
    from megatron_rl.actor.step import params_on
    from megatron_rl.models.attention import packed_seq_params
    from megatron_rl.parallel.devices import host_to_device

    params = params_on(packed_seq_params([3, 5, 1000], multiple=8), torch.device("cuda"))
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert getattr(params, name).device.type == "cuda", name
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 16, 1016]
    sizes = torch.arange(1 << 16, dtype=torch.int32)
    assert torch.equal(host_to_device(sizes, "cuda").cpu(), sizes)
