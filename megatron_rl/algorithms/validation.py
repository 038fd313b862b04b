"""Host-side checks the caller runs outside the loss hot path (each synchronises with the device).

The losses themselves never synchronise: they drop non-finite tokens and count
them in ``nonfinite_tokens/sum``. What they cannot do without a host sync is
refuse a batch in which nothing is left, so the caller runs
`check_finite_logprobs` once per step on the tensors it has before training
(old logprobs after the old-policy forward, rollout and reference logprobs),
and may run `check_step_metrics` on the finalised metrics after the step.
"""

from __future__ import annotations

from typing import Mapping

import torch


class NonFiniteLogprobsError(ValueError):
    """Every response token of a batch has a NaN or inf logprob: there is nothing to train on."""


def check_finite_logprobs(response_mask: torch.Tensor, **named: torch.Tensor | None) -> dict[str, int]:
    """Count non-finite values among response tokens for each named [B, T] tensor; raise if all are.

    Example: ``check_finite_logprobs(mask, old_logprobs=old, rollout_logprobs=rollout)``.
    Returns {name: number of non-finite response tokens}. Raises
    `NonFiniteLogprobsError` when the mask has response tokens and every one of
    them is non-finite in some tensor (a diverged forward, an fp16 overflow, a
    corrupt checkpoint or engine output: training on it would step the optimizer
    on a zero gradient with stale momentum). None entries are skipped.
    """
    names = [n for n, t in named.items() if t is not None]
    if not names:
        return {}
    for name in names:
        if named[name].shape != response_mask.shape:
            raise ValueError(f"{name} has shape {tuple(named[name].shape)}, response_mask has {tuple(response_mask.shape)}")
    counts = torch.stack([(response_mask & ~torch.isfinite(named[n])).sum() for n in names] + [response_mask.sum()])
    host = counts.tolist()
    total = host[-1]
    result = dict(zip(names, host[:-1]))
    for name, bad in result.items():
        if total > 0 and bad == total:
            raise NonFiniteLogprobsError(
                f"all {total} response tokens have a NaN or inf {name}: the forward pass that produced it diverged "
                "(check for fp16 overflow, a corrupt checkpoint or a broken rollout engine); refusing to train on this batch"
            )
    return result


def check_step_metrics(metrics: Mapping[str, float]) -> None:
    """After `finalize_metrics`: raise if the step had response tokens but every one was non-finite."""
    valid = metrics.get("tokens/sum", 0.0)
    bad = metrics.get("nonfinite_tokens/sum", 0.0)
    if bad > 0 and valid == 0:
        raise NonFiniteLogprobsError(
            f"every one of the step's {bad:.0f} response tokens had non-finite logprobs (or ref/rollout logprobs or "
            "entropy): the loss was zero; check the model's forward pass for NaN (fp16 overflow, a bad checkpoint)"
        )


__all__ = ["NonFiniteLogprobsError", "check_finite_logprobs", "check_step_metrics"]
