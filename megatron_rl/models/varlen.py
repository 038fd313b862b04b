"""How this torch's flash varlen kernel is called: read from the installed function's signature, never assumed.

``torch.nn.attention.varlen.varlen_attn`` changed its keywords from release to release:

    torch 2.9 / 2.10:  (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)
    torch 2.11:        (..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1))
    torch 2.13:        (..., max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False,
                        seqused_k=None, block_table=None, num_splits=None)

The packed attention needs a causal window (``window_size=(-1, 0)``) and the model's softmax scale
(``scale=``); grouped-query heads go in as ``enable_gqa=True`` where the kernel takes it, and
otherwise key/value heads are expanded first, as ``repeat_interleave`` over the head dim (query
head n reads group n // (heads / groups), megatron's and SDPA's convention): the same numbers,
at the cost of heads / groups times the key/value bytes for the call.

    binding, why = varlen_binding()          # from the installed torch (None, reason) where it cannot serve
    out = binding.call(kernel, q, k, v, cu_seqlens, longest, scale)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

REQUIRED_POSITIONAL = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k")


@dataclass(frozen=True)
class VarlenBinding:
    """The keywords the installed varlen kernel takes (models.kernels sets one per build)."""

    enable_gqa: bool
    """The kernel takes ``enable_gqa``; without it key/value heads are expanded before the call."""

    def arguments(self, query, key, value, cu_seqlens: torch.Tensor, longest: int, scale: float) -> tuple[tuple, dict]:
        """(args, kwargs) of one causal call over packed [t, heads, d] query and key, [t, groups, d_v] value.

        The kernel takes one head dim for query, key and value (flash: ``CHECK_SHAPE(v, total_k, heads_k, d)``);
        a narrower value (MLA: d = qk_head_dim + rope dim, d_v = v_head_dim) is padded with zero columns, which
        only add zero columns to the output (`call` drops them): exact.
        """
        heads, groups = query.shape[1], key.shape[1]
        if value.shape[-1] < query.shape[-1]:
            value = torch.nn.functional.pad(value, (0, query.shape[-1] - value.shape[-1]))
        kwargs = {"scale": scale, "window_size": (-1, 0)}  # (-1, 0): every earlier key of the sequence, none later
        if heads != groups:
            if self.enable_gqa:
                kwargs["enable_gqa"] = True
            else:
                key = key.repeat_interleave(heads // groups, dim=1)
                value = value.repeat_interleave(heads // groups, dim=1)
        return (query, key, value, cu_seqlens, cu_seqlens, longest, longest), kwargs

    def call(self, kernel: Callable, query, key, value, cu_seqlens: torch.Tensor, longest: int, scale: float) -> torch.Tensor:
        """kernel(...) -> [t, heads, d_v]."""
        args, kwargs = self.arguments(query, key, value, cu_seqlens, longest, scale)
        out = kernel(*args, **kwargs)
        return out[..., : value.shape[-1]] if value.shape[-1] < out.shape[-1] else out


def installed_varlen_attn() -> Callable | None:
    """torch.nn.attention.varlen.varlen_attn, or None where this torch has none (before 2.9)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_binding(fn: Callable | None = None) -> tuple[VarlenBinding | None, str]:
    """(binding, why) for `fn` (default: the installed varlen_attn); binding None where it cannot serve packed attention."""
    fn = installed_varlen_attn() if fn is None else fn
    if fn is None:
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None, "torch's varlen_attn has no readable signature"
    missing = [name for name in REQUIRED_POSITIONAL if name not in params]
    missing += [name for name in ("scale", "window_size") if name not in params]
    if missing:
        return None, f"torch {torch.__version__}'s varlen_attn takes no {', '.join(missing)} (a causal window and a scale are needed)"
    if "enable_gqa" in params:
        return VarlenBinding(enable_gqa=True), "enable_gqa for grouped-query heads"
    return VarlenBinding(enable_gqa=False), f"torch {torch.__version__}'s varlen_attn has no enable_gqa: key/value heads expanded"


def probe_varlen(binding: VarlenBinding, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 fn: Callable | None = None) -> str | None:
    """One tiny grouped-query call on `device`: None where it runs, else why not (the error, one line)."""
    fn = installed_varlen_attn() if fn is None else fn
    gen = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(12, 4, 64, device=device, dtype=dtype, generator=gen)
    key, value = (torch.randn(12, 2, 64, device=device, dtype=dtype, generator=gen) for _ in range(2))
    cu_seqlens = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    try:
        out = binding.call(fn, query, key, value, cu_seqlens, 7, 0.125)
    except Exception as err:  # noqa: BLE001 - any failure means: do not build on this kernel here
        return f"a probe call failed ({type(err).__name__}: {' '.join(str(err).split())[:160]})"
    if tuple(out.shape) != (12, 4, 64) or not bool(torch.isfinite(out).all()):
        return f"a probe call returned shape {tuple(out.shape)} / non-finite values"
    return None


__all__ = ["VarlenBinding", "installed_varlen_attn", "probe_varlen", "varlen_binding"]
