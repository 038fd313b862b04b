"""The kernels a GPU build picks, run on the CPU so that bench/op_count.py counts what a GPU dispatches.

The actor built on CPU runs CPU choices (models.kernels: per-expert GEMMs, one exact SDPA per
packed sequence) and torch's CPU build decomposes some ops that a CUDA build runs as one kernel.
`gpu_kernel_choices` switches a built actor to what the same build picks on a GPU, and
`cuda_kernels_on_cpu` registers CPU implementations for the CUDA-only ops involved, exact
(float32) and counted as the CUDA op they stand for:

* routed experts: megatron's GroupedMLP on torch._grouped_mm (the model is built with
  model.moe_grouped_gemm=true: torch's grouped matmul has a CPU kernel, the same op);
* packed attention: the varlen kernel (torch.nn.attention.varlen.varlen_attn), one call per
  microbatch: its custom ops ``torch_attn::_varlen_attn`` / ``_varlen_attn_backward`` get a CPU
  implementation (exact attention per sequence of cu_seqlens); the counter counts the kernels
  their CUDA implementation launches (bench/op_counter.py CUSTOM_OP_KERNELS);
* RMSNorm: torch's ``rms_norm`` calls ``aten::_fused_rms_norm`` (one kernel, and
  ``_fused_rms_norm_backward``) on CUDA but decomposes it on CPU (pow, mean, add, rsqrt, mul,
  ...): CPU kernels for both, torch's own reference decompositions;
* the optimizer: torch's fused Adam (actor.optim.fuse_torch_adam), as on a GPU.

What is not emulated (counted as the CPU runs it) is listed in NOT_EMULATED.
"""

from __future__ import annotations

import contextlib

import torch

EMULATED = ("experts: torch._grouped_mm (GroupedMLP)", "packed attention: flash varlen (torch_attn::_varlen_attn)",
            "RMSNorm: aten::_fused_rms_norm", "optimizer: torch's fused Adam")
NOT_EMULATED = (
    "megatron's jit fusions (torch.compile'd with triton on a GPU: the experts' SwiGLU times the routing "
    "probabilities, the router's expert bias): counted eager, one kernel per op",
    "bf16: a GPU trains in bf16; the casts around the router's fp32 gating and the fp32 logits are absent in fp32",
    "host-to-device copies of host metadata (cu_seqlens, replayed routes): no op on a CPU tensor, one copy on a GPU",
    "communication: one rank, no all-reduce / all-to-all",
    "Transformer Engine's fused kernels (RoPE, permute, router): the local spec does not use them",
)


def _per_sequence_attention(query, key, value, offsets: list[int], scale: float):
    """[t, h, d] x [t, g, d] causal attention per sequence of `offsets`: (out [t, h, d], lse [h, t])."""
    outs, lses = [], []
    repeat = query.shape[1] // key.shape[1]
    for start, end in zip(offsets[:-1], offsets[1:]):
        q = query[start:end].transpose(0, 1)
        k = key[start:end].transpose(0, 1).repeat_interleave(repeat, 0)
        v = value[start:end].transpose(0, 1).repeat_interleave(repeat, 0)
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(torch.ones(end - start, end - start, dtype=torch.bool).triu(1), float("-inf"))
        lse = scores.logsumexp(-1)
        outs.append((torch.exp(scores - lse[..., None]) @ v).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=-1)


def _varlen_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                    window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, lse = _per_sequence_attention(query, key, value, cu_seq_q.tolist(), scale)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _varlen_backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                     rng_state, scale=None, window_size=None):
    """Flash attention's backward per sequence: dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), dQ = s dS K, dK = s dS^T Q
    (Dao et al. 2022, FlashAttention, Appendix B.2), summed over the query heads of each key/value group."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    grads = [torch.zeros_like(x) for x in (query, key, value)]
    repeat = query.shape[1] // key.shape[1]
    offsets = cu_seq_q.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        q, o, do = (x[start:end].transpose(0, 1) for x in (query, out, grad_out))
        k, v = (x[start:end].transpose(0, 1).repeat_interleave(repeat, 0) for x in (key, value))
        scores = (q @ k.transpose(-1, -2)) * scale
        p = scores.masked_fill(torch.ones(end - start, end - start, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True)) * scale
        for grad, value_ in zip(grads, (ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do)):
            grouped = value_ if grad is grads[0] else value_.unflatten(0, (-1, repeat)).sum(1)
            grad[start:end] = grouped.transpose(0, 1)
    return tuple(grads)


@contextlib.contextmanager
def cuda_kernels_on_cpu():
    """CPU implementations of the CUDA-only ops above, registered while open (module docstring)."""
    from torch._decomp import decompositions
    from torch.nn.attention import varlen  # noqa: F401  (defines the torch_attn custom ops)

    norm = torch.library.Library("aten", "IMPL")
    norm.impl("_fused_rms_norm", decompositions._fused_rms_norm, "CPU")
    norm.impl("_fused_rms_norm_backward", decompositions._fused_rms_norm_backward, "CPU")
    attention = torch.library.Library("torch_attn", "IMPL")
    attention.impl("_varlen_attn", _varlen_forward, "CPU")
    attention.impl("_varlen_attn_backward", _varlen_backward, "CPU")
    try:
        yield
    finally:
        norm._destroy()
        attention._destroy()


def gpu_kernel_choices(actor) -> None:
    """Switch a built actor (model.moe_grouped_gemm=true) to a GPU's packed attention and optimizer (docstring)."""
    from megatron_rl.actor.optim import fuse_torch_adam
    from megatron_rl.models.attention import LocalCoreAttention
    from megatron_rl.models.varlen import varlen_binding

    binding, why = varlen_binding()
    if binding is None:
        raise RuntimeError(f"this torch cannot stand for a GPU's packed attention: {why}")
    for chunk in actor.model:
        for module in chunk.modules():
            if isinstance(module, LocalCoreAttention):
                module.packed_kernel, module.varlen_binding = "varlen", binding
    fuse_torch_adam(actor.optimizer, device=torch.device("cpu"))
