"""Rollout-vs-trainer correction: truncated importance sampling (TIS) and mismatch metrics.

The engine that sampled the responses (vLLM: other kernels, precision, MoE
routing) assigns them logprobs that differ from the trainer's for the same
weights. The trainer's old policy pi_old is what the loss's ratio is taken
against, so the samples are off-policy by pi_old / pi_rollout. TIS (Yao, Liu et
al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training", the truncated importance-sampling estimator) multiplies each policy-gradient term by the truncated weight

    token:     w_t = min(pi_old(y_t) / pi_rollout(y_t), C)
    sequence:  w_i = min(exp((1/|y_i|) sum_t [log pi_old(y_t) - log pi_rollout(y_t)]), C)

The sequence weight is the geometric mean of the token ratios (as GSPO's s_i,
arXiv 2507.18071 Eq. 7): the plain product over thousands of tokens explodes
or vanishes. Weights are constants (no gradient).
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.kl import MAX_LOG_RATIO, kl_penalty
from megatron_rl.algorithms.metrics import Metrics, max_metric, mean_metric

TIS_MODES = ("none", "token", "sequence")


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    valid: torch.Tensor,
    sequence_lengths: torch.Tensor,
    mode: str,
    cap: float,
) -> torch.Tensor:
    """Detached TIS weights: [B, T] for mode 'token', [B, 1] for 'sequence' (1 where not valid).

    ``valid`` [B, T] bool marks finite response tokens; ``sequence_lengths`` [B]
    is |y_i| (at least 1). Inputs are sanitised here (invalid positions give log
    ratio 0), so NaN never reaches the exp.
    """
    if mode not in TIS_MODES or mode == "none":
        raise ValueError(f"algorithm.tis_mode={mode!r}: truncated importance sampling needs 'token' or 'sequence'")
    if not cap > 0:
        raise ValueError(f"algorithm.tis_cap={cap}: must be > 0")
    log_w = torch.where(valid, old_logprobs.detach() - rollout_logprobs.detach(), 0.0)
    if mode == "sequence":
        log_w = (log_w.sum(dim=-1, keepdim=True) / sequence_lengths.unsqueeze(-1))
    return log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp().clamp(max=cap)


def rollout_mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
) -> Metrics:
    """How far the trainer's old logprobs are from the engine's, over finite response tokens.

    * ``mismatch/abs_logprob_diff``: token mean of |log pi_old - log pi_rollout|
    * ``mismatch/abs_logprob_diff/max``: its maximum
    * ``mismatch/kl_k3``: token mean of the k3 estimate of KL(pi_rollout || pi_old)
      (samples come from the engine)
    * ``mismatch/seq_kl_k3``: mean over sequences of the per-sequence KL (sum over its tokens)
    * ``mismatch/nonfinite_rollout_tokens/sum``: response tokens whose rollout logprob is NaN/inf
    """
    old = old_logprobs.detach()
    rollout = rollout_logprobs.detach()
    finite_rollout = torch.isfinite(rollout)
    valid = response_mask & torch.isfinite(old) & finite_rollout
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


__all__ = ["TIS_MODES", "rollout_mismatch_metrics", "truncated_is_weights"]
