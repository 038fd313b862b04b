"""DAPO's data-side pieces: soft overlong punishment, overlong filtering, dynamic sampling."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms import (
    DynamicSamplingAccumulator,
    DynamicSamplingExhausted,
    groups_with_reward_variance,
    overlong_filter_mask,
    soft_overlong_punishment,
)


def test_soft_overlong_punishment_hand_worked():
    # L_max = 20, L_cache = 4: no penalty up to 16; then (16 - |y|) / 4; -1 beyond 20 (DAPO Eq. 13).
    lengths = torch.tensor([0, 10, 16, 17, 18, 20, 21, 50])
    got = soft_overlong_punishment(lengths, max_response_length=20, overlong_buffer=4)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    scaled = soft_overlong_punishment(lengths, 20, 4, penalty_factor=0.5)
    assert scaled.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.5, -0.5, -0.5]
    assert soft_overlong_punishment(lengths, 20, 0).tolist() == [0.0] * 8
    with pytest.raises(ValueError, match="overlong_buffer <= rollout.max_new_tokens"):
        soft_overlong_punishment(lengths, 20, 30)


def test_overlong_filter_masks_truncated_rows():
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = overlong_filter_mask(mask, torch.tensor([False, True, False]))
    assert out.sum(-1).tolist() == [4, 0, 4]
    with pytest.raises(ValueError, match="must be"):
        overlong_filter_mask(mask, torch.tensor([True]))


def test_groups_with_reward_variance_any_order():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5])
    ids = torch.tensor([5, 9, 5, 9, 2, 2, 4, 4])  # group 5: all 1; 9: mixed; 2: all 0; 4: mixed
    assert groups_with_reward_variance(rewards, ids).tolist() == [False, True, False, True, False, False, True, True]
    assert groups_with_reward_variance(rewards, ids, atol=0.6).tolist() == [False, True, False, True, False, False, False, False]


def _batch(rewards_per_group, start=0):
    rewards = torch.tensor([r for group in rewards_per_group for r in group], dtype=torch.float32)
    ids = torch.tensor([start + g for g, group in enumerate(rewards_per_group) for _ in group])
    return rewards, ids


def test_accumulator_fills_with_whole_groups_and_drops_surplus():
    acc = DynamicSamplingAccumulator(num_groups=3, max_num_gen_batches=3)
    rewards, ids = _batch([[1, 1], [0, 1], [0, 0]])
    kept = acc.add(rewards, ids, tokens=torch.arange(6) * 10, text=[f"s{i}" for i in range(6)])
    assert kept == 1 and not acc.is_full
    rewards, ids = _batch([[1, 0], [1, 1], [0, 1], [1, 0]], start=0)  # ids may repeat across batches
    kept = acc.add(rewards, ids, tokens=torch.arange(6, 14) * 10, text=[f"s{i}" for i in range(6, 14)])
    assert kept == 2 and acc.is_full and acc.num_gen_batches == 2
    batch = acc.take()
    assert batch["text"] == ["s2", "s3", "s6", "s7", "s10", "s11"]
    assert batch["tokens"].tolist() == [20, 30, 60, 70, 100, 110]
    assert batch["rewards"].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert batch["group_ids"].tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(RuntimeError, match="already full"):
        acc.add(rewards, ids)


def test_accumulator_error_says_what_to_change():
    acc = DynamicSamplingAccumulator(num_groups=4, max_num_gen_batches=2)
    acc.add(*_batch([[1, 1], [0, 1], [0, 0], [0, 0]]))
    with pytest.raises(DynamicSamplingExhausted) as err:
        acc.add(*_batch([[0, 0], [1, 1], [0, 0], [1, 0]]))
    message = str(err.value)
    assert "after 2 generation batches (algorithm.max_num_gen_batches=2)" in message
    assert "only 2 of the 4 groups" in message and "train.prompts_per_step" in message
    assert "6 of 8 generated groups had identical rewards (4 all 0, 2 all 1)" in message
    assert "raise algorithm.max_num_gen_batches to at least 4" in message  # 2 groups kept per 2 batches -> 4 batches
    assert "rollout.n_samples" in message and "algorithm.dynamic_sampling=false" in message


def test_accumulator_with_no_usable_group_says_so():
    acc = DynamicSamplingAccumulator(num_groups=1, max_num_gen_batches=1)
    with pytest.raises(DynamicSamplingExhausted, match="no group had differing rewards"):
        acc.add(*_batch([[1, 1], [0, 0]]))


def test_accumulator_bad_fields():
    acc = DynamicSamplingAccumulator(num_groups=1, max_num_gen_batches=1)
    with pytest.raises(ValueError, match="field 'tokens' has 1 entries for 2 rewards"):
        acc.add(*_batch([[1, 0]]), tokens=torch.zeros(1))
    with pytest.raises(RuntimeError, match="keep calling add"):
        acc.take()
