"""Configuration of the policy-optimisation algorithm (advantages, loss, data-side filters).

The pure-torch package megatron_rl.algorithms reads these fields by name and
does not import this module (it imports nothing of the project).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config.core import ConfigError


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantage estimator, policy loss and their options (see notes in megatron_rl/algorithms)."""

    loss: str = "gspo"
    """Policy loss, by registered name: gspo, gspo_token, dapo, dr_grpo, grpo."""
    advantage: str = "grpo"
    """Advantage estimator, by registered name: grpo, dr_grpo, rloo."""
    std_type: Literal["population", "sample"] = "sample"
    """Std used by GRPO advantages: population (divide by G) or sample (divide by G-1)."""
    adv_eps: float = 1.0e-6
    """Added to the std in GRPO advantages."""
    eps_low: float = 3.0e-4
    """Lower clip range: ratios below 1 - eps_low are clipped."""
    eps_high: float = 4.0e-4
    """Upper clip range (clip-higher): ratios above 1 + eps_high are clipped."""
    dual_clip_c: float = 0.0
    """Dual-clip constant c (> 1) bounding the loss for negative advantages; 0 disables it."""
    beta: float = 0.0
    """KL coefficient to the reference policy; 0 skips the reference model entirely."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1/k2/k3; k3 is unbiased and non-negative)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (the loss subtracts coeff x mean entropy)."""
    max_response_tokens: int = 0
    """Dr. GRPO's constant MAX_TOKENS; 0 = rollout.max_new_tokens."""
    tis_mode: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling against the rollout engine's logprobs."""
    tis_cap: float = 2.0
    """Cap C of the truncated importance weight min(pi_old / pi_rollout, C)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and generate more until the batch is full (DAPO)."""
    max_num_gen_batches: int = 10
    """Generation batches tried per step by dynamic sampling before giving up."""
    overlong_filter: bool = False
    """Mask out responses cut at the length limit (no EOS) (DAPO)."""
    overlong_buffer: int = 0
    """L_cache of DAPO's soft overlong punishment in tokens; 0 disables it."""
    overlong_penalty: float = 1.0
    """Scale of the soft overlong punishment (the paper's is 1)."""
    routing_replay: Literal["none", "R2", "R3"] = "none"
    """MoE routing replay: R2 from the old-policy forward, R3 from the rollout engine."""

    def validate(self) -> None:
        if self.eps_low < 0 or self.eps_high < 0:
            raise ConfigError(f"algorithm.eps_low={self.eps_low}, algorithm.eps_high={self.eps_high}: clip ranges must be >= 0")
        if self.eps_low >= 1:
            raise ConfigError(f"algorithm.eps_low={self.eps_low}: must be < 1 (the lower clip bound is 1 - eps_low)")
        if self.dual_clip_c and self.dual_clip_c <= 1:
            raise ConfigError(f"algorithm.dual_clip_c={self.dual_clip_c}: must be > 1 (about 3), or 0 to disable")
        if self.beta < 0:
            raise ConfigError(f"algorithm.beta={self.beta}: must be >= 0")
        if self.tis_mode != "none" and self.tis_cap <= 0:
            raise ConfigError(f"algorithm.tis_cap={self.tis_cap}: must be > 0 when tis_mode={self.tis_mode!r}")
        if self.max_num_gen_batches < 1:
            raise ConfigError(f"algorithm.max_num_gen_batches={self.max_num_gen_batches}: must be >= 1")
