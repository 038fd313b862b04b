"""The step plan: every row in exactly one microbatch of one DP rank; equal microbatch counts; budgets and shapes."""

from __future__ import annotations

import random

import pytest

from megatron_rl.actor.microbatches import plan_step, split_balanced, split_contiguous

LENGTHS = [random.Random(0).randint(3, 60) for _ in range(23)]


def _rows(plan):
    return sorted(r for mini in plan for rank in mini for mb in rank for r in mb.rows if r >= 0)


@pytest.mark.parametrize("dp", [1, 2, 3])
@pytest.mark.parametrize("mini", [1, 2])
@pytest.mark.parametrize("budget", [0, 100, 10])
def test_every_row_once_and_equal_counts(dp, mini, budget):
    plan = plan_step(LENGTHS, mini_batches=mini, dp_size=dp, micro_batch_size=3, max_tokens_per_microbatch=budget, width_multiple=2)
    assert _rows(plan) == list(range(len(LENGTHS)))
    assert len(plan) == mini
    for i, mini_batch in enumerate(plan):
        assert len(mini_batch) == dp
        assert len({len(rank) for rank in mini_batch}) == 1  # the same M on every DP rank
        rows = sorted(r for rank in mini_batch for mb in rank for r in mb.rows if r >= 0)
        assert rows == split_contiguous(len(LENGTHS), mini)[i]  # mini-batches are contiguous
        for rank in mini_batch:
            for mb in rank:
                assert mb.width % 2 == 0
                assert all(LENGTHS[r] <= mb.width for r in mb.rows if r >= 0)
                if budget and mb.num_real_rows > 1:
                    assert len(mb.rows) * mb.width <= budget
                if not budget:
                    assert len(mb.rows) <= 3


def test_token_budget_packs_short_rows_together():
    plan = plan_step([10, 10, 10, 10, 50], mini_batches=1, dp_size=1, max_tokens_per_microbatch=40)
    micro = plan[0][0]
    assert sorted(len(mb.rows) for mb in micro) == [1, 4]  # the 50-token row alone (over budget), 4 x 10 together


def test_equal_and_uniform_shapes():
    plan = plan_step(LENGTHS, mini_batches=1, dp_size=2, micro_batch_size=2, equal_shapes_across_dp=True)
    for m in range(len(plan[0][0])):
        assert plan[0][0][m].width == plan[0][1][m].width and len(plan[0][0][m].rows) == len(plan[0][1][m].rows)
    plan = plan_step(LENGTHS, mini_batches=1, dp_size=2, max_tokens_per_microbatch=80, uniform_shapes=True)
    for rank in plan[0]:
        assert len({(len(mb.rows), mb.width) for mb in rank}) == 1


def test_ranks_without_rows_get_padding_microbatches():
    plan = plan_step([5, 6], mini_batches=1, dp_size=3, micro_batch_size=1)
    empty = [rank for rank in plan[0] if all(r < 0 for mb in rank for r in mb.rows)]
    assert len(empty) == 1 and empty[0][0].rows == (-1,)


def test_balanced_split_balances_tokens():
    shares = split_balanced(list(range(len(LENGTHS))), LENGTHS, 3)
    loads = [sum(LENGTHS[r] for r in share) for share in shares]
    assert max(loads) - min(loads) <= max(LENGTHS)


def test_too_few_rows_for_mini_batches():
    with pytest.raises(ValueError, match="mini_batches_per_step"):
        plan_step([5], mini_batches=2, dp_size=1)


def test_packed_plan_fills_the_token_budget_with_whole_sequences():
    lengths = [40, 23, 31, 12, 37, 18, 27, 10, 35, 29, 15, 33]
    plan = plan_step(lengths, mini_batches=1, dp_size=2, max_tokens_per_microbatch=64, width_multiple=4, pack_sequences=True)
    seen = []
    for rank in plan[0]:
        for mb in rank:
            assert mb.packed and mb.width % 4 == 0
            padded = sum(-(-lengths[r] // 4) * 4 for r in mb.rows)
            assert padded <= 64 and mb.width == max(4, padded)  # no row padding: the width is the sum
            seen += mb.rows
    assert sorted(seen) == list(range(len(lengths)))
    assert len(plan[0][0]) == len(plan[0][1])  # the same microbatch count on every DP rank


def test_a_packed_budget_below_one_sequence_names_it():
    with pytest.raises(ValueError, match=r"sequence 0 has 40 tokens \(40 padded.*max_tokens_per_microbatch=32: raise the budget to at least 40"):
        plan_step([40, 10], mini_batches=1, dp_size=1, max_tokens_per_microbatch=32, pack_sequences=True)


@pytest.mark.parametrize("pack", [False, True])
def test_a_share_keeps_every_field_of_the_plan(pack):
    """A DP rank's share (rows renumbered 0..b-1) gets the plan's microbatches with every field but the row
    numbers unchanged: packing and width too (a share once lost `packed`, which silently turned packing off)."""
    from megatron_rl.actor.microbatches import rank_microbatches

    lengths = [40, 23, 31, 12, 37, 18, 27, 10, 35, 29, 15, 33]
    plan = plan_step(lengths, mini_batches=2, dp_size=2, max_tokens_per_microbatch=64, width_multiple=4, pack_sequences=pack)
    for dp in range(2):
        planned = [mb for mini in plan for mb in mini[dp]]
        step_rows = sorted(r for mb in planned for r in mb.rows if r >= 0)
        local = [rank_microbatches(mini[dp], step_rows) for mini in plan]
        for mine, want in zip([mb for mini in local for mb in mini], planned):
            assert (mine.packed, mine.width) == (want.packed, want.width) == (pack, want.width)
            assert tuple(step_rows[r] if r >= 0 else -1 for r in mine.rows) == want.rows
    # the whole step's batch: rows keep their step index
    assert rank_microbatches(plan[0][1], None) == plan[0][1]


def test_a_microbatch_that_differs_from_the_plan_is_named():
    from megatron_rl.actor.microbatches import Microbatch, PlanMismatch, check_matches_plan

    planned = [Microbatch((3, 7), 40, packed=True)]
    with pytest.raises(PlanMismatch, match="field 'packed' is False on this rank but True"):
        check_matches_plan([Microbatch((0, 1), 40)], planned, [3, 7])
    with pytest.raises(PlanMismatch, match="field 'rows'"):
        check_matches_plan([Microbatch((1, 0), 40, packed=True)], planned, [3, 7])
    with pytest.raises(PlanMismatch, match="does not hold"):
        from megatron_rl.actor.microbatches import rank_microbatches

        rank_microbatches(planned, [3, 8])


def test_balanced_split_deals_each_row_to_the_least_loaded_bin():
    """Against the rule written out as a scan of every bin per row (fewest tokens, then fewest rows, then lowest
    bin), on long-tailed lengths with many ties."""
    import random

    rng = random.Random(3)
    for parts in (1, 2, 5, 32):
        lengths = [rng.choice([7, 7, 16, 300, 2048]) + rng.randrange(3) for _ in range(200)]
        rows = list(range(0, 200, 2)) + [1, 3]
        bins, load = [[] for _ in range(parts)], [0] * parts
        for row in sorted(rows, key=lambda r: (-lengths[r], r)):
            target = min(range(parts), key=lambda i: (load[i], len(bins[i]), i))
            bins[target].append(row)
            load[target] += lengths[row]
        assert split_balanced(rows, lengths, parts) == [sorted(b) for b in bins], parts
