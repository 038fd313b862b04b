"""TrainBatch checks: every refusal names the sample and the fix; the rollout conversion is a re-labelling."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor import BatchError, TrainBatch, train_batch_from_rollouts, validate_batch
from megatron_rl.data.batch import RolloutSample, Rollouts

B, T = 3, 10
LIMITS = dict(vocab_size=100, max_positions=64, num_moe_layers=2, topk=2, num_experts=4)


def _batch(**changes) -> TrainBatch:
    positions = torch.arange(T)
    lengths = torch.tensor([10, 7, 5])
    fields = dict(
        tokens=torch.randint(0, 100, (B, T), generator=torch.Generator().manual_seed(0)),
        response_mask=(positions[None] >= 3) & (positions[None] < lengths[:, None]),
        advantages=torch.ones(B),
        prompt_lengths=torch.full((B,), 3),
        sequence_lengths=lengths,
    )
    fields.update(changes)
    return TrainBatch(**fields)


def test_a_good_batch_passes():
    validate_batch(_batch(old_logprobs=torch.zeros(B, T), routed_experts=torch.zeros(B, T, 2, 2, dtype=torch.int16)), **LIMITS)


def test_nan_logprobs_name_the_sample():
    old = torch.zeros(B, T)
    old[1, 4] = float("nan")
    with pytest.raises(BatchError, match=r"old_logprobs\[1, 4\] = nan \(sample 1, position 4 \(response token 1\)\)"):
        validate_batch(_batch(old_logprobs=old), **LIMITS)
    rollout = torch.zeros(B, T)
    rollout[2, 9] = float("nan")  # padding of sample 2 (length 5): not a response token, ignored
    validate_batch(_batch(rollout_logprobs=rollout), **LIMITS)
    rollout[2, 3] = float("inf")
    with pytest.raises(BatchError, match="sample 2.*rollout engine"):
        validate_batch(_batch(rollout_logprobs=rollout), **LIMITS)


def test_routes_shape_mismatch_says_which_dimension():
    with pytest.raises(BatchError, match=r"describe 3 MoE layer\(s\) x top-2, the model has 2 x top-2"):
        validate_batch(_batch(routed_experts=torch.zeros(B, T, 3, 2, dtype=torch.int16)), **LIMITS)
    with pytest.raises(BatchError, match="not aligned with `tokens`"):
        validate_batch(_batch(routed_experts=torch.zeros(B, T - 1, 2, 2, dtype=torch.int16)), **LIMITS)
    bad = torch.zeros(B, T, 2, 2, dtype=torch.int16)
    bad[2, 1, 1, 0] = 7
    with pytest.raises(BatchError, match=r"sample 2, position 1, MoE layer 1\): expert ids outside \[0, 4\)"):
        validate_batch(_batch(routed_experts=bad), **LIMITS)


def test_missing_routes_only_matter_for_replay():
    routes = torch.zeros(B, T, 2, 2, dtype=torch.int16)
    routes[0, 1] = -1  # a prompt position the engine did not capture
    validate_batch(_batch(routed_experts=routes), **LIMITS)  # metrics skip it
    with pytest.raises(BatchError, match="sample 0.*routed_experts_include_prompt=true"):
        validate_batch(_batch(routed_experts=routes), complete_routes=("routed_experts",), **LIMITS)
    routes[0, 1] = 0
    routes[2, 8] = -1  # padding of sample 2: fine even for replay
    validate_batch(_batch(routed_experts=routes), complete_routes=("routed_experts",), **LIMITS)


def test_rank_routes_stay_with_their_rows():
    # A share's routes kept per rank (R3's after actor.distribute, R2's after prepare_batch) are keyed by its rows:
    # selecting rows afterwards is refused, naming the field; the share's routes check against its own shape.
    from megatron_rl.actor.routing import RankRoutes

    held = RankRoutes(torch.tensor([0, 1]), torch.zeros(2, 1, 2, dtype=torch.uint8), (1,), (B, T), 2, 2)
    for name in ("routed_experts", "old_routed_experts"):
        validate_batch(_batch(**{name: held}), **LIMITS)
        with pytest.raises(BatchError, match=rf"batch.{name} holds this rank's routes.*replace\({name}=None\)"):
            _batch(**{name: held}).select(torch.tensor([0]))
        with pytest.raises(BatchError, match=rf"batch.{name} was recorded on a \[B, T\] = \(3, 10\) batch with 2 MoE layers"):
            validate_batch(_batch(**{name: held}).replace(tokens=torch.zeros(B, T + 1, dtype=torch.int64),
                                                          response_mask=torch.zeros(B, T + 1, dtype=torch.bool)), **LIMITS)


def test_too_long_and_bad_tokens():
    with pytest.raises(BatchError, match="sample 0 has 10 tokens, more than the model's max_position_embeddings=8"):
        validate_batch(_batch(), **{**LIMITS, "max_positions": 8})
    tokens = _batch().tokens.clone()
    tokens[1, 2] = 100
    with pytest.raises(BatchError, match=r"tokens\[1, 2\] = 100 .* outside the model's vocabulary"):
        validate_batch(_batch(tokens=tokens), **LIMITS)
    tokens[1, 2] = 0
    tokens[1, 8] = -5  # padding: ignored
    validate_batch(_batch(tokens=tokens), **LIMITS)


def test_mask_and_advantage_shapes():
    mask = _batch().response_mask.clone()
    mask[2, 0] = True
    with pytest.raises(BatchError, match=r"response_mask\[2, 0\] is True \(sample 2\)"):
        validate_batch(_batch(response_mask=mask), **LIMITS)
    with pytest.raises(BatchError, match="advantages must be"):
        validate_batch(_batch(advantages=torch.ones(B + 1)), **LIMITS)
    with pytest.raises(BatchError, match="advantages of sample 1 are not finite"):
        validate_batch(_batch(advantages=torch.tensor([0.0, float("nan"), 1.0])), **LIMITS)


def test_lengths_derived_from_the_masks():
    batch = _batch(sequence_lengths=None)
    assert batch.lengths().tolist() == [10, 7, 5]
    assert _batch(sequence_lengths=None, prompt_lengths=None).lengths().tolist() == [10, 7, 5]


def test_from_rollouts_keeps_the_layout():
    samples = [
        RolloutSample(prompt_index=0, sample_index=j, prompt_token_ids=torch.tensor([5, 6, 7]),
                      response_token_ids=torch.arange(10, 10 + r), rollout_logprobs=-torch.rand(r), finish_reason="stop",
                      stop_reason=None, weight_version=0,
                      routed_experts=torch.randint(0, 4, (3 + r, 2, 2), dtype=torch.int16), routed_experts_include_prompt=True)
        for j, r in enumerate((4, 2))
    ]
    padded = Rollouts(samples=samples, n_samples=2, weight_version=0).to_padded()
    batch = train_batch_from_rollouts(padded, torch.tensor([1.0, -1.0]))
    assert batch.sequence_lengths.tolist() == [7, 5]
    assert batch.response_mask[1].tolist() == [False] * 3 + [True] * 2 + [False] * 2
    assert batch.rollout_logprobs[0, 3] == samples[0].rollout_logprobs[0]  # token-aligned, as the actor's logprobs
    validate_batch(batch, vocab_size=100, max_positions=64, num_moe_layers=2, topk=2, num_experts=4,
                   complete_routes=("routed_experts",))
    unpadded = train_batch_from_rollouts(Rollouts(samples=samples, n_samples=2, weight_version=0), torch.tensor([1.0, -1.0]))
    assert torch.equal(unpadded.tokens, batch.tokens) and torch.equal(unpadded.routed_experts, batch.routed_experts)
