"""models.varlen: the varlen kernel is called as the installed torch's signature allows, checked against each
release's signature and against the real installed function."""

from __future__ import annotations

import inspect

import pytest
import torch

from megatron_rl.models.kernels import Kernels, choose_attention
from megatron_rl.models.varlen import VarlenBinding, installed_varlen_attn, varlen_binding
from tests.unit.test_models_attention import varlen_kernel_2_11, varlen_kernel_2_13


def varlen_kernel_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9 / 2.10's varlen_attn signature: no scale, no window."""


def _call_arguments(binding: VarlenBinding, heads: int = 4, groups: int = 2):
    q = torch.randn(9, heads, 32)
    k, v = torch.randn(9, groups, 32), torch.randn(9, groups, 32)
    return binding.arguments(q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32), 5, 0.25)


@pytest.mark.parametrize("kernel,gqa", [(varlen_kernel_2_11, False), (varlen_kernel_2_13, True)])
def test_each_release_signature_gets_only_what_it_takes(kernel, gqa):
    binding, why = varlen_binding(kernel)
    assert binding == VarlenBinding(enable_gqa=gqa)
    args, kwargs = _call_arguments(binding)
    inspect.signature(kernel).bind(*args, **kwargs)  # raises TypeError on a keyword the release lacks
    assert ("enable_gqa" in kwargs) == gqa and kwargs["window_size"] == (-1, 0) and kwargs["scale"] == 0.25
    if not gqa:  # 2.11: key/value heads expanded to the query's, group g serving heads 2g and 2g + 1
        assert args[1].shape[1] == args[0].shape[1] == 4
        assert "expanded" in why


def test_a_release_without_a_causal_window_or_scale_is_not_used():
    binding, why = varlen_binding(varlen_kernel_2_10)
    assert binding is None and "scale" in why and "window_size" in why
    kernels = Kernels(cuda=True, capability=(9, 0), varlen_attention=False, varlen_why=why)
    assert choose_attention(kernels, use_te=False, dtype=torch.bfloat16, context_parallel=1) == ("per_sequence", why)


def test_expanded_heads_repeat_each_group_for_its_query_heads():
    q, k, v = torch.randn(9, 6, 32), torch.randn(9, 2, 32), torch.randn(9, 2, 32)
    (_, k_expanded, v_expanded, *_), _ = VarlenBinding(enable_gqa=False).arguments(q, k, v, torch.tensor([0, 9]), 9, 1.0)
    assert k_expanded.shape == v_expanded.shape == (9, 6, 32)
    for head in range(6):  # query head n reads group n // (heads / groups), as SDPA's enable_gqa and megatron do
        assert torch.equal(k_expanded[:, head], k[:, head // 3]) and torch.equal(v_expanded[:, head], v[:, head // 3])


def test_the_binding_fits_the_installed_function():
    """The real torch.nn.attention.varlen.varlen_attn of this torch: our arguments bind to it, and a call reaches
    its kernel (on CPU torch has none: NotImplementedError from the flash op, never a TypeError on a keyword)."""
    real = installed_varlen_attn()
    if real is None:
        pytest.fail(f"torch {torch.__version__} has no varlen_attn; the supported torch range has it")
    binding, why = varlen_binding()
    assert binding is not None, why
    args, kwargs = _call_arguments(binding)
    inspect.signature(real).bind(*args, **kwargs)
    if torch.cuda.is_available():
        args = [a.cuda().bfloat16() if isinstance(a, torch.Tensor) and a.is_floating_point() else
                (a.cuda() if isinstance(a, torch.Tensor) else a) for a in args]
        assert real(*args, **kwargs).shape == args[0].shape
    else:
        with pytest.raises(NotImplementedError, match="flash"):
            real(*args, **kwargs)


def test_the_start_up_line_says_when_heads_are_expanded():
    kernels = Kernels(cuda=True, capability=(9, 0), torch_grouped_mm=True, varlen_attention=True, varlen_gqa=False)
    kernel, why = choose_attention(kernels, use_te=False, dtype=torch.bfloat16, context_parallel=1)
    assert kernel == "varlen" and "expanded" in why


def test_detected_on_cpu_the_varlen_kernel_is_off_with_its_reason():
    from megatron_rl.models.kernels import detect_kernels

    kernels = detect_kernels()
    if kernels.cuda:
        pytest.skip("a GPU is present: this checks the CPU platform's choice")
    assert not kernels.varlen_attention and "no CUDA" in kernels.varlen_why


def test_the_torch_floor_is_setup_pys_and_older_torches_are_refused_in_one_line():
    import re
    from pathlib import Path

    from megatron_rl.parallel.availability import TORCH_FLOOR, require_supported_torch, torch_release

    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    assert re.search(r'"torch>=(\d+)\.(\d+)"', setup).groups() == tuple(str(n) for n in TORCH_FLOOR) == ("2", "11")
    assert torch_release("2.11.0+cu130") == (2, 11) and torch_release("2.13.0a0+git") == (2, 13)
    require_supported_torch("2.11.0+cu130")
    require_supported_torch(torch.__version__)  # the installed one
    with pytest.raises(RuntimeError, match=r"^torch 2\.10\.1 is older than megatron_rl supports \(torch>=2\.11\): "
                                           r"install torch>=2\.11") as err:
        require_supported_torch("2.10.1")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kernel", [varlen_kernel_2_11, varlen_kernel_2_13], ids=["torch2.11", "torch2.13"])
def test_a_narrower_value_head_is_padded_for_the_kernel_and_cut_from_its_output(kernel):
    """MLA (DeepSeek-V3: query and key 128 + 64 rope wide, value 128): the kernel takes one head dim, so the value
    goes in zero-padded and the output comes back at the value's width, equal to attention with the narrow value
    (torch's SDPA, which takes a narrower value, per sequence)."""
    binding, _ = varlen_binding(kernel)
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(9, 4, 24, generator=g, dtype=torch.float64), torch.randn(9, 2, 24, generator=g, dtype=torch.float64)
    v = torch.randn(9, 2, 16, generator=g, dtype=torch.float64)
    args, _ = binding.arguments(q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32), 5, 0.2)
    assert args[2].shape[-1] == 24 and torch.equal(args[2][..., 16:], torch.zeros_like(args[2][..., 16:]))
    out = binding.call(kernel, q, k, v, torch.tensor([0, 4, 9], dtype=torch.int32), 5, 0.2)
    assert out.shape == (9, 4, 16)
    for a, b in ((0, 4), (4, 9)):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, scale=0.2,
            enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[a:b], want, atol=1e-12, rtol=0)



def test_packed_params_go_to_the_device_only_for_transformer_engine_on_cuda():
    """TE's THD attention and fused RoPE read cu_seqlens in CUDA kernels; the local spec reads them on the host."""
    from megatron_rl.models.kernels import packed_params_device

    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    assert packed_params_device(True, cuda) == cuda
    assert packed_params_device(False, cuda) is None and packed_params_device(True, cpu) is None


def test_params_on_moves_every_offset_tensor_and_keeps_the_rest():
    from megatron_rl.actor.step import params_on
    from megatron_rl.models.attention import packed_seq_params

    params = packed_seq_params([3, 5], multiple=4)  # cu_seqlens [0, 3, 8], padded [0, 4, 12], max 8
    moved = params_on(params, torch.device("cpu"))
    assert moved is not params and moved.qkv_format == "thd" and moved.max_seqlen_q == moved.max_seqlen_kv == 8
    assert moved.cu_seqlens_q.tolist() == [0, 3, 8] and moved.cu_seqlens_kv_padded.tolist() == [0, 4, 12]


def test_the_varlen_offsets_are_copied_once_per_microbatch(monkeypatch):
    """Every layer (and the recomputation in backward) reads the device offsets kept on the microbatch's
    PackedSeqParams: one host-to-device copy per microbatch, not one per layer."""
    from megatron_rl.models import attention
    from megatron_rl.models.attention import device_offsets, packed_seq_params

    copies = []
    monkeypatch.setattr(attention, "host_to_device", lambda t, device: copies.append(t.tolist()) or t.to(device))
    params, other = packed_seq_params([3, 5], multiple=4), packed_seq_params([2, 2], multiple=1)
    offsets = [0, 4, 12]
    first = device_offsets(params, offsets, torch.device("cpu"))
    for _ in range(3):  # three more layers of the same microbatch
        assert device_offsets(params, offsets, torch.device("cpu")) is first
    assert first.dtype == torch.int32 and first.tolist() == offsets
    device_offsets(other, [0, 2, 4], torch.device("cpu"))  # the next microbatch: its own copy
    assert copies == [[0, 4, 12], [0, 2, 4]]
