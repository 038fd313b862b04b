"""Grouped GEMM for megatron-core's GroupedMLP on a plain torch install (no `grouped_gemm` package).

megatron-core's GroupedMLP (the experts of `moe_grouped_gemm=True` without
Transformer Engine, transformer/moe/experts.py) multiplies each local expert's
tokens by that expert's weights in one call:

    gmm(a, b, batch_sizes, trans_b=False)
      a            [sum(batch_sizes), k]   tokens, sorted by expert
      b            [E, k, n] ([E, n, k] with trans_b)
      batch_sizes  [E] int64 on the host: expert e's tokens are rows
                   [sum(batch_sizes[:e]), sum(batch_sizes[:e + 1])) of a
      ->           [sum(batch_sizes), n]:  rows of expert e = a_e @ b[e]  (b[e]^T with trans_b)

The `grouped_gemm` package (github.com/fanshiqing/grouped_gemm) runs this as one
CUTLASS kernel, bf16 only. Without it, two providers, chosen per call:

* ``torch_grouped_mm``: torch's own grouped matmul, ``torch._grouped_mm(a, b, offs=cumsum(batch_sizes))``
  (the kernel transformers' MoE experts use): one kernel for all experts, forward and
  backward. It runs where torch has it for the device and dtype: CUDA bf16 on compute
  capability 9.0+ (Hopper), and on CPU; its kernels need row strides of a multiple of 16
  bytes (k and n x element size), so other shapes take the loop;
* ``per_expert_loop``: E matmuls over torch.split of `a`, through autograd (grad a_e =
  grad_out_e b[e]^T, grad b[e] = a_e^T grad_out_e), in any dtype and shape.

On one H200 (bf16, 131k routed tokens, 64 experts, SwiGLU 2048 -> 768 -> 2048, forward and
backward) one layer's expert work took 49.7 ms as a per-expert loop and 7.4 ms with
torch's grouped matmul. The compatibility layer binds this module as megatron's
`grouped_gemm` (site "grouped-gemm-fallback") only when the package does not import.
"""

from __future__ import annotations

import functools
import types

import torch

from megatron_rl.parallel.devices import host_to_device


def grouped_mm_supported(device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None, *, has_op: bool) -> bool:
    """Whether torch._grouped_mm has a kernel: CUDA bf16 on compute capability >= 9.0, or CPU in fp32 / bf16 / fp16."""
    if not has_op:
        return False
    if device_type == "cuda":
        return dtype == torch.bfloat16 and capability is not None and capability >= (9, 0)
    return device_type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)


def torch_grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """grouped_mm_supported for this torch and this device, confirmed once by a tiny call there (forward and backward)."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if not grouped_mm_supported(device.type, dtype, capability, has_op=hasattr(torch, "_grouped_mm")):
        return False
    index = (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else None
    return _probe_grouped_mm(device.type, index, dtype) is None


@functools.cache
def _probe_grouped_mm(device_type: str, index: int | None, dtype: torch.dtype) -> str | None:
    """None where torch._grouped_mm runs a tiny grouped GEMM (with its backward) on the device, else the error.
    Autograd on whatever the caller's context (its first call may come under no_grad or inference_mode: cached,
    a failure there would keep the per-expert loop for the whole process)."""
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        with torch.inference_mode(False), torch.enable_grad():
            return _grouped_mm_probe_call(device, dtype)
    except Exception as err:  # noqa: BLE001 - any failure means: use the per-expert loop here
        return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"


def _grouped_mm_probe_call(device: torch.device, dtype: torch.dtype) -> str | None:
    a = torch.ones(32, 16, device=device, dtype=dtype, requires_grad=True)
    b = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
    out = torch._grouped_mm(a, b.transpose(-2, -1), offs=torch.tensor([8, 32], dtype=torch.int32, device=device))
    out.backward(torch.ones_like(out))  # a contiguous gradient, as _ContiguousGrad hands it
    return None if bool((out == 16).all()) else "a probe call gave wrong values"


def _aligned(*sizes: int, itemsize: int) -> bool:
    return all((n * itemsize) % 16 == 0 for n in sizes)


def provider_for(a: torch.Tensor, weights: torch.Tensor) -> str:
    """Which provider `gmm` uses for tokens a [m, k] and expert weights [E, k, n] (see the module docstring)."""
    k, n = weights.shape[1], weights.shape[2]
    if torch_grouped_mm_runs(a.device, a.dtype) and weights.dtype == a.dtype and _aligned(k, n, itemsize=a.element_size()):
        return "torch_grouped_mm"
    return "per_expert_loop"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (torch._grouped_mm's backward
    refuses the zero-stride gradients that e.g. `.sum()` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """Grouped matrix product: for each expert e, its rows of `a` times b[e] (see the module docstring).

    batch_sizes: a host tensor (as the grouped_gemm package requires), or counts on the device that carry their
    cumulative int32 end rows as `grouped_mm_offsets` (models.moe's sorted dispatch): torch's grouped matmul then
    takes those as they are, without reading the counts on the host (no device sync)."""
    weights = b.transpose(-1, -2) if trans_b else b  # [E, k, n]
    offsets = getattr(batch_sizes, "grouped_mm_offsets", None)
    if offsets is not None and provider_for(a, weights) == "torch_grouped_mm":
        if offsets.numel() != b.shape[0]:
            raise ValueError(f"gmm: {offsets.numel()} expert offsets for {b.shape[0]} experts")
        return _ContiguousGrad.apply(torch._grouped_mm(a.contiguous(), weights, offs=offsets))
    sizes = [int(n) for n in batch_sizes.tolist()]  # on the host: the per-expert loop splits by them
    if len(sizes) != b.shape[0] or sum(sizes) != a.shape[0]:
        raise ValueError(
            f"gmm: batch_sizes {sizes} must have one entry per expert ({b.shape[0]}) and sum to the rows of a ({a.shape[0]})"
        )
    if provider_for(a, weights) == "torch_grouped_mm":
        offsets = host_to_device(torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32), a.device)
        return _ContiguousGrad.apply(torch._grouped_mm(a.contiguous(), weights, offs=offsets))
    products = [rows @ weights[e] for e, rows in enumerate(torch.split(a, sizes))]
    return torch.cat(products, dim=0)


ops = types.SimpleNamespace(gmm=gmm)
"""What megatron reads as `grouped_gemm.ops`."""

package = types.SimpleNamespace(ops=ops, __name__="megatron_rl.parallel.grouped_gemm_torch")
"""What megatron reads as the `grouped_gemm` module."""
