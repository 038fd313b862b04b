"""Rotary position embedding of a packed (THD) microbatch: one table per microbatch, one rotation per tensor.

megatron-core's unfused RoPE for THD (rope_utils._apply_rotary_pos_emb_thd) cuts every query and
key tensor into its sequences, takes each sequence's frequencies, computes their cos and sin and
concatenates: per layer, a few ops per sequence and a scalar read of cu_seqlens. Here the packed
table is made once per microbatch (kept on its PackedSeqParams, read by every layer and the
recomputation in backward):

    position(i) = i - start of i's sequence          (laid-out, padded offsets: megatron's)
    cos_i, sin_i = cos(freqs[position(i)]) x mscale, sin(freqs[position(i)]) x mscale

and each tensor is rotated in one pass (RoFormer, Su et al. 2021, Eq. 34, the half-split layout):

    rotate(x) = x cos + rotate_half(x) sin,  rotate_half([x1, x2]) = [-x2, x1]
              = x cos + roll(x, d/2) sin_signed,   sin_signed = [-sin1, sin2]

(roll(x, d/2) = [x2, x1]; the sign moves into the table): a product, a roll and a fused
multiply-add forward; backward, dx = g cos + roll(g sin_signed, -d/2), the same three. A
rotary dim below the head dim (partial rotary) rotates the first `rot_dim` channels and passes
the rest, as megatron does.
"""

from __future__ import annotations

import functools

import numpy
import torch

from megatron_rl.parallel.devices import host_to_device


class _Rotate(torch.autograd.Function):
    """x cos + roll(x, d/2) sin_signed over the last dim (module docstring); the tables take no gradient."""

    @staticmethod
    def forward(ctx, x, cos, sin_signed):
        ctx.save_for_backward(cos, sin_signed)
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)

    @staticmethod
    def backward(ctx, grad):
        cos, sin_signed = ctx.saved_tensors
        shifted = (grad * sin_signed).roll(-(grad.shape[-1] // 2), -1)
        return torch.addcmul(shifted, grad, cos), None, None


def rotate(x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE of x [t, 1, heads, d] with a packed table (cos, sin_signed) [t, 1, 1, rot_dim] (module docstring)."""
    cos, sin_signed = table
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return _Rotate.apply(x, cos, sin_signed)
    return torch.cat((_Rotate.apply(x[..., :rot_dim], cos, sin_signed), x[..., rot_dim:]), dim=-1)


def _rotate_pair(query, key, cos, sin_signed):
    """Both rotations as plain ops, for torch.compile to fuse (forward and the backward it derives)."""
    half = cos.shape[-1] // 2
    return query * cos + query.roll(half, -1) * sin_signed, key * cos + key.roll(half, -1) * sin_signed


@functools.cache
def rotate_pair_compiled():
    """torch.compile'd rotation of the query and key (model.compile_regions): dynamic shapes, so microbatches of
    other sizes reuse the compilation."""
    return torch.compile(_rotate_pair, dynamic=True)


def packed_positions(offsets: list[int]) -> torch.Tensor:
    """Each laid-out token's position in its sequence, int64 [offsets[-1]], built on the host (numpy: no tensor op)
    e.g. offsets [0, 3, 5] -> [0, 1, 2, 0, 1]."""
    starts = numpy.asarray(offsets[:-1], dtype=numpy.int64)
    lengths = numpy.diff(numpy.asarray(offsets, dtype=numpy.int64))
    return torch.from_numpy(numpy.arange(offsets[-1], dtype=numpy.int64) - numpy.repeat(starts, lengths))


def _trig(freqs: torch.Tensor, dtype: torch.dtype, mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin_signed) of megatron's rotary frequencies [max_len, 1, 1, rot_dim], made once per frequency tensor (megatron
    caches it per length) and kept on it."""
    cached = getattr(freqs, "rope_trig", None)
    if cached is not None and cached[0] == (dtype, mscale):
        return cached[1]
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    half = freqs.shape[-1] // 2
    trig = (cos.to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype))
    freqs.rope_trig = ((dtype, mscale), trig)
    return trig


def packed_table(params, offsets: list[int], freqs: torch.Tensor, dtype: torch.dtype, mscale: float = 1.0):
    """(cos, sin_signed) [t, 1, 1, rot_dim] in `dtype` for a packed microbatch laid out at `offsets`, from megatron's
    rotary frequencies `freqs` [max_len, 1, 1, rot_dim]; made once and kept on `params` (its PackedSeqParams)."""
    key = (dtype, mscale, tuple(offsets))
    cached = getattr(params, "packed_rope", None)
    if cached is not None and cached[0] is freqs and cached[1] == key:
        return cached[2]
    positions = host_to_device(packed_positions(offsets), freqs.device)
    table = tuple(trig.index_select(0, positions) for trig in _trig(freqs, dtype, mscale))
    params.packed_rope = (freqs, key, table)
    return table


__all__ = ["packed_positions", "packed_table", "rotate", "rotate_pair_compiled"]
