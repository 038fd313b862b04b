"""Per-token estimators of KL(pi_theta || pi_ref) from samples of the policy (Schulman 2020,
"Approximating KL Divergence", http://joschu.net/blog/kl-approx.html).

With r = pi_ref(y_t) / pi_theta(y_t), i.e. log r = ref_logprobs - logprobs:

* k1 = -log r                   unbiased, can be negative, high variance
* k2 = (log r)^2 / 2            biased, non-negative, low variance
* k3 = (r - 1) - log r          unbiased, non-negative, low variance; the
                                estimator of GRPO's KL term (DeepSeekMath Eq. 4)

GRPO adds beta * KL_t to each token's loss (DeepSeekMath Eq. 3).
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_rl.algorithms._registry import Registry

MAX_LOG_RATIO = 20.0
"""Log ratios are clamped to [-20, 20] before exp (exp(20) = 4.9e8): a guard against overflow to inf
(and inf x 0 = NaN in masked sums). It changes no value in ordinary training."""

KL_ESTIMATORS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("KL estimator", "algorithm.kl_estimator")


@KL_ESTIMATORS.register("k1")
def _k1(log_r: torch.Tensor) -> torch.Tensor:
    return -log_r


@KL_ESTIMATORS.register("k2")
def _k2(log_r: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_r * log_r


@KL_ESTIMATORS.register("k3")
def _k3(log_r: torch.Tensor) -> torch.Tensor:
    # expm1 keeps r - 1 accurate for r near 1.
    return torch.expm1(log_r) - log_r


def kl_estimate(log_r: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate from log r = log pi_ref - log pi_theta (must be finite; clamped to +-20 first)."""
    return KL_ESTIMATORS.get(estimator)(log_r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate [B, T] of the policy to the reference (inputs must be finite).

    Differentiable w.r.t. ``logprobs``; ``ref_logprobs`` is treated as a constant.
    """
    return kl_estimate(ref_logprobs.detach() - logprobs, estimator)


__all__ = ["KL_ESTIMATORS", "MAX_LOG_RATIO", "kl_estimate", "kl_penalty"]
