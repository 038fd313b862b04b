"""Per-token weight versions in the loss: tokens older than the staleness bound leave it, counted.

One batch worked by hand: the policy trained is version 5, the bound is 2, the
policy equals the old policy (every ratio 1), and

    row 0: A = +1, response token versions 3, 4, 5  -> staleness 2, 1, 0 (all kept)
    row 1: A = -2, versions 2, 3                     -> staleness 3, 2    (the first masked)
    row 2: A = +3, versions 1, 1                     -> staleness 4, 4    (the whole row masked)

dapo's loss is then the token mean over the 4 kept tokens, (-1 x 3 + 2 x 1) / 4 = -0.25,
each kept token's gradient -A_i / 4, the masked ones' 0; 3 tokens masked; the mean
staleness over the 7 response tokens 16 / 7, the largest 4.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor import TrainBatch
from megatron_rl.actor.batch import BatchError, validate_batch
from megatron_rl.actor.distribute import select_rows
from megatron_rl.actor.microbatches import Microbatch
from megatron_rl.actor.step import microbatch_inputs, staleness_metrics
from megatron_rl.algorithms import compute_loss_denominators, finalize_metrics, get_policy_loss, merge_metrics
from megatron_rl.config import AlgorithmConfig
from megatron_rl.data.batch import RolloutSample, Rollouts

DT = torch.float64
POLICY_VERSION, BOUND = 5, 2
ADV = [1.0, -2.0, 3.0]
KEPT = [[2, 3, 4], [3], []]  # token positions of each row that stay in the loss
MASKED = [[], [2], [2, 3]]


def _rollouts() -> Rollouts:
    def sample(i, prompt, versions):
        return RolloutSample(
            prompt_index=i, sample_index=0, prompt_token_ids=torch.tensor(prompt), response_token_ids=torch.tensor([7] * len(versions)),
            rollout_logprobs=torch.full((len(versions),), -0.5), finish_reason="stop", stop_reason=None,
            weight_version=min(versions), token_versions=torch.tensor(versions),
        )

    return Rollouts([sample(0, [1, 2], [3, 4, 5]), sample(1, [1, 2], [2, 3]), sample(2, [1, 2], [1, 1])], n_samples=1, weight_version=1)


def _batch() -> TrainBatch:
    from megatron_rl.actor import train_batch_from_rollouts

    batch = train_batch_from_rollouts(_rollouts().to_padded(), torch.tensor(ADV), policy_version=POLICY_VERSION)
    return batch.replace(old_logprobs=-torch.rand(3, 5, generator=torch.Generator().manual_seed(0), dtype=DT))


def _loss_over(batch: TrainBatch, microbatches: list[Microbatch]):
    """dapo over the microbatches with the step's denominators; (loss, d loss / d logprobs [B, T], metrics)."""
    lengths = batch.lengths()
    items = [microbatch_inputs(batch, mb, lengths, torch.device("cpu"), with_loss_inputs=True, max_staleness=BOUND) for mb in microbatches]
    cfg = AlgorithmConfig(loss="dapo")
    denom = compute_loss_denominators([item.sequence_mask for item in items], max_response_tokens=3)
    logprobs = batch.old_logprobs.clone().requires_grad_()
    total, metrics = 0.0, []
    for mb, item in zip(microbatches, items):
        rows = torch.tensor([max(r, 0) for r in mb.rows])
        row_lp = logprobs[rows, : item.old_logprobs.shape[1]]
        loss, loss_metrics = get_policy_loss("dapo")(row_lp, item.old_logprobs, item.advantages, item.response_mask, cfg, denom)
        total = total + loss
        metrics.append({**loss_metrics, **staleness_metrics(item)})
    (grad,) = torch.autograd.grad(total, logprobs)
    return float(total), grad, finalize_metrics(merge_metrics(metrics))


def test_padded_token_versions_follow_each_token():
    padded = _rollouts().to_padded()
    assert padded.token_versions.tolist() == [[-1, -1, 3, 4, 5], [-1, -1, 2, 3, -1], [-1, -1, 1, 1, -1]]


@pytest.mark.parametrize("packed", [False, True])
def test_tokens_beyond_the_bound_leave_the_loss_and_are_counted(packed):
    batch = _batch()
    mb = Microbatch((0, 1, 2), 5 + 4 + 4, packed=True) if packed else Microbatch((0, 1, 2), 5)  # packed: back to back
    item = microbatch_inputs(batch, mb, batch.lengths(), torch.device("cpu"), with_loss_inputs=True, max_staleness=BOUND)
    for row in range(3):
        assert torch.nonzero(item.response_mask[row]).flatten().tolist() == KEPT[row]
        assert torch.nonzero(item.sequence_mask[row]).flatten().tolist() == KEPT[row]
        assert torch.nonzero(item.stale_tokens[row]).flatten().tolist() == MASKED[row]
    value, grad, metrics = _loss_over(batch, [mb])
    assert value == pytest.approx((-1.0 * 3 + 2.0 * 1) / 4, rel=1e-12)
    for row in range(3):
        for t in range(5):
            want = -ADV[row] / 4 if t in KEPT[row] else 0.0
            assert float(grad[row, t]) == pytest.approx(want, rel=1e-12, abs=0), (row, t)
    assert metrics["tokens/sum"] == 4 and metrics["async/stale_tokens_masked/sum"] == 3
    assert metrics["async/token_staleness"] == pytest.approx(16 / 7, rel=1e-12)
    assert metrics["async/token_staleness/max"] == 4


def test_split_over_microbatches_and_shares_gives_the_same_step():
    batch = _batch()
    whole = _loss_over(batch, [Microbatch((0, 1, 2), 5)])
    split = _loss_over(batch, [Microbatch((2, 0), 5), Microbatch((1,), 4, packed=True)])
    assert split[0] == pytest.approx(whole[0], rel=1e-12)
    torch.testing.assert_close(split[1], whole[1], rtol=1e-12, atol=0)
    assert split[2] == pytest.approx(whole[2], rel=1e-12)
    # A data-parallel share keeps each row's versions (cut to its longest row) and the policy version.
    share = select_rows(batch, [1, 2])
    assert share.policy_version == POLICY_VERSION and share.token_versions.tolist() == [[-1, -1, 2, 3], [-1, -1, 1, 1]]
    item = microbatch_inputs(share, Microbatch((0, 1), 4), share.lengths(), torch.device("cpu"), with_loss_inputs=True, max_staleness=BOUND)
    assert int(item.stale_tokens.sum()) == 3


def test_no_bound_keeps_every_token_and_versions_newer_than_the_policy_are_refused():
    batch = _batch()
    item = microbatch_inputs(batch, Microbatch((0, 1, 2), 5), batch.lengths(), torch.device("cpu"), with_loss_inputs=True)
    assert torch.equal(item.response_mask, batch.response_mask) and item.stale_tokens is None
    assert staleness_metrics(item)["async/stale_tokens_masked/sum"] == 0
    with pytest.raises(BatchError, match=r"token_versions\[0, 4\] = 5 .* newer than the policy being trained \(policy_version=4\)"):
        validate_batch(batch.replace(policy_version=4), vocab_size=16, max_positions=64)
