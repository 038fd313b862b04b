"""Outcome advantages: one value per sampled response, from the rewards of its group.

A group is the G responses sampled for one prompt. Groups may arrive in any
order and interleaved; they are identified by ``group_ids`` (any integers,
e.g. prompt indices). Every group must be complete on the process that calls
`compute_advantages` (gather it first): a group with fewer than G members
would give a silently wrong mean, so it is an error.

Estimators (registry ``ADVANTAGES``, config key ``algorithm.advantage``, which also takes a user's function
of the `AdvantageEstimator` call by import path: megatron_rl.plugins):

* ``grpo``: DeepSeekMath (Shao et al. 2024, arXiv 2402.03300) Sec. 4.1.2,
  outcome supervision: A_i = (r_i - mean_j r_j) / (std_j r_j + eps).
  ``algorithm.std_type`` picks the std: ``sample`` divides the squared
  deviations by G - 1 (torch.std's default, what verl and TRL use),
  ``population`` by G. ``algorithm.adv_eps`` is the eps.
* ``dr_grpo``: Dr. GRPO (Liu et al. 2025, arXiv 2503.20783, Sec. 3, the Dr. GRPO objective):
  A_i = r_i - mean_j r_j (dividing by the std over-weights prompts whose
  answers agree: "question-level difficulty bias").
* ``rloo``: REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE Samples";
  Ahmadian et al. 2024, arXiv 2402.14740, the RLOO estimator of Sec. 3): A_i = r_i - (1/(G-1)) sum_{j != i} r_j
  = G/(G-1) (r_i - mean_j r_j).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from megatron_rl.algorithms._registry import Registry


class AdvantageEstimator(Protocol):
    """The call every estimator takes (compute_advantages'): rewards [N] float64, index [N] int64 (each sample's
    group, 0 .. groups-1; every group complete), group_size G, cfg -> advantages [N]."""

    def __call__(self, rewards, index, group_size, cfg) -> torch.Tensor: ...


ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator", "algorithm.advantage", AdvantageEstimator)


def group_index(group_ids: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, int, int]:
    """Map arbitrary group ids to 0..num_groups-1 and check every group has G members.

    Returns (index [N] int64, num_groups, G). With group_size None, G is the
    common size of all groups (they must agree). Host check (data side, once per step).
    """
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D [N], got shape {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point:
        raise ValueError(f"group_ids must be integers (one id per prompt), got {group_ids.dtype}")
    uniques, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    counts_host = counts.tolist()
    expected = group_size if group_size is not None else (max(counts_host) if counts_host else 0)
    bad = [(gid, c) for gid, c in zip(uniques.tolist(), counts_host) if c != expected]
    if bad:
        shown = ", ".join(f"group {gid}: {c}" for gid, c in bad[:8]) + (" ..." if len(bad) > 8 else "")
        raise ValueError(
            f"{len(bad)} of {len(counts_host)} groups do not have {expected} responses ({shown}): "
            "an incomplete group gives a wrong mean and std; gather every group's responses in one place "
            "before computing advantages (and keep the group size equal to rollout.n_samples)"
        )
    return index, len(counts_host), expected


def _group_mean(values: torch.Tensor, index: torch.Tensor, num_groups: int, group_size: int) -> torch.Tensor:
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)
    return (sums / group_size)[index]


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards: torch.Tensor, index: torch.Tensor, group_size: int, cfg: Any) -> torch.Tensor:
    """A_i = (r_i - mean) / (std + eps), std per ``cfg.std_type`` (DeepSeekMath Sec. 4.1.2)."""
    std_type = cfg.std_type
    if std_type not in ("sample", "population"):
        raise ValueError(f"algorithm.std_type={std_type!r}: must be 'sample' (divide by G-1) or 'population' (divide by G)")
    if std_type == "sample" and group_size < 2:
        raise ValueError(
            f"grpo advantages with algorithm.std_type='sample' need groups of >= 2 responses (group size {group_size}): "
            "raise rollout.n_samples or set algorithm.std_type=population"
        )
    num_groups = int(index.max()) + 1 if index.numel() else 0
    centred = rewards - _group_mean(rewards, index, num_groups, group_size)
    squares = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(0, index, centred * centred)
    divisor = group_size - 1 if std_type == "sample" else group_size
    std = (squares / divisor).sqrt()[index]
    return centred / (std + cfg.adv_eps)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, index: torch.Tensor, group_size: int, cfg: Any) -> torch.Tensor:
    """A_i = r_i - mean_j r_j (Dr. GRPO, arXiv 2503.20783 Sec. 3: no division by the std)."""
    num_groups = int(index.max()) + 1 if index.numel() else 0
    return rewards - _group_mean(rewards, index, num_groups, group_size)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: torch.Tensor, index: torch.Tensor, group_size: int, cfg: Any) -> torch.Tensor:
    """A_i = r_i - mean of the other G-1 rewards = G/(G-1) (r_i - mean) (Ahmadian et al. 2024, arXiv 2402.14740)."""
    if group_size < 2:
        raise ValueError(f"rloo advantages need groups of >= 2 responses (group size {group_size}): raise rollout.n_samples")
    num_groups = int(index.max()) + 1 if index.numel() else 0
    centred = rewards - _group_mean(rewards, index, num_groups, group_size)
    return centred * (group_size / (group_size - 1))


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    cfg: Any,
    *,
    group_size: int | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """Advantages [N] for rewards [N] grouped by group_ids [N], in the input order.

    ``name`` defaults to ``cfg.advantage``. Statistics are computed in float64
    and the result has the rewards' dtype (float32 for integer rewards).
    Non-finite rewards and incomplete groups are errors (host checks: this runs
    on the data side, once per step).
    """
    estimator = ADVANTAGES.get(name if name is not None else cfg.advantage)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]")
    out_dtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    if not bool(torch.isfinite(rewards).all()):
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten()[:8].tolist()
        raise ValueError(f"rewards hold NaN or inf at samples {bad}: fix the reward function (it must return finite numbers)")
    if rewards.numel() == 0:
        return rewards.to(out_dtype)
    index, _, size = group_index(group_ids, group_size)
    advantages = estimator(rewards.to(torch.float64), index.to(rewards.device), size, cfg)
    if not isinstance(advantages, torch.Tensor) or advantages.shape != rewards.shape:
        found = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages).__name__
        raise ValueError(f"advantage estimator {name if name is not None else cfg.advantage!r} (algorithm.advantage) "
                         f"returned {found}: it must return one advantage per sample, a tensor of shape {tuple(rewards.shape)}")
    return advantages.to(out_dtype)


__all__ = ["ADVANTAGES", "compute_advantages", "dr_grpo_advantages", "group_index", "grpo_advantages", "rloo_advantages"]
