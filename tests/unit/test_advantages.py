"""Advantage estimators against hand-worked numbers and a per-group Python implementation."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_rl.algorithms import ADVANTAGES, compute_advantages
from megatron_rl.config import AlgorithmConfig


def reference(name: str, rewards: list[float], group_ids: list[int], std_type="sample", eps=1e-6) -> list[float]:
    """Per group with the statistics module; returns advantages in the input order."""
    groups: dict[int, list[float]] = {}
    for r, g in zip(rewards, group_ids):
        groups.setdefault(g, []).append(r)
    out = []
    for r, g in zip(rewards, group_ids):
        members = groups[g]
        mean = statistics.fmean(members)
        if name == "grpo":
            std = statistics.stdev(members) if std_type == "sample" else statistics.pstdev(members)
            out.append((r - mean) / (std + eps))
        elif name == "dr_grpo":
            out.append(r - mean)
        else:  # rloo: baseline = mean of the others
            others = list(members)
            others.remove(r)
            out.append(r - statistics.fmean(others))
    return out


def test_hand_worked_grpo():
    # Group of 4 with rewards 1, 0, 0, 1: mean 0.5; sample std = sqrt((4 * 0.25) / 3) = 0.577350;
    # population std = 0.5. A = +-0.5 / (0.577350 + 1e-6) = +-0.866024, or +-0.5 / 0.500001 = +-0.999998.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    ids = torch.tensor([7, 7, 7, 7])
    sample = compute_advantages(rewards, ids, AlgorithmConfig(advantage="grpo", std_type="sample"))
    population = compute_advantages(rewards, ids, AlgorithmConfig(advantage="grpo", std_type="population"))
    s = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    p = 0.5 / (0.5 + 1e-6)
    torch.testing.assert_close(sample, torch.tensor([s, -s, -s, s]))
    torch.testing.assert_close(population, torch.tensor([p, -p, -p, p]))
    assert sample.dtype == torch.float32


def test_hand_worked_dr_grpo_and_rloo():
    # Rewards 3, 1, 2 (G = 3): mean 2 -> Dr. GRPO 1, -1, 0.
    # RLOO: 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; 2 - (3+1)/2 = 0 (= G/(G-1) x (r - mean)).
    rewards = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0])
    dr = compute_advantages(rewards, ids, AlgorithmConfig(advantage="dr_grpo"))
    rloo = compute_advantages(rewards, ids, AlgorithmConfig(advantage="rloo"))
    assert dr.tolist() == [1.0, -1.0, 0.0]
    assert rloo.tolist() == [1.5, -1.5, 0.0]
    assert dr.dtype == torch.float64


@pytest.mark.parametrize("std_type", ["sample", "population"])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_any_order_matches_reference(name, std_type):
    g = torch.Generator().manual_seed(1)
    G, num_groups = 5, 7
    ids = torch.tensor([1000 + 13 * k for k in range(num_groups) for _ in range(G)])  # non-contiguous ids
    rewards = torch.randint(0, 3, (G * num_groups,), generator=g).to(torch.float64) + torch.rand(G * num_groups, generator=g, dtype=torch.float64)
    rewards[:G] = 1.0  # one group with identical rewards: A = 0 for grpo (0 / eps), dr_grpo and rloo
    perm = torch.randperm(G * num_groups, generator=g)  # interleaved, any order
    rewards, ids = rewards[perm], ids[perm]
    cfg = AlgorithmConfig(advantage=name, std_type=std_type)
    got = compute_advantages(rewards, ids, cfg, group_size=G)
    want = reference(name, rewards.tolist(), ids.tolist(), std_type)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # Per-group results do not depend on the order or on the other groups.
    alone = compute_advantages(rewards[ids == ids[0]], ids[ids == ids[0]], cfg)
    torch.testing.assert_close(alone, got[ids == ids[0]], rtol=1e-12, atol=1e-12)


def test_incomplete_group_is_an_error():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    ids = torch.tensor([0, 0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"1 of 2 groups do not have 3 responses \(group 1: 2\).*gather"):
        compute_advantages(rewards, ids, AlgorithmConfig(), group_size=3)
    with pytest.raises(ValueError, match="group 1: 2"):  # inferred size: the largest group
        compute_advantages(rewards, ids, AlgorithmConfig())
    with pytest.raises(ValueError, match="do not have 4 responses"):
        compute_advantages(rewards[:3], ids[:3], AlgorithmConfig(), group_size=4)


def test_bad_input_errors():
    cfg = AlgorithmConfig()
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*dr_grpo, grpo, rloo"):
        compute_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.int64), cfg, name="ppo")
    with pytest.raises(ValueError, match=r"NaN or inf at samples \[1\]"):
        compute_advantages(torch.tensor([0.0, float("nan")]), torch.tensor([0, 0]), cfg)
    with pytest.raises(ValueError, match="must both be"):
        compute_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.int64), cfg)
    with pytest.raises(ValueError, match="integers"):
        compute_advantages(torch.zeros(2), torch.zeros(2), cfg)
    with pytest.raises(ValueError, match="std_type=population"):
        compute_advantages(torch.zeros(2), torch.arange(2), AlgorithmConfig(std_type="sample"))
    with pytest.raises(ValueError, match="rloo advantages need groups of >= 2"):
        compute_advantages(torch.zeros(2), torch.arange(2), AlgorithmConfig(advantage="rloo"))
    # G = 1 with the population std is defined: A = 0 / eps = 0.
    assert compute_advantages(torch.ones(2), torch.arange(2), AlgorithmConfig(std_type="population")).tolist() == [0.0, 0.0]


def test_integer_rewards_and_empty_batch():
    out = compute_advantages(torch.tensor([1, 0, 1, 1]), torch.tensor([0, 0, 1, 1]), AlgorithmConfig(advantage="dr_grpo"))
    assert out.dtype == torch.float32 and out.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert compute_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.int64), AlgorithmConfig()).numel() == 0


def test_registry_names():
    assert ADVANTAGES.names() == ["dr_grpo", "grpo", "rloo"]
