"""An advantage estimator (docs/extending.md): REINFORCE++-baseline
(Hu et al., arXiv 2501.03262), with this folder on PYTHONPATH:
algorithm.advantage=reinforce_pp_advantage:reinforce_pp_baseline

The group's mean is subtracted, then the whole step's std divides:

    A_i = (R_i - mean of i's group) / (std over the step + eps)
"""

from __future__ import annotations

import torch


def reinforce_pp_baseline(rewards, index, group_size, cfg):
    """rewards [N] float64; index [N]: each sample's group, 0 .. groups-1;
    every group has group_size samples."""
    groups = int(index.max()) + 1
    sums = torch.zeros(groups, dtype=rewards.dtype)
    means = sums.index_add_(0, index, rewards) / group_size
    centred = rewards - means[index]
    return centred / (centred.std() + cfg.adv_eps)
