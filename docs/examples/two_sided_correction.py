"""An importance-sampling correction (docs/extending.md):
"token_two_sided", each token's rho_t = pi_old / pi_rollout truncated on
both sides to [1 / C, C]; no token is dropped."""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms.importance import register_is_correction


@register_is_correction("token_two_sided", level="token", drops=False,
                        cap=2.0)
def two_sided(log_rho, params):
    """(weight, keep, truncated) for log_rho [B, T]; params.cap is C
    (algorithm.tis_cap)."""
    bound = math.log(params.cap)
    clipped = log_rho.clamp(-bound, bound)
    keep = torch.ones_like(log_rho, dtype=torch.bool)
    return clipped.exp(), keep, clipped != log_rho
