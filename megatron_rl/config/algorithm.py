"""Configuration of the policy-optimisation algorithm (advantages, loss, data-side filters).

The pure-torch package megatron_rl.algorithms reads these fields by name and
does not import this module (it imports nothing of the project).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config.core import ConfigError, check_at_least, check_name_or_import_path

POLICY_LOSS_NAMES = ("dapo", "dr_grpo", "grpo", "gspo", "gspo_token")
"""The names megatron_rl.algorithms.POLICY_LOSSES registers (a test keeps the two in step)."""
ADVANTAGE_NAMES = ("dr_grpo", "grpo", "rloo")
"""The names megatron_rl.algorithms.ADVANTAGES registers."""
IS_CORRECTION_NAMES = ("icepop", "sequence", "sequence_mask", "sequence_mask_tis", "token", "token_mask")
"""The names megatron_rl.algorithms.IS_CORRECTIONS registers (a test keeps the two in step)."""
GROUP_FILTER_NAMES = ("reward_variance",)
"""The names megatron_rl.algorithms.GROUP_FILTERS registers."""
TOKEN_LEVEL_IS_CORRECTIONS = ("icepop", "token", "token_mask")
"""Those whose weight is per token (gspo applies them in its token form, as gspo_token)."""
TRUNCATING_IS_CORRECTIONS = ("sequence", "token")
"""Those that drop no token (their weight is truncated, never 0): the step's denominators do not depend on
the old logprobs, so the training forward can supply them (train.old_logprobs)."""


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantage estimator, policy loss and their options (equations: docs/algorithms.md; code: megatron_rl.algorithms)."""

    loss: str = "gspo"
    """Policy loss: gspo, gspo_token, dapo, dr_grpo, grpo, or a function's import path `package.module:function`
    called as fn(logprobs, old_logprobs, advantages, response_mask, cfg, denom, *, ref_logprobs, rollout_logprobs,
    entropy) -> (loss_sum, metrics) (megatron_rl.algorithms.losses)."""
    advantage: str = "grpo"
    """Advantage estimator: grpo, dr_grpo, rloo, or an import path called as fn(rewards, index, group_size, cfg) ->
    advantages [N] (megatron_rl.algorithms.advantages)."""
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
    tis_mode: str = "none"
    """Importance-sampling correction against the rollout engine's logprobs, by registered name
    (megatron_rl.algorithms.importance): token / sequence (truncated IS, min(rho, C)), token_mask /
    sequence_mask (masked IS: drop tokens / whole sequences whose ratio leaves [is_lower, is_upper]),
    icepop (token masking outside a two-sided band), sequence_mask_tis (sequence masking, truncated
    sequence weight), or none. Sequence ratios are geometric means of token ratios; gspo applies a
    token-level one in its token form (each token's gradient term carries its own weight). Asynchronous
    training (train.max_staleness > 0) needs one: token is AReaL's decoupled objective there. Or an import path
    naming an ISCorrection, or a function fn(log_rho, params) -> (weight, keep, truncated) applied per token."""
    tis_cap: float | None = None
    """Cap C of truncated weights min(rho, C); None = the correction's default (2)."""
    is_lower: float | None = None
    """Lower end of the masking band of the ratio pi_old / pi_rollout; None = the correction's default
    (token_mask / sequence_mask 0, icepop 0.5, sequence_mask_tis 0.5)."""
    is_upper: float | None = None
    """Upper end of the masking band; None = the correction's default (icepop 5, the others 2)."""
    bypass_mode: bool = False
    """Use the engine's logprobs as the old policy and skip the trainer's old-policy forward (one forward
    less per step; the PPO ratio then also corrects the engine/trainer mismatch). Excludes tis_mode and
    routing_replay=R2, which need the trainer's old logprobs / routes."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal (or those group_filter drops) and generate more until the batch is
    full (DAPO)."""
    group_filter: str = "reward_variance"
    """Which groups dynamic sampling keeps: reward_variance (DAPO: those whose task rewards are not all equal), or an
    import path called as fn(rewards, group_ids) -> keep [N] bool, the same for every sample of a group
    (megatron_rl.algorithms.dynamic_sampling)."""
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
        check_name_or_import_path("algorithm.loss", self.loss, POLICY_LOSS_NAMES, "a policy loss")
        check_name_or_import_path("algorithm.advantage", self.advantage, ADVANTAGE_NAMES, "an advantage estimator")
        check_name_or_import_path("algorithm.group_filter", self.group_filter, GROUP_FILTER_NAMES, "a group filter")
        if (self.eps_low is not None and self.eps_low < 0) or (self.eps_high is not None and self.eps_high < 0):
            raise ConfigError(f"algorithm.eps_low={self.eps_low}, algorithm.eps_high={self.eps_high}: clip ranges must be >= 0")
        if self.eps_low is not None and self.eps_low >= 1:
            raise ConfigError(f"algorithm.eps_low={self.eps_low}: must be < 1 (the lower clip bound is 1 - eps_low)")
        if self.std_type not in ("population", "sample"):
            raise ConfigError(f"algorithm.std_type={self.std_type!r}: must be 'sample' or 'population'")
        check_at_least("algorithm.adv_eps", self.adv_eps, 0)
        check_at_least("algorithm.entropy_coeff", self.entropy_coeff, 0, "it is a bonus: the loss subtracts it")
        check_at_least("algorithm.max_response_tokens", self.max_response_tokens, 0, "0 = rollout.max_new_tokens")
        if self.overlong_buffer < 0 or self.overlong_penalty < 0:
            raise ConfigError(
                f"algorithm.overlong_buffer={self.overlong_buffer}, algorithm.overlong_penalty={self.overlong_penalty}: must be >= 0"
            )
        if self.dual_clip_c and self.dual_clip_c <= 1:
            raise ConfigError(f"algorithm.dual_clip_c={self.dual_clip_c}: must be > 1 (about 3), or 0 to disable")
        check_at_least("algorithm.beta", self.beta, 0)
        self._validate_importance_sampling()
        check_at_least("algorithm.max_num_gen_batches", self.max_num_gen_batches, 1)

    def _validate_importance_sampling(self) -> None:
        check_name_or_import_path("algorithm.tis_mode", self.tis_mode, ("none", *IS_CORRECTION_NAMES),
                                  "an importance-sampling correction")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"algorithm.tis_cap={self.tis_cap}: must be > 0")
        lower, upper = self.is_lower, self.is_upper
        if (lower is not None and lower < 0) or (upper is not None and upper <= 0) or (
            lower is not None and upper is not None and lower > upper
        ):
            raise ConfigError(f"algorithm.is_lower={lower}, algorithm.is_upper={upper}: need 0 <= is_lower <= is_upper and is_upper > 0")
        if self.bypass_mode and self.tis_mode != "none":
            raise ConfigError(
                f"algorithm.bypass_mode with algorithm.tis_mode={self.tis_mode}: in bypass mode the engine's logprobs are the "
                "old policy, so pi_old / pi_rollout is 1 and the correction does nothing; set tis_mode=none (the PPO ratio "
                "pi_theta / pi_rollout corrects the mismatch) or bypass_mode=false"
            )
        if self.bypass_mode and self.routing_replay == "R2":
            raise ConfigError(
                "algorithm.bypass_mode with algorithm.routing_replay=R2: R2 replays the routes of the old-policy forward, "
                "which bypass mode skips; use routing_replay=R3 (the engine's routes) or none"
            )
