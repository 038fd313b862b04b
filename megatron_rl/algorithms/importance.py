"""Rollout-vs-trainer corrections: importance-sampling (IS) options, a registry by name, and mismatch metrics.

The engine that sampled the responses (vLLM: other kernels, precision, MoE
routing, older weights under asynchronous training) assigns them logprobs
that differ from the trainer's. The trainer's old policy pi_old is what the
loss's ratio is taken against, so the samples are off-policy by

    rho_t = pi_old(y_t) / pi_rollout(y_t)                     (token ratio)
    rho_i = exp((1/|y_i|) sum_t log rho_t)                    (sequence ratio: the geometric mean)

The sequence ratio is the geometric mean of the token ratios (as GSPO's s_i,
arXiv 2507.18071 Eq. 7), never exp of a sum: the plain product over thousands
of tokens explodes or vanishes.

An IS correction (config key ``algorithm.tis_mode``) turns the ratios into a
detached weight on each policy-gradient term and a *keep* mask. A dropped
token (or every token of a dropped sequence) leaves the loss entirely: no
policy term, no KL or entropy term, not in |y_i| nor in GSPO's geometric mean,
and not in the step's global denominators -- the caller passes the response
mask with dropped tokens removed (`rejection_response_mask`) to
`normalization.compute_loss_denominators` (the rejected tokens are not
samples of the target distribution; counting them would shrink every other
token's gradient, the normalisation bug fixed in slime#657 / verl#3915).

Registered corrections, each with its defaults beside it (`IS_CORRECTIONS`):

| name              | level    | weight on kept terms            | dropped where                       | defaults              |
| ----------------- | -------- | ------------------------------- | ----------------------------------- | --------------------- |
| token             | token    | min(rho_t, C)                   | never                               | C = 2                 |
| sequence          | sequence | min(rho_i, C)                   | never                               | C = 2                 |
| token_mask        | token    | rho_t                           | rho_t outside [lower, upper]        | [0, 2]                |
| sequence_mask     | sequence | rho_i                           | rho_i outside [lower, upper]        | [0, 2]                |
| icepop            | token    | rho_t                           | rho_t outside [lower, upper]        | [0.5, 5]              |
| sequence_mask_tis | sequence | min(rho_i, C)                   | rho_i outside [lower, upper]        | [0.5, 2], C = 2       |

References: truncated IS (Yao, Liu et al. 2025, "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training", the TIS estimator
min(pi_old / pi_rollout, C)); masked IS (token / sequence "mask" modes of TRL's
vllm_importance_sampling_mode and verl's rollout rejection sampling: a ratio
outside the band rejects the token or the sequence); IcePop (Ling Team 2025,
"Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model",
arXiv 2510.18855, Eq. for J_IcePop: M(k) = k if k in [alpha, beta] else 0 with
k = pi_train / pi_infer, alpha = 0.5, beta = 5).

A sequence-level weight works with every loss; a token-level one does not
apply to GSPO's per-sequence term (use gspo_token, or a sequence-level option).
Adding a correction is one `register_is_correction` entry in this file, or, without a change to the
package, an `ISCorrection` (or a token-level weight function) named by its import path in
algorithm.tis_mode (megatron_rl.plugins).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol

import torch

from megatron_rl.algorithms._finite import finite
from megatron_rl.algorithms._registry import Registry
from megatron_rl.algorithms.kl import MAX_LOG_RATIO, kl_penalty
from megatron_rl.algorithms.metrics import Metrics, fraction_metric, max_metric, mean_metric, min_metric

Level = Literal["token", "sequence"]


@dataclass(frozen=True, kw_only=True)
class ISParams:
    """The numbers of one correction: cap C of truncation, band [lower, upper] of masking (None = not used)."""

    cap: float | None = None
    lower: float | None = None
    upper: float | None = None


@dataclass(frozen=True, kw_only=True)
class ISWeights:
    """A correction's output for one microbatch (all detached)."""

    weight: torch.Tensor
    """[B, T] (token level) or [B, 1] (sequence level): multiplies each policy term; 0 where dropped."""
    keep: torch.Tensor
    """[B, T] bool: response tokens (with finite old and rollout logprobs) that stay in the loss."""
    truncated: torch.Tensor
    """[B, T] or [B, 1] bool: the weight was cut at the cap."""


class WeightFn(Protocol):
    """The call a correction's weight function takes: log_rho [B, T] (token level) or [B, 1] (sequence level),
    finite; params (ISParams) -> (weight, keep bool, truncated bool), each of log_rho's shape."""

    def __call__(self, log_rho, params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, kw_only=True)
class ISCorrection:
    """One registered correction: `weights(log_rho, params)` at `level`, and its defaults."""

    name: str
    level: Level
    defaults: ISParams | None
    """cap / lower / upper where the config leaves them None; a number the correction does not use is None (the
    config's value is then ignored). None: the config's tis_cap, is_lower, is_upper as given (a plug-in function)."""
    weights: WeightFn
    """(log_rho [B, T] token or [B, 1] sequence log ratio, finite; params) -> (weight, keep, truncated), same shape."""
    drops: bool = True
    """Whether `keep` can be False: a correction that drops tokens sets the step's denominators before any
    training forward, from the old logprobs (so they need a forward of their own: train.old_logprobs)."""


IS_CORRECTIONS: Registry[ISCorrection] = Registry("importance-sampling correction", "algorithm.tis_mode", WeightFn)
"""Entries are ISCorrection; the registry's call is their weight function's."""


def as_is_correction(entry: Any, path: str) -> ISCorrection:
    """A plug-in given as algorithm.tis_mode=path: an ISCorrection as it is, or a weight function as a token-level
    correction that may drop tokens and reads the config's tis_cap, is_lower and is_upper as given."""
    if isinstance(entry, ISCorrection):
        return entry
    return ISCorrection(name=path, level="token", defaults=None, weights=entry)


def register_is_correction(name: str, *, level: Level, drops: bool = True, **defaults: float) -> Callable[[WeightFn], WeightFn]:
    """Register `fn(log_rho, params) -> (weight, keep, truncated)` as correction `name` with its default params;
    drops=False promises that `keep` is always True (a truncation only)."""

    def decorate(fn: WeightFn) -> WeightFn:
        IS_CORRECTIONS.register(name)(ISCorrection(name=name, level=level, drops=drops, defaults=ISParams(**defaults), weights=fn))
        return fn

    return decorate


def _band(log_rho: torch.Tensor, params: ISParams) -> torch.Tensor:
    """lower <= rho <= upper, compared in log space (rho itself may overflow); lower 0 = no lower bound."""
    keep = torch.ones_like(log_rho, dtype=torch.bool)
    if params.lower:
        keep &= log_rho >= math.log(params.lower)
    if params.upper is not None:
        keep &= log_rho <= math.log(params.upper)
    return keep


def _ratio(log_rho: torch.Tensor) -> torch.Tensor:
    return log_rho.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def _truncated(log_rho, params):
    ratio = _ratio(log_rho)
    truncated = ratio >= params.cap
    return ratio.clamp(max=params.cap), torch.ones_like(truncated), truncated


def _masked(log_rho, params):
    keep = _band(log_rho, params)
    return torch.where(keep, _ratio(log_rho), 0.0), keep, torch.zeros_like(keep)


def _masked_truncated(log_rho, params):
    keep = _band(log_rho, params)
    ratio = _ratio(log_rho)
    truncated = keep & (ratio >= params.cap)
    return torch.where(keep, ratio.clamp(max=params.cap), 0.0), keep, truncated


register_is_correction("token", level="token", drops=False, cap=2.0)(_truncated)
register_is_correction("sequence", level="sequence", drops=False, cap=2.0)(_truncated)
register_is_correction("token_mask", level="token", lower=0.0, upper=2.0)(_masked)
register_is_correction("sequence_mask", level="sequence", lower=0.0, upper=2.0)(_masked)
register_is_correction("icepop", level="token", lower=0.5, upper=5.0)(_masked)
register_is_correction("sequence_mask_tis", level="sequence", lower=0.5, upper=2.0, cap=2.0)(_masked_truncated)


def get_is_correction(name: str) -> ISCorrection:
    """The registered correction; an unknown name raises ValueError listing the valid ones."""
    return IS_CORRECTIONS.get(name)


def is_correction_params(cfg: Any) -> ISParams:
    """The config's tis_cap / is_lower / is_upper where set, else the correction's defaults; checked."""
    entry = get_is_correction(cfg.tis_mode)
    given = ISParams(cap=cfg.tis_cap, lower=cfg.is_lower, upper=cfg.is_upper)
    d = entry.defaults if entry.defaults is not None else given  # None: a plug-in function, the numbers as given

    def pick(value, default):
        return default if value is None or default is None else float(value)

    params = ISParams(cap=pick(given.cap, d.cap), lower=pick(given.lower, d.lower), upper=pick(given.upper, d.upper))
    if params.cap is not None and not params.cap > 0:
        raise ValueError(f"algorithm.tis_cap={params.cap}: must be > 0 (tis_mode={cfg.tis_mode!r})")
    if params.upper is not None and not (params.upper > 0 and params.upper >= (params.lower or 0.0)):
        raise ValueError(
            f"algorithm.is_lower={params.lower}, algorithm.is_upper={params.upper}: need 0 <= lower <= upper, upper > 0 "
            f"(tis_mode={cfg.tis_mode!r})"
        )
    if params.lower is not None and params.lower < 0:
        raise ValueError(f"algorithm.is_lower={params.lower}: must be >= 0 (tis_mode={cfg.tis_mode!r})")
    return params


def _pair_valid(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return response_mask & finite(old_logprobs) & finite(rollout_logprobs)


def importance_weights(cfg: Any, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, valid: torch.Tensor) -> ISWeights:
    """The correction ``cfg.tis_mode`` on one microbatch ([B, T] inputs; no host synchronisation).

    ``valid`` [B, T] bool: the response tokens the ratios are taken over (finite
    old and rollout logprobs at least; the loss also leaves out its own non-finite
    tokens); elsewhere the log ratio is 0 and the token is not counted in its
    sequence's geometric mean.
    """
    entry = get_is_correction(cfg.tis_mode)
    params = is_correction_params(cfg)
    log_rho = torch.where(valid, old_logprobs.detach() - rollout_logprobs.detach(), 0.0)
    if entry.level == "sequence":
        counts = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(log_rho.dtype)
        log_rho = log_rho.sum(dim=-1, keepdim=True) / counts
    weight, keep, truncated = entry.weights(log_rho, params)
    return ISWeights(weight=weight, keep=keep.expand_as(valid) & valid, truncated=truncated)


def rejection_response_mask(cfg: Any, old_logprobs, rollout_logprobs, response_mask: torch.Tensor) -> torch.Tensor:
    """response_mask without the tokens the correction drops (what the step's denominators must count).

    Unchanged when ``cfg.tis_mode`` is 'none' or keeps every token. Tokens whose old
    or rollout logprob is not finite are left in (the loss counts them as it
    counts every non-finite token: see `losses`). The loss decides with the same
    ratios; only a non-finite *trainer* logprob inside a sequence (a diverged
    model, see `validation`) could move a sequence's geometric mean across a band edge.
    """
    if cfg.tis_mode == "none":
        return response_mask
    valid = _pair_valid(old_logprobs, rollout_logprobs, response_mask)
    weights = importance_weights(cfg, old_logprobs, rollout_logprobs, valid)
    return response_mask & (weights.keep | ~valid)


def importance_metrics(weights: ISWeights, old_logprobs, rollout_logprobs, valid: torch.Tensor) -> Metrics:
    """Per-step numbers of a correction (exact over microbatches and ranks).

    * ``is/weight``: mean weight over kept tokens; ``is/truncated``: fraction of kept tokens cut at the cap
    * ``is/masked_tokens``: fraction of response tokens dropped; ``is/masked_tokens/sum``: their count
    * ``is/masked_sequences``: fraction of sequences with every response token dropped
    * ``is/ratio`` (``/min``, ``/max``): token ratio pi_old / pi_rollout over response tokens
    * ``is/seq_ratio`` (``/min``, ``/max``): the sequences' geometric-mean ratios
    """
    keep = weights.keep
    num_valid, num_keep = valid.sum(), keep.sum()
    dropped = valid & ~keep
    has_tokens = valid.any(dim=-1)
    log_rho = torch.where(valid, old_logprobs.detach() - rollout_logprobs.detach(), 0.0)
    seq_log_rho = log_rho.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1).to(log_rho.dtype)
    ratio, seq_ratio = _ratio(log_rho), _ratio(seq_log_rho)
    weight_tokens = weights.weight.expand_as(valid)
    return {
        "is/weight": mean_metric(torch.where(keep, weight_tokens, 0.0), keep, num_keep),
        "is/truncated": fraction_metric((weights.truncated.expand_as(valid) & keep).sum(), num_keep),
        "is/masked_tokens": fraction_metric(dropped.sum(), num_valid),
        "is/masked_tokens/sum": dropped.sum().to(torch.float64),
        "is/masked_sequences": fraction_metric((has_tokens & ~keep.any(dim=-1)).sum(), has_tokens.sum()),
        "is/ratio": mean_metric(torch.where(valid, ratio, 0.0), valid, num_valid),
        "is/ratio/min": min_metric(ratio, valid),
        "is/ratio/max": max_metric(ratio, valid),
        "is/seq_ratio": mean_metric(torch.where(has_tokens, seq_ratio, 0.0), has_tokens),
        "is/seq_ratio/min": min_metric(seq_ratio, has_tokens),
        "is/seq_ratio/max": max_metric(seq_ratio, has_tokens),
    }


def rollout_mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
) -> Metrics:
    """How far the trainer's old logprobs are from the engine's, over finite response tokens.

    * ``mismatch/abs_logprob_diff``: token mean of |log pi_old - log pi_rollout|
    * ``mismatch/abs_logprob_diff/max``: its maximum
    * ``mismatch/kl_k3``: token mean of the k3 estimate of KL(pi_rollout || pi_old)
      (samples come from the engine): the engine-vs-trainer KL
    * ``mismatch/seq_kl_k3``: mean over sequences of the per-sequence KL (sum over its tokens)
    * ``mismatch/nonfinite_rollout_tokens/sum``: response tokens whose rollout logprob is NaN/inf
    """
    old = old_logprobs.detach()
    rollout = rollout_logprobs.detach()
    finite_rollout = finite(rollout)
    valid = response_mask & finite(old) & finite_rollout
    old = torch.where(valid, old, 0.0)
    rollout = torch.where(valid, rollout, 0.0)
    diff = (old - rollout).abs()
    kl_t = torch.where(valid, kl_penalty(rollout, old, "k3"), 0.0)
    has_tokens = (response_mask.sum(dim=-1) > 0)
    return {
        "mismatch/abs_logprob_diff": mean_metric(diff, valid),
        "mismatch/abs_logprob_diff/max": max_metric(diff, valid),
        "mismatch/kl_k3": mean_metric(kl_t, valid),
        "mismatch/seq_kl_k3": mean_metric(kl_t.sum(dim=-1), has_tokens),
        "mismatch/nonfinite_rollout_tokens/sum": (response_mask & ~finite_rollout).sum(dtype=torch.float64),
    }


__all__ = [
    "IS_CORRECTIONS",
    "ISCorrection",
    "ISParams",
    "ISWeights",
    "WeightFn",
    "as_is_correction",
    "get_is_correction",
    "importance_metrics",
    "importance_weights",
    "is_correction_params",
    "register_is_correction",
    "rejection_response_mask",
    "rollout_mismatch_metrics",
]
