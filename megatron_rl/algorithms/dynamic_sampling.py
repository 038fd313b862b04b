"""DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476, Sec. 3.2; the constraint 0 < |{correct}| < G of Eq. 8).

A group whose rewards are all equal (all right or all wrong) has zero
advantage and contributes no gradient; DAPO drops such groups,
0 < |{o_i : correct}| < G, and keeps generating until the train batch holds
the configured number of groups, giving up after ``max_num_gen_batches``
generation batches with an error that says what to change.

Which groups stay is a group filter (registry ``GROUP_FILTERS``, config key
``algorithm.group_filter``): ``reward_variance`` is DAPO's; a user's filter is
any function of the same call, `fn(rewards [N], group_ids [N]) -> keep [N] bool`,
one flag per sample and the same for every sample of a group.

    acc = DynamicSamplingAccumulator(num_groups=cfg.train.prompts_per_step,
                                     max_num_gen_batches=cfg.algorithm.max_num_gen_batches,
                                     group_filter=cfg.algorithm.group_filter)
    while not acc.is_full:
        batch = generate()                      # raises from add() when out of batches
        acc.add(batch.rewards, batch.group_ids, tokens=batch.tokens, ...)
    train_batch = acc.take()                    # exactly num_groups whole groups
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from megatron_rl.algorithms._registry import Registry


class GroupFilter(Protocol):
    """The call every group filter takes: rewards [N] (the task reward, before length shaping), group_ids [N]
    int64 -> keep [N] bool, the same for every sample of a group."""

    def __call__(self, rewards, group_ids) -> torch.Tensor: ...


GROUP_FILTERS: Registry[GroupFilter] = Registry("group filter", "algorithm.group_filter", GroupFilter)


@GROUP_FILTERS.register("reward_variance")
def groups_with_reward_variance(rewards: torch.Tensor, group_ids: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """keep [N] bool: True for samples whose group's rewards are not all equal (max - min > atol)."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]")
    _, index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(index.max()) + 1 if index.numel() else 0
    values = rewards.to(torch.float64)
    high = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=values.device).scatter_reduce(0, index, values, "amax")
    low = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=values.device).scatter_reduce(0, index, values, "amin")
    return ((high - low) > atol)[index]


def kept_samples(group_filter: str, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """keep [N] bool of the filter named `group_filter` (algorithm.group_filter); what it returned is checked:
    one bool per sample, the same within each group (host check, once per generation batch)."""
    keep = GROUP_FILTERS.get(group_filter)(rewards, group_ids)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != rewards.shape:
        found = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(f"group filter {group_filter!r} (algorithm.group_filter) returned {found}: it must return "
                         f"keep, a bool tensor of shape {tuple(rewards.shape)} (one flag per sample)")
    _, index = torch.unique(group_ids, return_inverse=True)
    kept_per_group = torch.zeros(int(index.max()) + 1 if index.numel() else 0, dtype=torch.int64).index_add_(0, index, keep.to(torch.int64))
    size_per_group = torch.bincount(index, minlength=kept_per_group.numel())
    if bool(((kept_per_group != 0) & (kept_per_group != size_per_group)).any()):
        raise ValueError(f"group filter {group_filter!r} (algorithm.group_filter) kept some samples of a group and not "
                         "others: it keeps or drops whole groups (return the same flag for every sample of a group)")
    return keep


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling used all its generation batches without filling the train batch."""


class DynamicSamplingAccumulator:
    """Collect whole groups with reward variance over generation batches until ``num_groups`` are held.

    ``add(rewards, group_ids, **fields)`` takes one generation batch: per-sample
    rewards [N], group ids [N] (unique within the batch) and any per-sample
    fields (tensors with first dimension N, or lists of length N). It keeps the
    groups whose rewards differ and raises `DynamicSamplingExhausted` when the
    ``max_num_gen_batches``-th batch still leaves the train batch short.
    ``take()`` returns exactly ``num_groups`` whole groups (surplus groups of the
    last batch are dropped, as in DAPO), with ``rewards`` and ``group_ids``
    renumbered 0..num_groups-1 in arrival order. ``group_filter`` names the
    filter in GROUP_FILTERS (or a plug-in's import path) that decides which
    groups stay.
    """

    def __init__(self, num_groups: int, max_num_gen_batches: int, *, group_filter: str = "reward_variance") -> None:
        if num_groups < 1 or max_num_gen_batches < 1:
            raise ValueError(f"num_groups={num_groups}, max_num_gen_batches={max_num_gen_batches}: both must be >= 1")
        self.num_groups = num_groups
        self.max_num_gen_batches = max_num_gen_batches
        self.group_filter = group_filter
        self.num_gen_batches = 0
        self.groups_seen = 0
        self.groups_all_equal: dict[float, int] = {}
        self._groups: list[dict[str, Any]] = []

    @property
    def is_full(self) -> bool:
        return len(self._groups) >= self.num_groups

    def add(self, rewards: torch.Tensor, group_ids: torch.Tensor, **fields: Any) -> int:
        """Keep this batch's groups with reward variance; return how many were kept."""
        if self.is_full:
            raise RuntimeError("the train batch is already full: call take() instead of generating more")
        n = rewards.shape[0]
        for name, value in fields.items():
            if len(value) != n:
                raise ValueError(f"field {name!r} has {len(value)} entries for {n} rewards")
        self.num_gen_batches += 1
        keep = kept_samples(self.group_filter, rewards, group_ids)
        kept = 0
        ids_host = group_ids.tolist()
        keep_host = keep.tolist()
        rewards_host = rewards.tolist()
        members: dict[int, list[int]] = {}
        for i, gid in enumerate(ids_host):
            members.setdefault(gid, []).append(i)
        for rows in members.values():
            self.groups_seen += 1
            if not keep_host[rows[0]]:
                value = float(rewards_host[rows[0]])
                self.groups_all_equal[value] = self.groups_all_equal.get(value, 0) + 1
                continue
            if len(self._groups) < self.num_groups:
                index = torch.tensor(rows, dtype=torch.int64)
                group = {"rewards": rewards[index.to(rewards.device)]}
                group.update({k: _select(v, rows, index) for k, v in fields.items()})
                self._groups.append(group)
                kept += 1
        if not self.is_full and self.num_gen_batches >= self.max_num_gen_batches:
            raise DynamicSamplingExhausted(self._exhausted_message())
        return kept

    def take(self) -> dict[str, Any]:
        """The train batch: every field concatenated over exactly num_groups groups, plus rewards and group_ids."""
        if not self.is_full:
            raise RuntimeError(f"only {len(self._groups)} of {self.num_groups} groups collected: keep calling add()")
        groups = self._groups[: self.num_groups]
        out: dict[str, Any] = {}
        for name in groups[0]:
            parts = [g[name] for g in groups]
            out[name] = torch.cat(parts) if isinstance(parts[0], torch.Tensor) else [x for p in parts for x in p]
        out["group_ids"] = torch.cat([torch.full((len(g["rewards"]),), i, dtype=torch.int64) for i, g in enumerate(groups)])
        return out

    def _exhausted_message(self) -> str:
        kept, seen = len(self._groups), self.groups_seen
        equal = ", ".join(f"{count} all {value:g}" for value, count in sorted(self.groups_all_equal.items()))
        rate = kept / seen if seen else 0.0
        per_batch = seen / max(self.num_gen_batches, 1)
        needed = math.ceil(self.num_groups / (rate * per_batch)) if rate > 0 else None
        advice = (
            f"raise algorithm.max_num_gen_batches to at least {needed} (at this keep rate)"
            if needed is not None
            else "no group had differing rewards: check the reward function and the data's difficulty"
        )
        if self.group_filter != "reward_variance":
            advice = advice if needed is not None else f"no group passed: check the filter {self.group_filter!r}"
            return (
                f"dynamic sampling: after {self.num_gen_batches} generation batches (algorithm.max_num_gen_batches="
                f"{self.max_num_gen_batches}) only {kept} of the {self.num_groups} groups a step needs "
                f"(train.prompts_per_step) passed algorithm.group_filter={self.group_filter!r}, which dropped "
                f"{seen - kept} of {seen} generated groups. To fix: {advice}; or set algorithm.dynamic_sampling=false."
            )
        return (
            f"dynamic sampling: after {self.num_gen_batches} generation batches (algorithm.max_num_gen_batches="
            f"{self.max_num_gen_batches}) only {kept} of the {self.num_groups} groups a step needs "
            f"(train.prompts_per_step) had rewards that differ; {seen - kept} of {seen} generated groups "
            f"had identical rewards ({equal or 'none'}). To fix: {advice}; or raise rollout.n_samples "
            "(larger groups are less often all-equal); or train on prompts of better-suited difficulty; "
            "or set algorithm.dynamic_sampling=false."
        )


def _select(value: Any, rows: list[int], index: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value[index.to(value.device)]
    return [value[i] for i in rows]


__all__ = ["GROUP_FILTERS", "DynamicSamplingAccumulator", "DynamicSamplingExhausted", "GroupFilter", "groups_with_reward_variance",
           "kept_samples"]
