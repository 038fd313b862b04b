"""An importance-sampling correction (docs/extending.md): each token's
rho_t = pi_old / pi_rollout truncated on both sides to [1 / C, C]; no
token is dropped. With this folder on PYTHONPATH:
algorithm.tis_mode=two_sided_correction:TWO_SIDED"""

from __future__ import annotations

import math

import torch

from megatron_rl.algorithms import ISCorrection, ISParams


def two_sided(log_rho, params):
    """(weight, keep, truncated) for log_rho [B, T]; params.cap is C
    (algorithm.tis_cap)."""
    bound = math.log(params.cap)
    clipped = log_rho.clamp(-bound, bound)
    keep = torch.ones_like(log_rho, dtype=torch.bool)
    return clipped.exp(), keep, clipped != log_rho


TWO_SIDED = ISCorrection(name="token_two_sided", level="token",
                         drops=False, defaults=ISParams(cap=2.0),
                         weights=two_sided)
