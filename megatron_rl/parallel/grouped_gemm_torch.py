"""A torch stand-in for the `grouped_gemm` CUDA package, so megatron-core's GroupedMLP runs on a CPU build.

megatron-core's GroupedMLP (the experts of `moe_grouped_gemm=True` without
Transformer Engine, transformer/moe/experts.py) multiplies each local expert's
tokens by that expert's weights in one call:

    gmm(a, b, batch_sizes, trans_b=False)
      a            [sum(batch_sizes), k]   tokens, sorted by expert
      b            [E, k, n] ([E, n, k] with trans_b)
      batch_sizes  [E] int64 on the host: expert e's tokens are rows
                   [sum(batch_sizes[:e]), sum(batch_sizes[:e + 1])) of a
      ->           [sum(batch_sizes), n]:  rows of expert e = a_e @ b[e]  (b[e]^T with trans_b)

The CUDA package (github.com/fanshiqing/grouped_gemm) runs this as one CUTLASS
kernel in bf16 only. Here it is the same product written as E matmuls over
torch.split of `a`, differentiable through autograd (grad a_e = grad_out_e
b[e]^T, grad b[e] = a_e^T grad_out_e), in any dtype. It is bound only by the
CPU compatibility layer (cpu_compat, site "grouped-gemm-fallback") and only
when the real package does not import.
"""

from __future__ import annotations

import types

import torch


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """Grouped matrix product: for each expert e, its rows of `a` times b[e] (see the module docstring)."""
    sizes = [int(n) for n in batch_sizes.tolist()]  # a host tensor, as grouped_gemm requires: no device sync
    if len(sizes) != b.shape[0] or sum(sizes) != a.shape[0]:
        raise ValueError(
            f"gmm: batch_sizes {sizes} must have one entry per expert ({b.shape[0]}) and sum to the rows of a ({a.shape[0]})"
        )
    weights = b.transpose(-1, -2) if trans_b else b
    products = [rows @ weights[e] for e, rows in enumerate(torch.split(a, sizes))]
    return torch.cat(products, dim=0)


ops = types.SimpleNamespace(gmm=gmm)
"""What megatron reads as `grouped_gemm.ops`."""

package = types.SimpleNamespace(ops=ops, __name__="megatron_rl.parallel.grouped_gemm_cpu")
"""What megatron reads as the `grouped_gemm` module."""
