"""Policy-optimisation algorithms in pure torch: advantages, policy losses, KL, importance
sampling, DAPO's filters and length shaping, and the normalisation contract.

Imports nothing of the project and never megatron or vllm; configs are
duck-typed (anything with the fields of megatron_rl.config.AlgorithmConfig).

One step, as the trainer and actor use it::

    rewards = rewards + soft_overlong_punishment(lengths, L_max, cfg.overlong_buffer, cfg.overlong_penalty)
    advantages = compute_advantages(rewards, group_ids, cfg, group_size=n_samples)
    check_finite_logprobs(mask, old_logprobs=old, rollout_logprobs=rollout)       # host check, once
    masks = [rejection_response_mask(cfg, old_mb, rollout_mb, mask_mb) ...]   # IS options that drop tokens
    denom = compute_loss_denominators(masks, group=dp_cp_group, max_response_tokens=L_max)
    for mb in microbatches:
        loss_sum, metrics = get_policy_loss(cfg.loss)(logprobs, old, adv, mask, cfg, denom, ...)
        backward(loss_sum * framework_loss_scale(M, D, CP))   # see normalization for megatron's cases
    step_metrics = finalize_metrics(all_reduce_metrics(merge_metrics(all_metrics), dp_cp_group))
"""

from megatron_rl.algorithms.advantages import ADVANTAGES, AdvantageEstimator, compute_advantages, group_index
from megatron_rl.algorithms.dynamic_sampling import (
    GROUP_FILTERS,
    DynamicSamplingAccumulator,
    DynamicSamplingExhausted,
    GroupFilter,
    groups_with_reward_variance,
    kept_samples,
)
from megatron_rl.algorithms.importance import (
    IS_CORRECTIONS,
    ISCorrection,
    ISParams,
    as_is_correction,
    get_is_correction,
    importance_weights,
    rejection_response_mask,
    rollout_mismatch_metrics,
)
from megatron_rl.algorithms.kl import KL_ESTIMATORS, kl_estimate, kl_penalty
from megatron_rl.algorithms.losses import (
    DEFAULT_CLIP_RANGE,
    POLICY_LOSSES,
    SEQUENCE_LEVEL_LOSSES,
    PolicyLoss,
    clip_range,
    clipped_surrogate,
    clipped_surrogate_from_log_ratio,
    compute_policy_loss,
    get_policy_loss,
)
from megatron_rl.algorithms.metrics import all_reduce_metrics, finalize_metrics, merge_metrics
from megatron_rl.algorithms.normalization import (
    LossDenominators,
    compute_loss_denominators,
    framework_loss_scale,
    require_whole_sequences,
)
from megatron_rl.algorithms.shaping import overlong_filter_mask, soft_overlong_punishment
from megatron_rl.algorithms.validation import NonFiniteLogprobsError, check_finite_logprobs, check_step_metrics

__all__ = [
    "ADVANTAGES",
    "DEFAULT_CLIP_RANGE",
    "GROUP_FILTERS",
    "IS_CORRECTIONS",
    "AdvantageEstimator",
    "GroupFilter",
    "ISCorrection",
    "ISParams",
    "PolicyLoss",
    "DynamicSamplingAccumulator",
    "DynamicSamplingExhausted",
    "KL_ESTIMATORS",
    "LossDenominators",
    "NonFiniteLogprobsError",
    "POLICY_LOSSES",
    "SEQUENCE_LEVEL_LOSSES",
    "all_reduce_metrics",
    "as_is_correction",
    "check_finite_logprobs",
    "check_step_metrics",
    "clip_range",
    "clipped_surrogate",
    "clipped_surrogate_from_log_ratio",
    "compute_advantages",
    "compute_loss_denominators",
    "compute_policy_loss",
    "finalize_metrics",
    "framework_loss_scale",
    "get_is_correction",
    "get_policy_loss",
    "group_index",
    "importance_weights",
    "groups_with_reward_variance",
    "kept_samples",
    "kl_estimate",
    "kl_penalty",
    "merge_metrics",
    "overlong_filter_mask",
    "rejection_response_mask",
    "require_whole_sequences",
    "rollout_mismatch_metrics",
    "soft_overlong_punishment",
]
