"""The normalisation contract in one process: denominators, metric reduction, microbatch splits.

(tests/distributed/test_split_invariance.py proves the same over real gloo ranks.)
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (
    LossDenominators,
    compute_loss_denominators,
    finalize_metrics,
    framework_loss_scale,
    get_policy_loss,
    merge_metrics,
)
from megatron_rl.algorithms.metrics import all_reduce_metrics, mean_metric, reduce_kind
from megatron_rl.config import AlgorithmConfig

LOSSES = ["grpo", "dapo", "dr_grpo", "gspo", "gspo_token"]


def test_denominators_count_tokens_and_sequences_over_microbatches():
    a = torch.tensor([[True, True, False], [False, False, False]])
    b = torch.tensor([[True, False, False, False, False], [True, True, True, True, False], [False] * 5])
    denom = compute_loss_denominators([a, b], max_response_tokens=16)
    assert denom == LossDenominators(global_num_tokens=7, global_num_sequences=3, max_response_tokens=16)
    assert denom.num_split_sequences is None
    zero = compute_loss_denominators([torch.zeros(2, 3, dtype=torch.bool)])
    assert zero.global_num_tokens == 0 and zero.tokens == 1 and zero.sequences == 1


def test_denominators_with_sequence_ids_count_split_sequences_once():
    # Sequence 4's response is split over two microbatches (token-level losses allow it).
    a = torch.tensor([[True, True], [True, False], [False, False]])
    b = torch.tensor([[True, True], [True, False]])
    denom = compute_loss_denominators(
        [a, b], sequence_ids=[torch.tensor([4, 1, -1]), torch.tensor([4, 0])], num_sequence_ids=6
    )
    assert denom.global_num_tokens == 6 and denom.global_num_sequences == 3 and denom.num_split_sequences == 1
    with pytest.raises(ValueError, match="ids >= num_sequence_ids=6"):
        compute_loss_denominators([a], sequence_ids=[torch.tensor([6, 0, 0])], num_sequence_ids=6)
    with pytest.raises(ValueError, match="one per microbatch"):
        compute_loss_denominators([a, b], sequence_ids=[torch.tensor([0, 1, 2])], num_sequence_ids=6)
    with pytest.raises(ValueError, match="num_sequence_ids"):
        compute_loss_denominators([a], sequence_ids=[torch.tensor([0, 1, 2])])
    with pytest.raises(ValueError, match="bool"):
        compute_loss_denominators([a.float()])
    with pytest.raises(ValueError, match="got none"):
        compute_loss_denominators([])


def test_token_loss_exact_when_a_sequence_is_split_across_microbatches():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64)
    lp = (old + 0.2 * torch.randn(3, 6, generator=g, dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2, [True] * 2 + [False] * 4])
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    for name in ("dapo", "dr_grpo"):
        cfg = AlgorithmConfig(loss=name)
        whole, _ = get_policy_loss(name)(lp, old, adv, mask, cfg, compute_loss_denominators([mask], max_response_tokens=6))
        (g_whole,) = torch.autograd.grad(whole, lp)
        # Row 0 split into tokens 0-2 (microbatch 1) and 3-5 (microbatch 2).
        m1 = torch.stack([mask[0] & (torch.arange(6) < 3), mask[1]])
        m2 = torch.stack([mask[0] & (torch.arange(6) >= 3), mask[2]])
        rows1, rows2 = [0, 1], [0, 2]
        denom = compute_loss_denominators(
            [m1, m2], max_response_tokens=6, sequence_ids=[torch.tensor(rows1), torch.tensor(rows2)], num_sequence_ids=3
        )
        assert denom.global_num_sequences == 3
        fn = get_policy_loss(name)
        l1, _ = fn(lp[rows1], old[rows1], adv[rows1], m1, cfg, denom)
        l2, _ = fn(lp[rows2], old[rows2], adv[rows2], m2, cfg, denom)
        (g_split,) = torch.autograd.grad(l1 + l2, lp)
        torch.testing.assert_close(l1 + l2, whole, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(g_split, g_whole, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", LOSSES)
def test_microbatch_split_invariance_single_process(name):
    """Microbatches with different paddings and token counts (and one without tokens) sum to the whole batch."""
    g = torch.Generator().manual_seed(2)
    B, T = 9, 8
    lengths = [8, 1, 0, 5, 3, 0, 7, 2, 6]
    mask = torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(-1)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64)
    theta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    features = torch.randn(B, T, 3, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    ref = old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    cfg = AlgorithmConfig(loss=name, eps_low=0.05, eps_high=0.08, beta=0.1, tis_mode="sequence", dual_clip_c=2.0)
    fn = get_policy_loss(name)

    def lp_of(rows):
        return old[rows] + 0.1 * torch.randn(1, generator=torch.Generator().manual_seed(9), dtype=torch.float64) + features[rows] @ theta

    whole_denom = compute_loss_denominators([mask], max_response_tokens=T)
    all_rows = list(range(B))
    whole, whole_metrics = fn(lp_of(all_rows), old, adv, mask, cfg, whole_denom, ref_logprobs=ref, rollout_logprobs=rollout)
    (g_whole,) = torch.autograd.grad(whole, theta)
    splits = [[2, 5], [0, 1, 3], [4, 6, 7, 8]]  # the first microbatch has no response tokens
    masks = []
    for rows in splits:
        width = max(1, max(lengths[r] for r in rows))  # each microbatch padded to its own length
        masks.append(mask[rows, :width])
    denom = compute_loss_denominators(masks, max_response_tokens=T)
    assert denom == whole_denom
    total, metric_list = 0.0, []
    for rows, m in zip(splits, masks):
        w = m.shape[1]
        loss, metrics = fn(lp_of(rows)[:, :w], old[rows, :w], adv[rows], m, cfg, denom,
                           ref_logprobs=ref[rows, :w], rollout_logprobs=rollout[rows, :w])
        total = total + loss
        metric_list.append(metrics)
    (g_split,) = torch.autograd.grad(total, theta)
    torch.testing.assert_close(total, whole, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(g_split, g_whole, rtol=1e-12, atol=1e-15)
    merged, expected = finalize_metrics(merge_metrics(metric_list)), finalize_metrics(whole_metrics)
    assert merged.keys() == expected.keys()
    for key in expected:
        assert merged[key] == pytest.approx(expected[key], rel=1e-12, abs=1e-15), key


def test_metric_reduction_kinds_and_finalize():
    assert [reduce_kind(k) for k in ("ratio", "ratio/min", "ratio/max", "loss/sum")] == ["mean", "min", "max", "sum"]
    a = {"x": mean_metric(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, True, False])), "x/max": torch.tensor(2.0, dtype=torch.float64)}
    b = {"x": mean_metric(torch.tensor([10.0]), torch.tensor([True])), "x/max": torch.tensor(10.0, dtype=torch.float64)}
    final = finalize_metrics(merge_metrics([a, b]))
    assert final == {"x": 13.0 / 3.0, "x/max": 10.0}  # token-weighted mean, not the mean of means (5.75)
    empty = finalize_metrics({"x": mean_metric(torch.zeros(2), torch.zeros(2, dtype=torch.bool)), "y/min": torch.tensor(math.inf)})
    assert math.isnan(empty["x"]) and math.isnan(empty["y/min"])
    assert all_reduce_metrics(a) == a  # no process group: unchanged


def test_framework_loss_scale():
    assert framework_loss_scale(3, 4) == 12
    assert framework_loss_scale(3, 4, 2) == 24
    assert framework_loss_scale(3, 4, schedule_divides_by_microbatches=False) == 4
    assert framework_loss_scale(3, 4, ddp_averages=False) == 3
    assert framework_loss_scale(3, 4, 2, schedule_multiplies_by_context_parallel=True) == 12  # megatron, 2-value loss_func
    with pytest.raises(ValueError, match=">= 1"):
        framework_loss_scale(0, 1)
