"""Configuration of the policy-optimisation algorithm (advantages, loss, data-side filters).

The pure-torch package megatron_rl.algorithms reads these fields by name and
does not import this module (it imports nothing of the project).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config.core import ConfigError

POLICY_LOSS_NAMES = ("dapo", "dr_grpo", "grpo", "gspo", "gspo_token")
"""The names megatron_rl.algorithms.POLICY_LOSSES registers (a test keeps the two in step)."""
ADVANTAGE_NAMES = ("dr_grpo", "grpo", "rloo")
"""The names megatron_rl.algorithms.ADVANTAGES registers."""


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantage estimator, policy loss and their options (see notes in megatron_rl/algorithms)."""

    loss: str = "gspo"
    """Policy loss, by registered name: gspo, gspo_token, dapo, dr_grpo, grpo."""
    advantage: str = "grpo"
    """Advantage estimator, by registered name: grpo, dr_grpo, rloo."""
    std_type: Literal["population", "sample"] = "sample"
    """Std used by GRPO advantages: sample (squared deviations divided by G-1, torch.std's default, as in
    verl and TRL) or population (divided by G). Computed over each complete group, so it is the same
    whatever the data-parallel split."""
    adv_eps: float = 1.0e-6
    """Added to the std in GRPO advantages."""
    eps_low: float | None = None
    """Lower clip range: ratios below 1 - eps_low are clipped; None = the loss's paper default
    (gspo/gspo_token 3e-4, dapo/grpo/dr_grpo 0.2)."""
    eps_high: float | None = None
    """Upper clip range (clip-higher): ratios above 1 + eps_high are clipped; None = the loss's paper
    default (gspo/gspo_token 4e-4, dapo 0.28, grpo/dr_grpo 0.2)."""
    dual_clip_c: float = 0.0
    """Dual-clip constant c (> 1) bounding the loss for negative advantages; 0 disables it."""
    beta: float = 0.0
    """KL coefficient to the reference policy; 0 skips the reference model entirely."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1/k2/k3; k3 is unbiased and non-negative)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (the loss subtracts coeff x mean entropy)."""
    max_response_tokens: int = 0
    """Dr. GRPO's constant MAX_TOKENS in tokens (the loss divides by sequences x this); 0 = rollout.max_new_tokens."""
    tis_mode: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling against the rollout engine's logprobs: per token, or per sequence with
    the geometric mean of the token ratios (gspo needs sequence)."""
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
        if self.loss not in POLICY_LOSS_NAMES:
            raise ConfigError(f"algorithm.loss={self.loss!r} is not a policy loss; valid names: {', '.join(POLICY_LOSS_NAMES)}")
        if self.advantage not in ADVANTAGE_NAMES:
            raise ConfigError(
                f"algorithm.advantage={self.advantage!r} is not an advantage estimator; valid names: {', '.join(ADVANTAGE_NAMES)}"
            )
        if (self.eps_low is not None and self.eps_low < 0) or (self.eps_high is not None and self.eps_high < 0):
            raise ConfigError(f"algorithm.eps_low={self.eps_low}, algorithm.eps_high={self.eps_high}: clip ranges must be >= 0")
        if self.eps_low is not None and self.eps_low >= 1:
            raise ConfigError(f"algorithm.eps_low={self.eps_low}: must be < 1 (the lower clip bound is 1 - eps_low)")
        if self.std_type not in ("population", "sample"):
            raise ConfigError(f"algorithm.std_type={self.std_type!r}: must be 'sample' or 'population'")
        if self.adv_eps < 0:
            raise ConfigError(f"algorithm.adv_eps={self.adv_eps}: must be >= 0")
        if self.entropy_coeff < 0:
            raise ConfigError(f"algorithm.entropy_coeff={self.entropy_coeff}: must be >= 0 (it is a bonus: the loss subtracts it)")
        if self.max_response_tokens < 0:
            raise ConfigError(f"algorithm.max_response_tokens={self.max_response_tokens}: must be >= 0 (0 = rollout.max_new_tokens)")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ConfigError(
                f"algorithm.overlong_buffer={self.overlong_buffer}, algorithm.overlong_penalty={self.overlong_penalty}: must be >= 0"
            )
        if self.dual_clip_c and self.dual_clip_c <= 1:
            raise ConfigError(f"algorithm.dual_clip_c={self.dual_clip_c}: must be > 1 (about 3), or 0 to disable")
        if self.beta < 0:
            raise ConfigError(f"algorithm.beta={self.beta}: must be >= 0")
        if self.loss == "gspo" and self.tis_mode == "token":
            raise ConfigError("algorithm.tis_mode=token with algorithm.loss=gspo: GSPO's term is per sequence; use tis_mode=sequence")
        if self.tis_mode != "none" and self.tis_cap <= 0:
            raise ConfigError(f"algorithm.tis_cap={self.tis_cap}: must be > 0 when tis_mode={self.tis_mode!r}")
        if self.max_num_gen_batches < 1:
            raise ConfigError(f"algorithm.max_num_gen_batches={self.max_num_gen_batches}: must be >= 1")
