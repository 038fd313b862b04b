"""A group filter (docs/extending.md) for dynamic sampling, with this
folder on PYTHONPATH:
algorithm.dynamic_sampling=true
algorithm.group_filter=difficulty_filter:mid_difficulty

It keeps the groups whose mean reward is in [0.2, 0.8]: prompts the
policy solves sometimes, neither always nor never. By hand, for groups
of 4 samples:

    rewards 1 0 0 0  mean 0.25  kept
    rewards 1 1 1 1  mean 1.0   dropped
    rewards 1 1 1 0  mean 0.75  kept
    rewards 0 0 0 0  mean 0.0   dropped
"""

from __future__ import annotations

import torch

LOW, HIGH = 0.2, 0.8


def mid_difficulty(rewards, group_ids):
    """keep [N] bool: every sample of the groups whose mean reward is in
    [LOW, HIGH]."""
    _, group = torch.unique(group_ids, return_inverse=True)
    count = torch.bincount(group).to(rewards.dtype)
    total = torch.zeros_like(count).index_add_(0, group, rewards)
    mean = (total / count)[group]
    return (mean >= LOW) & (mean <= HIGH)
