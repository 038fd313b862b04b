"""Policy losses, a registry by name (``POLICY_LOSSES``, config key ``algorithm.loss``; a user's function, of the
`PolicyLoss` call below, by import path: megatron_rl.plugins).

Every loss has one signature::

    loss_fn(logprobs, old_logprobs, advantages, response_mask, cfg, denom, *,
            ref_logprobs=None, rollout_logprobs=None, entropy=None) -> (loss_sum, metrics)

* ``logprobs [B, T]``: log pi_theta of each sampled token (with grad); one row per
  sequence, right-padded; ``old_logprobs``, ``ref_logprobs``, ``rollout_logprobs``
  and ``entropy`` have the same shape (old/ref/rollout are treated as constants).
* ``advantages [B]`` (``[B, T]`` also for gspo_token), ``response_mask [B, T] bool``.
* ``cfg``: anything with the fields of ``megatron_rl.config.AlgorithmConfig``.
* ``denom``: the step's `LossDenominators` (see `normalization`).
* ``loss_sum``: this microbatch's share of the whole-batch loss, already divided by
  the global denominator: the sum over all microbatches and ranks is the
  whole-batch loss (see `normalization` for what the caller does with it).
* ``metrics``: detached tensors reduced by `metrics.merge_metrics` /
  `all_reduce_metrics` / `finalize_metrics`.

Notation: d_t = log pi_theta(y_t) - log pi_old(y_t), w_t = exp(d_t) (token
ratio), A advantage, |y_i| response tokens of sequence i, N_tok / N_seq the
step's global token / sequence counts. Per element (token or sequence) the
clipped surrogate (PPO, Schulman et al. 2017, arXiv 1707.06347, Eq. 7) is

    l(w, A) = -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A)

with the decoupled range of DAPO (Clip-Higher, arXiv 2503.14476 Sec. 3.1) and,
when ``dual_clip_c`` = c > 1, the dual clip (Ye et al. 2020, arXiv 1912.09729,
Sec. 3, dual-clip PPO) l = min(l, -c A) for A < 0.

Options shared by all losses:
* ``beta > 0``: + beta * KL_t (estimator ``kl_estimator``, `kl`), aggregated like the
  policy term (DeepSeekMath Eq. 3). beta = 0 ignores ``ref_logprobs``
  (only a metric is computed if they are passed).
* ``entropy_coeff > 0``: - entropy_coeff * H_t (the entropy of pi_theta at each
  position, passed with grad as ``entropy``), aggregated like the policy term.
* ``tis_mode``: an importance-sampling correction against ``rollout_logprobs``
  (`importance.IS_CORRECTIONS`: truncated, masked, IcePop, ...): the policy term
  is multiplied by its detached weight, and the tokens (or sequences) it drops
  leave the loss like non-finite tokens do, except that they must also leave
  the step's denominators (the caller builds them from
  `importance.rejection_response_mask`). Metrics ``is/...``.

Clip range defaults (``eps_low``/``eps_high`` None in the config): the papers'
values, `DEFAULT_CLIP_RANGE`.

Non-finite inputs: a response token whose logprobs (or old, or the ref/rollout
logprobs or entropy the options use) are NaN or +-inf is dropped from its
sequence: it adds nothing to the loss, is left out of |y_i| and of GSPO's
geometric mean, and gets exactly zero gradient (inputs are replaced before any
exp, so no inf x 0 = NaN reaches backward). It still counts in the step's
global denominators, which were fixed before the forward (changing them would
take another all-reduce). The metric ``nonfinite_tokens/sum`` counts them.
A batch in which *every* response token is non-finite is an error, raised by
`validation.check_finite_logprobs`, a host-side check the caller runs outside
the loss (the loss itself never synchronises with the host). A microbatch with
no response tokens gives loss 0 (still attached to the graph) and zero gradient.

Log ratios are clamped to [-20, 20] before exp (`kl.MAX_LOG_RATIO`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from megatron_rl.algorithms._finite import finite
from megatron_rl.algorithms._registry import Registry
from megatron_rl.algorithms.importance import get_is_correction, importance_metrics, importance_weights, rollout_mismatch_metrics
from megatron_rl.algorithms.kl import MAX_LOG_RATIO, kl_estimate
from megatron_rl.algorithms.metrics import Metrics, fraction_metric, max_metric, mean_metric, min_metric, sum_metric
from megatron_rl.algorithms.normalization import LossDenominators, context_parallel_row_sum, count_once, require_whole_sequences


class PolicyLoss(Protocol):
    """The call every policy loss takes (the actor's, actor.step.policy_loss); see the module docstring."""

    def __call__(self, logprobs, old_logprobs, advantages, response_mask, cfg, denom, *, ref_logprobs,
                 rollout_logprobs, entropy) -> tuple[torch.Tensor, Metrics]: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "algorithm.loss", PolicyLoss)

DEFAULT_CLIP_RANGE: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),  # DeepSeekMath / PPO epsilon
    "dr_grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),  # DAPO Sec. 3.1 (Clip-Higher)
    "gspo": (3e-4, 4e-4),  # GSPO Sec. 5.1
    "gspo_token": (3e-4, 4e-4),
}
"""(eps_low, eps_high) used when the config leaves them None."""

SEQUENCE_LEVEL_LOSSES = frozenset({"grpo", "gspo", "gspo_token"})
"""Losses that need each sequence whole in one row (see `normalization`)."""


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered loss function; an unknown name raises ValueError listing the valid ones."""
    return POLICY_LOSSES.get(name)


def clip_range(cfg: Any, loss_name: str) -> tuple[float, float]:
    """(eps_low, eps_high): the config's values, or the loss's paper default where None."""
    default_low, default_high = DEFAULT_CLIP_RANGE[loss_name]
    eps_low = cfg.eps_low if cfg.eps_low is not None else default_low
    eps_high = cfg.eps_high if cfg.eps_high is not None else default_high
    return eps_low, eps_high


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, dual_clip_c: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """l = -min(w A, clip(w, 1-eps_low, 1+eps_high) A), dual-clipped to min(l, -c A) for A < 0 when c > 0.

    Returns (l, clipped_low, clipped_high, clipped_dual): the masks say where the
    clipped branch is active (and the gradient is zero): A < 0 and w < 1 - eps_low;
    A > 0 and w > 1 + eps_high; A < 0 and the dual bound -c A is active.
    """
    neg_advantages = -advantages
    unclipped = neg_advantages * ratio
    clipped = neg_advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    negative = advantages < 0
    clipped_low = negative & (ratio < 1.0 - eps_low)
    clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
    clipped_dual = None
    if dual_clip_c > 0:
        bound = neg_advantages * dual_clip_c
        clipped_dual = negative & (loss > bound)
        loss = torch.where(clipped_dual, bound, loss)
    return loss, clipped_low, clipped_high, clipped_dual


class _ClippedSurrogateFromLogRatio(torch.autograd.Function):
    """`clipped_surrogate` of w = exp(d), with the gradient in closed form (one saved tensor).

    dl/dd = -A w where no clip is active and 0 where one is (each clipped branch is
    constant in w; inside the range both branches are -A w). This is exactly the
    gradient torch.maximum + clamp give (their tie at w inside the range splits the
    gradient in halves that add up), but backward keeps one [B, T] tensor instead of
    five, and runs one multiply. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, log_ratio, advantages, eps_low, eps_high, dual_clip_c):
        ratio = log_ratio.exp()
        neg_advantages = -advantages
        unclipped = neg_advantages * ratio
        # In place where nothing else reads the tensor (no autograd inside forward): fewer [B, T] temporaries.
        loss = neg_advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
        loss = torch.maximum(loss, unclipped, out=loss) if loss.shape == unclipped.shape else torch.maximum(loss, unclipped)
        negative = advantages < 0
        clipped_low = negative & (ratio < 1.0 - eps_low)
        clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
        no_gradient = clipped_low | clipped_high
        clipped_dual = torch.zeros_like(no_gradient)
        if dual_clip_c > 0:
            bound = neg_advantages * dual_clip_c
            clipped_dual = negative & (loss > bound)
            loss = torch.where(clipped_dual, bound, loss)
            no_gradient |= clipped_dual
        ctx.save_for_backward(unclipped.masked_fill_(no_gradient, 0.0))  # dl/dd = -A w where no clip is active
        ctx.mark_non_differentiable(ratio, clipped_low, clipped_high, clipped_dual)
        return loss, ratio, clipped_low, clipped_high, clipped_dual

    @staticmethod
    def backward(ctx, grad_loss, _ratio, _low, _high, _dual):
        (dloss_dlog_ratio,) = ctx.saved_tensors
        return grad_loss * dloss_dlog_ratio, None, None, None, None


def clipped_surrogate_from_log_ratio(
    log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, dual_clip_c: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(l, w, clipped_low, clipped_high, clipped_dual) of `clipped_surrogate` at w = exp(log_ratio).

    Same values and gradient as ``clipped_surrogate(log_ratio.exp(), ...)`` with far
    less kept for backward; ``log_ratio`` must be finite (sanitised) and ``advantages``
    constant. ``w`` and the masks carry no gradient.
    """
    loss, ratio, low, high, dual = _ClippedSurrogateFromLogRatio.apply(log_ratio, advantages, eps_low, eps_high, dual_clip_c)
    return loss, ratio, low, high, (dual if dual_clip_c > 0 else None)


class _SanitisedLogRatio(torch.autograd.Function):
    """d = where(valid, logprobs - old, 0) clamped to [-20, 20], and valid = mask & finite(logprobs - old) & extra.

    Backward passes the gradient where valid and not clamped, and exactly 0
    elsewhere (never NaN: nothing non-finite is multiplied); it keeps one bool mask.
    """

    @staticmethod
    def forward(ctx, logprobs, old_logprobs, response_mask, extra_valid):
        diff = logprobs - old_logprobs  # non-finite iff either is
        valid = response_mask & finite(diff)
        if extra_valid is not None:
            valid &= extra_valid
        log_ratio = torch.where(valid, diff, 0.0)
        passes = valid & (log_ratio.abs() <= MAX_LOG_RATIO)
        log_ratio.clamp_(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        ctx.save_for_backward(passes)
        ctx.mark_non_differentiable(valid)
        return log_ratio, valid

    @staticmethod
    def backward(ctx, grad_log_ratio, _valid):
        (passes,) = ctx.saved_tensors
        return grad_log_ratio * passes, None, None, None


# ----------------------------------------------------------------------------------------------
# Shared preparation: checks, sanitising, per-sequence lengths, option terms.


@dataclass
class _SanitisedMicrobatch:
    """Sanitised inputs of one microbatch: every tensor finite, every per-token term 0 where not valid."""

    valid: torch.Tensor  # [B, T] bool: response token with finite inputs
    valid_weight: torch.Tensor  # [B, T] valid as 0.0/1.0 in the logprobs' dtype (one conversion, reused by multiplies)
    num_valid: torch.Tensor  # scalar float64: valid.sum()
    log_ratio: torch.Tensor  # [B, T] d_t = log pi_theta - sg[log pi_old], 0 where not valid, clamped
    token_advantages: torch.Tensor  # [B, 1] (per sequence) or [B, T] (0 where not valid); finite
    sequence_advantages: torch.Tensor  # [B], 0 for rows without valid tokens
    lengths: torch.Tensor  # [B] |y_i| = valid tokens of the row, at least 1 (for division)
    has_tokens: torch.Tensor  # [B] bool: the row has valid response tokens
    row_tokens: torch.Tensor  # [B] int64 valid tokens per row
    is_weight: torch.Tensor | None  # [B, T] or [B, 1] importance-sampling weight, detached (0 where dropped)
    kl: torch.Tensor | None  # [B, T] KL estimate (with grad when beta > 0), 0 where not valid
    entropy: torch.Tensor | None  # [B, T] entropy (with grad), 0 where not valid; None unless entropy_coeff > 0
    metrics: Metrics


def _check_shapes(name, logprobs, old_logprobs, advantages, response_mask, extras, token_advantages: bool) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"{name}: logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if not logprobs.dtype.is_floating_point:
        raise ValueError(f"{name}: logprobs must be floating point, got {logprobs.dtype}")
    if response_mask.dtype != torch.bool:
        raise ValueError(f"{name}: response_mask must be bool (pass mask.bool()), got {response_mask.dtype}")
    shape = tuple(logprobs.shape)
    for arg, tensor in (("old_logprobs", old_logprobs), ("response_mask", response_mask), *extras.items()):
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: {arg} has shape {tuple(tensor.shape)}, logprobs has {shape}")
    allowed = [shape[:1]] + ([shape] if token_advantages else [])
    if tuple(advantages.shape) not in allowed:
        want = "[B] or [B, T]" if token_advantages else "[B] (one per sequence)"
        raise ValueError(f"{name}: advantages must be {want} for logprobs {shape}, got {tuple(advantages.shape)}")


def _check_options(name, cfg, denom, ref_logprobs, rollout_logprobs, entropy) -> None:
    if not isinstance(denom, LossDenominators):
        raise TypeError(f"{name}: denom must be a LossDenominators (compute_loss_denominators), got {type(denom).__name__}")
    if name in SEQUENCE_LEVEL_LOSSES:
        require_whole_sequences(denom, name)
    if cfg.beta > 0 and ref_logprobs is None:
        raise ValueError(
            f"{name}: algorithm.beta={cfg.beta} needs ref_logprobs (or set algorithm.beta=0 to train without a reference model)"
        )
    if cfg.entropy_coeff and entropy is None:
        raise ValueError(f"{name}: algorithm.entropy_coeff={cfg.entropy_coeff} needs the per-token entropy (entropy=...)")
    if cfg.tis_mode != "none":
        if rollout_logprobs is None:
            raise ValueError(f"{name}: algorithm.tis_mode={cfg.tis_mode!r} needs rollout_logprobs from the rollout engine")


def _prepare(name, logprobs, old_logprobs, advantages, response_mask, cfg, denom, ref_logprobs, rollout_logprobs, entropy,
             *, token_advantages: bool = False) -> _SanitisedMicrobatch:
    """Check, sanitise and compute everything the losses share (no host synchronisation).

    1. valid = response token whose logprob, old logprob (and the ref/rollout/entropy
       the options use) are finite;
    2. d_t = where(valid, logprobs - old, 0), clamped (`_SanitisedLogRatio`): no gradient
       reaches the replaced entries and every later value is finite, so no inf x 0 = NaN
       forms in backward;
    3. per-row lengths, sanitised advantages, option tensors (TIS weights, KL, entropy), metrics.
    """
    _check_shapes(name, logprobs, old_logprobs, advantages, response_mask,
                  {"ref_logprobs": ref_logprobs, "rollout_logprobs": rollout_logprobs, "entropy": entropy}, token_advantages)
    _check_options(name, cfg, denom, ref_logprobs, rollout_logprobs, entropy)
    old = old_logprobs.detach().to(logprobs.dtype)
    extra_valid = None
    for used, tensor in ((cfg.beta > 0, ref_logprobs), (cfg.tis_mode != "none", rollout_logprobs), (bool(cfg.entropy_coeff), entropy)):
        if used:
            tensor_finite = finite(tensor)
            extra_valid = tensor_finite if extra_valid is None else extra_valid & tensor_finite
    is_weights = num_finite = None
    if cfg.tis_mode != "none":
        # Ratios over the tokens with finite inputs; the correction's drops then leave `valid` as well.
        finite_valid = response_mask & finite(logprobs.detach() - old) & extra_valid
        is_weights = importance_weights(cfg, old, rollout_logprobs.detach().to(logprobs.dtype), finite_valid)
        num_finite = finite_valid.sum(dtype=torch.float64)
        extra_valid = extra_valid & is_weights.keep
    log_ratio, valid = _SanitisedLogRatio.apply(logprobs, old, response_mask, extra_valid)
    num_valid = valid.sum(dtype=torch.float64)  # float64: every count and mean metric takes it as is
    valid_weight = valid.to(logprobs.dtype)
    row_tokens = valid.sum(dim=-1)
    # |y_i| over the whole sequence: under context parallelism a row holds a part of its tokens.
    sequence_tokens = context_parallel_row_sum(valid.to(torch.int64), denom)
    has_tokens = sequence_tokens > 0
    lengths = sequence_tokens.clamp(min=1).to(logprobs.dtype)
    advantages = advantages.detach().to(logprobs.dtype)
    if advantages.dim() == 1:
        sequence_advantages = torch.where(has_tokens, advantages, 0.0)
        token_adv = sequence_advantages.unsqueeze(-1)  # [B, 1]: broadcast, no [B, T] copy
    else:
        sequence_advantages = torch.zeros_like(lengths)  # unused: only gspo_token takes [B, T]
        token_adv = torch.where(valid, advantages, 0.0)

    metrics: Metrics = {
        "tokens/sum": num_valid,
        "nonfinite_tokens/sum": response_mask.sum(dtype=torch.float64) - (num_valid if num_finite is None else num_finite),
        "sequences/sum": count_once(has_tokens.sum(dtype=torch.float64), denom),
    }
    is_weight = None
    if is_weights is not None:
        is_weight = is_weights.weight
        metrics.update(importance_metrics(is_weights, old, rollout_logprobs.detach().to(logprobs.dtype), finite_valid))
    if rollout_logprobs is not None:
        metrics.update(rollout_mismatch_metrics(old, rollout_logprobs, response_mask))
    kl = None
    if cfg.beta > 0:
        # log r = log pi_ref - log pi_theta, 0 where not valid (every KL estimator is 0 at log r = 0).
        kl = kl_estimate(torch.where(valid, ref_logprobs.detach() - logprobs, 0.0), cfg.kl_estimator)
        metrics["kl"] = mean_metric(kl, valid_weight, num_valid)
    elif ref_logprobs is not None:  # metric only
        ref_valid = valid & finite(ref_logprobs)
        log_r = torch.where(ref_valid, ref_logprobs.detach() - logprobs.detach(), 0.0)
        metrics["kl"] = mean_metric(kl_estimate(log_r, cfg.kl_estimator), ref_valid)
    entropy_s = None
    if cfg.entropy_coeff:
        entropy_s = torch.where(valid, entropy, 0.0)
        metrics["entropy"] = mean_metric(entropy_s, valid_weight, num_valid)
    elif entropy is not None:  # metric only
        entropy_valid = valid & finite(entropy)
        metrics["entropy"] = mean_metric(torch.where(entropy_valid, entropy.detach(), 0.0), entropy_valid)
    return _SanitisedMicrobatch(valid, valid_weight, num_valid, log_ratio, token_adv, sequence_advantages, lengths, has_tokens, row_tokens, is_weight,
                  kl, entropy_s, metrics)


Aggregate = Callable[[torch.Tensor, _SanitisedMicrobatch, LossDenominators], torch.Tensor]


def _token_mean(terms: torch.Tensor, b: _SanitisedMicrobatch, denom: LossDenominators) -> torch.Tensor:
    """sum_{i,t} x_it / N_tok (DAPO Eq. 8: the mean over every response token of the step)."""
    return terms.sum() / denom.tokens


def _sequence_mean_token_mean(terms: torch.Tensor, b: _SanitisedMicrobatch, denom: LossDenominators) -> torch.Tensor:
    """sum_i (1/|y_i|) sum_t x_it / N_seq (DeepSeekMath Eq. 3: sample-level mean)."""
    return (terms.sum(dim=-1) / b.lengths).sum() / denom.sequences


def _constant_denominator(terms: torch.Tensor, b: _SanitisedMicrobatch, denom: LossDenominators) -> torch.Tensor:
    """sum_{i,t} x_it / (N_seq * MAX_TOKENS) (Dr. GRPO, arXiv 2503.20783 Sec. 3: no 1/|y_i| length bias)."""
    if denom.max_response_tokens < 1:
        raise ValueError(
            "dr_grpo divides by global_num_sequences x max_response_tokens, but denom.max_response_tokens=0: "
            "pass max_response_tokens (algorithm.max_response_tokens, or rollout.max_new_tokens when that is 0) "
            "to compute_loss_denominators"
        )
    return terms.sum() / (denom.sequences * denom.max_response_tokens)


def _option_terms(b: _SanitisedMicrobatch, cfg: Any, aggregate: Aggregate, denom: LossDenominators) -> tuple[torch.Tensor | None, Metrics]:
    """beta * agg(KL) - entropy_coeff * agg(H), or None when both are off (terms are 0 where not valid)."""
    total = None
    metrics: Metrics = {}
    if b.kl is not None:
        kl_loss = cfg.beta * aggregate(b.kl, b, denom)
        metrics["kl_loss/sum"] = sum_metric(kl_loss)
        total = kl_loss
    if b.entropy is not None:
        bonus = cfg.entropy_coeff * aggregate(b.entropy, b, denom)
        metrics["entropy_bonus/sum"] = sum_metric(bonus)
        total = -bonus if total is None else total - bonus
    return total, metrics


def _clip_metrics(b: _SanitisedMicrobatch, low: torch.Tensor, high: torch.Tensor, dual: torch.Tensor | None) -> Metrics:
    """Token-weighted fractions of valid response tokens whose objective is clipped.

    Per-token flags ([B, T]) count where valid; per-sequence flags ([B], GSPO)
    count every valid token of the sequence.
    """
    def hits(flags: torch.Tensor) -> torch.Tensor:
        return (flags & b.valid).sum(dtype=torch.float64) if flags.dim() == 2 else (flags * b.row_tokens).sum(dtype=torch.float64)

    metrics = {"clipfrac_low": fraction_metric(hits(low), b.num_valid), "clipfrac_high": fraction_metric(hits(high), b.num_valid)}
    if dual is not None:
        metrics["clipfrac_dual"] = fraction_metric(hits(dual), b.num_valid)
    return metrics


def _ratio_metrics(ratio: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor | None = None,
                   count: torch.Tensor | None = None) -> Metrics:
    return {
        "ratio": mean_metric(ratio, mask if weight is None else weight, count),
        "ratio/min": min_metric(ratio, mask),
        "ratio/max": max_metric(ratio, mask),
    }


def _finish(b: _SanitisedMicrobatch, pg_loss: torch.Tensor, extra: torch.Tensor | None, metrics: Metrics) -> tuple[torch.Tensor, Metrics]:
    loss = pg_loss if extra is None else pg_loss + extra
    out = dict(b.metrics)
    out.update(metrics)
    out["pg_loss/sum"] = sum_metric(pg_loss)
    out["loss/sum"] = sum_metric(loss)
    return loss, out


# ----------------------------------------------------------------------------------------------
# Token-ratio losses: grpo, dapo, dr_grpo differ only in the clip range default and the aggregation.


def _token_ratio_loss(name: str, aggregate: Aggregate, logprobs, old_logprobs, advantages, response_mask, cfg, denom,
                      ref_logprobs, rollout_logprobs, entropy) -> tuple[torch.Tensor, Metrics]:
    b = _prepare(name, logprobs, old_logprobs, advantages, response_mask, cfg, denom, ref_logprobs, rollout_logprobs, entropy)
    eps_low, eps_high = clip_range(cfg, name)
    # w_t = exp(log pi_theta - sg[log pi_old]): 1 when pi_theta = pi_old, yet its gradient is w_t grad log pi_theta.
    pg, ratio, low, high, dual = clipped_surrogate_from_log_ratio(b.log_ratio, b.token_advantages, eps_low, eps_high, cfg.dual_clip_c)
    # Every factor is finite, so masking is a multiply (where() is slower and keeps more for backward).
    pg = pg * (b.valid_weight if b.is_weight is None else b.is_weight * b.valid_weight)
    pg_loss = aggregate(pg, b, denom)
    extra, option_metrics = _option_terms(b, cfg, aggregate, denom)
    metrics = {**_ratio_metrics(ratio, b.valid, b.valid_weight, b.num_valid), **_clip_metrics(b, low, high, dual), **option_metrics}
    return _finish(b, pg_loss, extra, metrics)


@POLICY_LOSSES.register("grpo")
def grpo_loss(logprobs, old_logprobs, advantages, response_mask, cfg, denom, *,
              ref_logprobs=None, rollout_logprobs=None, entropy=None) -> tuple[torch.Tensor, Metrics]:
    """GRPO (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300, Eq. 3), sample-level mean:

        L = (1/N_seq) sum_i (1/|y_i|) sum_t [ l(w_it, A_i) + beta KL_it ]

    Default clip range 0.2 / 0.2. Sequence-level: each row must hold a whole sequence.
    """
    return _token_ratio_loss("grpo", _sequence_mean_token_mean, logprobs, old_logprobs, advantages, response_mask, cfg,
                             denom, ref_logprobs, rollout_logprobs, entropy)


@POLICY_LOSSES.register("dapo")
def dapo_loss(logprobs, old_logprobs, advantages, response_mask, cfg, denom, *,
              ref_logprobs=None, rollout_logprobs=None, entropy=None) -> tuple[torch.Tensor, Metrics]:
    """DAPO (Yu et al. 2025, arXiv 2503.14476, Eq. 8; token-level loss Sec. 3.3):

        L = (1/N_tok) sum_{i,t} l(w_it, A_i),   clip(w, 1 - eps_low, 1 + eps_high)

    N_tok counts every response token of the optimizer step (all groups, ranks and
    microbatches). Default clip range 0.2 / 0.28 (Clip-Higher); DAPO uses no KL
    (beta 0), which the options still allow.
    """
    return _token_ratio_loss("dapo", _token_mean, logprobs, old_logprobs, advantages, response_mask, cfg, denom,
                             ref_logprobs, rollout_logprobs, entropy)


@POLICY_LOSSES.register("dr_grpo")
def dr_grpo_loss(logprobs, old_logprobs, advantages, response_mask, cfg, denom, *,
                 ref_logprobs=None, rollout_logprobs=None, entropy=None) -> tuple[torch.Tensor, Metrics]:
    """Dr. GRPO (Liu et al. 2025, arXiv 2503.20783, Sec. 3), constant normaliser:

        L = (1/(N_seq * MAX_TOKENS)) sum_{i,t} l(w_it, A_i)

    MAX_TOKENS = denom.max_response_tokens (the generation limit), which removes
    GRPO's 1/|y_i| response-length bias; pair it with the ``dr_grpo`` advantages
    (no std). Default clip range 0.2 / 0.2.
    """
    return _token_ratio_loss("dr_grpo", _constant_denominator, logprobs, old_logprobs, advantages, response_mask, cfg,
                             denom, ref_logprobs, rollout_logprobs, entropy)


# ----------------------------------------------------------------------------------------------
# Sequence-ratio losses: gspo, gspo_token.


def _sequence_log_ratio(b: _SanitisedMicrobatch, denom: LossDenominators) -> torch.Tensor:
    """log s_i = (1/|y_i|) sum_t d_it  [B] (GSPO Eq. 7: s_i is the geometric mean of the token ratios),
    the sum over the whole sequence (all its CP ranks' tokens)."""
    return (context_parallel_row_sum(b.log_ratio, denom) / b.lengths).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


@POLICY_LOSSES.register("gspo")
def gspo_loss(logprobs, old_logprobs, advantages, response_mask, cfg, denom, *,
              ref_logprobs=None, rollout_logprobs=None, entropy=None) -> tuple[torch.Tensor, Metrics]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071, Eqs. 5 and 7), sequence-level ratio and clip:

        s_i = exp((1/|y_i|) sum_t [log pi_theta(y_it) - log pi_old(y_it)])
        L   = (1/N_seq) sum_i l(s_i, A_i)      (+ beta KL, - entropy bonus as sequence means of token means)

    Default clip range 3e-4 / 4e-4 (GSPO Sec. 5.1). Each row must hold a whole
    sequence. A sequence-level IS correction multiplies the sequence's term. A
    token-level one (the decoupled objective of AReaL, Fu et al. 2025, arXiv
    2505.24298, Sec. 5.2: each token's behaviour weight pi_old / pi_rollout on its
    own gradient term, the clip around pi_old) is applied in GSPO's token form,
    `gspo_token_loss`, whose value and gradient equal GSPO's when every weight is 1:
    the gradient is then A_i s_i (1/|y_i|) sum_t w_t grad log pi_theta(y_it).
    """
    if cfg.tis_mode != "none" and get_is_correction(cfg.tis_mode).level == "token":
        return gspo_token_loss(logprobs, old_logprobs, advantages, response_mask, cfg, denom,
                               ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs, entropy=entropy)
    b = _prepare("gspo", logprobs, old_logprobs, advantages, response_mask, cfg, denom, ref_logprobs, rollout_logprobs, entropy)
    eps_low, eps_high = clip_range(cfg, "gspo")
    # A_i is 0 for rows without valid tokens, so their term is 0.
    pg, seq_ratio, low, high, dual = clipped_surrogate_from_log_ratio(
        _sequence_log_ratio(b, denom), b.sequence_advantages, eps_low, eps_high, cfg.dual_clip_c
    )
    if b.is_weight is not None:
        pg = pg * b.is_weight.squeeze(-1)
    pg_loss = count_once(pg, denom).sum() / denom.sequences
    extra, option_metrics = _option_terms(b, cfg, _sequence_mean_token_mean, denom)
    metrics = {
        **_ratio_metrics(seq_ratio, b.has_tokens),
        **_clip_metrics(b, low, high, dual),
        **option_metrics,
    }
    return _finish(b, pg_loss, extra, metrics)


@POLICY_LOSSES.register("gspo_token")
def gspo_token_loss(logprobs, old_logprobs, advantages, response_mask, cfg, denom, *,
                    ref_logprobs=None, rollout_logprobs=None, entropy=None) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token (arXiv 2507.18071 Sec. 4.3, its objective and s_i,t), per-token advantages allowed:

        s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]      (value s_i, gradient s_i grad log pi_theta(y_it))
        L    = (1/N_seq) sum_i (1/|y_i|) sum_t l(s_it, A_it)

    With A_it = A_i its gradient equals GSPO's. ``advantages`` [B] or [B, T].
    Default clip range 3e-4 / 4e-4. Each row must hold a whole sequence.
    """
    b = _prepare("gspo_token", logprobs, old_logprobs, advantages, response_mask, cfg, denom, ref_logprobs,
                 rollout_logprobs, entropy, token_advantages=True)
    eps_low, eps_high = clip_range(cfg, "gspo_token")
    seq_log_ratio = _sequence_log_ratio(b, denom)
    # log s_it = sg[log s_i] + log pi_theta - sg[log pi_theta]; d_t - sg[d_t] has value 0 exactly and the
    # gradient of log pi_theta (0 where not valid), so s_it has the value s_i.
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + (b.log_ratio - b.log_ratio.detach())
    pg, _, low, high, dual = clipped_surrogate_from_log_ratio(token_log_ratio, b.token_advantages, eps_low, eps_high, cfg.dual_clip_c)
    pg = pg * (b.valid_weight if b.is_weight is None else b.is_weight * b.valid_weight)
    pg_loss = _sequence_mean_token_mean(pg, b, denom)
    extra, option_metrics = _option_terms(b, cfg, _sequence_mean_token_mean, denom)
    metrics = {
        **_ratio_metrics(seq_log_ratio.exp(), b.has_tokens),
        **_clip_metrics(b, low, high, dual),
        **option_metrics,
    }
    return _finish(b, pg_loss, extra, metrics)


def compute_policy_loss(logprobs, old_logprobs, advantages, response_mask, cfg, denom, **options) -> tuple[torch.Tensor, Metrics]:
    """The loss named by ``cfg.loss``."""
    return get_policy_loss(cfg.loss)(logprobs, old_logprobs, advantages, response_mask, cfg, denom, **options)


__all__ = [
    "DEFAULT_CLIP_RANGE",
    "POLICY_LOSSES",
    "SEQUENCE_LEVEL_LOSSES",
    "clip_range",
    "clipped_surrogate",
    "clipped_surrogate_from_log_ratio",
    "compute_policy_loss",
    "dapo_loss",
    "dr_grpo_loss",
    "get_policy_loss",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
]
