"""Loss metrics that aggregate exactly over microbatches and ranks.

Every metric is a small detached tensor whose reduction is named by its key:

| key            | value                      | combine by            | final value     |
| -------------- | -------------------------- | --------------------- | --------------- |
| ``name``       | float64 ``[2]``: sum, count | add both              | sum / count     |
| ``name/sum``   | float64 scalar             | add                   | the sum         |
| ``name/min``   | float64 scalar (+inf empty) | minimum               | the min         |
| ``name/max``   | float64 scalar (-inf empty) | maximum               | the max         |

A mean is carried as (sum, count), never as a per-microbatch mean: averaging
per-microbatch means weights a microbatch of 3 tokens like one of 3,000 (the
per-microbatch-mean bug the normalisation contract exists to prevent).
Counts are float64, exact up to 2**53 tokens.

Nothing here syncs with the host except `finalize_metrics`, which the caller
runs once per step after `merge_metrics` (microbatches) and
`all_reduce_metrics` (ranks).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.distributed as dist

Metrics = dict[str, torch.Tensor]

_MIN, _MAX, _SUM = "/min", "/max", "/sum"


def reduce_kind(name: str) -> str:
    """'min', 'max', 'sum' or 'mean', from the key's suffix."""
    if name.endswith(_MIN):
        return "min"
    if name.endswith(_MAX):
        return "max"
    if name.endswith(_SUM):
        return "sum"
    return "mean"


def mean_metric(values: torch.Tensor, mask: torch.Tensor | None = None, count: torch.Tensor | None = None) -> torch.Tensor:
    """(sum of values where mask, count where mask) as a detached float64 [2] tensor.

    ``mask`` is bool or a 0/1 tensor of the values' dtype (cheaper to multiply by).

    `values` must be finite everywhere (the loss sanitises first; masking is a
    multiply, cheaper than where()). The sum accumulates in float64 as it reads
    the values (no float64 copy of a [B, T] tensor); pass ``count`` (= mask.sum(),
    float64 best: then nothing is converted) when known.
    """
    values = values.detach()
    if mask is None:
        total = values.sum(dtype=torch.float64)
        count = torch.tensor(float(values.numel()), dtype=torch.float64, device=values.device)
    else:
        total = (values * mask).sum(dtype=torch.float64)  # values are finite where masked out too (see above)
        count = mask.sum(dtype=torch.float64) if count is None else count
    return torch.stack([total, count.to(torch.float64)])


def fraction_metric(hits: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(hits, count) as float64 [2]: a fraction that aggregates exactly (e.g. clipped tokens / tokens)."""
    return torch.stack([hits.to(torch.float64), count.to(torch.float64)])


def sum_metric(value: torch.Tensor) -> torch.Tensor:
    """A detached float64 scalar that adds up over microbatches and ranks."""
    return value.detach().sum(dtype=torch.float64)


def min_metric(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Minimum of values where mask (+inf when the mask is empty), detached float64 scalar."""
    values = values.detach()
    if not values.numel():
        return _empty(values, torch.inf)
    return torch.where(mask, values, torch.inf).amin().to(torch.float64)


def max_metric(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Maximum of values where mask (-inf when the mask is empty), detached float64 scalar."""
    values = values.detach()
    if not values.numel():
        return _empty(values, -torch.inf)
    return torch.where(mask, values, -torch.inf).amax().to(torch.float64)


def _empty(like: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.tensor(fill, dtype=torch.float64, device=like.device)


def _combine(name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    kind = reduce_kind(name)
    if kind == "min":
        return torch.minimum(a, b)
    if kind == "max":
        return torch.maximum(a, b)
    return a + b


def merge_metrics(metric_dicts: Iterable[Mapping[str, torch.Tensor]]) -> Metrics:
    """Combine the metrics of several microbatches exactly (keys may differ; missing keys are skipped)."""
    merged: Metrics = {}
    for metrics in metric_dicts:
        for name, value in metrics.items():
            merged[name] = value.detach().clone() if name not in merged else _combine(name, merged[name], value.detach())
    return merged


def all_reduce_metrics(metrics: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None = None) -> Metrics:
    """Combine metrics over the ranks of `group` with two collectives (SUM, then MAX with min negated).

    Every rank must hold the same keys (the same loss config gives the same
    keys); the result is identical on every rank. Without an initialised
    process group (or with one rank) the metrics come back unchanged.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return dict(metrics)
    names = sorted(metrics)
    additive = [n for n in names if reduce_kind(n) in ("mean", "sum")]
    extreme = [n for n in names if reduce_kind(n) in ("min", "max")]
    out: Metrics = {}
    if additive:
        flat = torch.cat([metrics[n].detach().to(torch.float64).reshape(-1) for n in additive])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for n in additive:
            size = metrics[n].numel()
            out[n] = flat[offset : offset + size].reshape(metrics[n].shape)
            offset += size
    if extreme:
        # min(x) = -max(-x): one MAX collective covers both kinds.
        signs = torch.tensor([-1.0 if reduce_kind(n) == "min" else 1.0 for n in extreme], dtype=torch.float64)
        flat = torch.stack([metrics[n].detach().to(torch.float64).reshape(()) for n in extreme])
        signs = signs.to(flat.device)
        flat = flat * signs
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        flat = flat * signs
        for i, n in enumerate(extreme):
            out[n] = flat[i]
    return out


def finalize_metrics(metrics: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Host floats: means as sum/count (NaN when the count is 0), min/max NaN when empty.

    One device-to-host transfer for all metrics; run it once per step, outside
    the loss (it synchronises with the device).
    """
    names = sorted(metrics)
    if not names:
        return {}
    flat = torch.cat([metrics[n].detach().to(torch.float64).reshape(-1) for n in names]).cpu().tolist()
    out: dict[str, float] = {}
    offset = 0
    for n in names:
        kind = reduce_kind(n)
        if kind == "mean":
            total, count = flat[offset], flat[offset + 1]
            out[n] = total / count if count > 0 else float("nan")
            offset += 2
        else:
            value = flat[offset]
            empty = kind in ("min", "max") and value in (float("inf"), float("-inf"))
            out[n] = float("nan") if empty else value
            offset += 1
    return out


__all__ = [
    "Metrics",
    "all_reduce_metrics",
    "finalize_metrics",
    "fraction_metric",
    "max_metric",
    "mean_metric",
    "merge_metrics",
    "min_metric",
    "reduce_kind",
    "sum_metric",
]
