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


def _route_samples() -> list:
    """Samples of uneven lengths, with and without prompt rows in their routes, in int8 and int16."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for j, (prompt, response, include_prompt, dtype) in enumerate(
        ((3, 4, True, torch.int8), (2, 6, False, torch.int16), (4, 1, True, torch.int8), (1, 3, True, torch.int8))
    ):
        rows = prompt + response if include_prompt else response
        samples.append(RolloutSample(
            prompt_index=j, sample_index=0, prompt_token_ids=torch.arange(5, 5 + prompt),
            response_token_ids=torch.arange(10, 10 + response), rollout_logprobs=-torch.rand(response, generator=g),
            finish_reason="stop", stop_reason=None, weight_version=0,
            routed_experts=torch.randint(0, 4, (rows, 2, 2), generator=g).to(dtype), routed_experts_include_prompt=include_prompt))
    return samples


def _padded_by_hand(samples, dtype=torch.int16) -> torch.Tensor:
    """[B, T, L, K]: each sample's routes written at its positions (after its prompt when they exclude it), -1 elsewhere."""
    total = max(s.prompt_length + s.response_length for s in samples)
    out = torch.full((len(samples), total, *samples[0].routed_experts.shape[1:]), -1, dtype=dtype)
    for b, s in enumerate(samples):
        start = 0 if s.routed_experts_include_prompt else s.prompt_length
        out[b, start : start + s.routed_experts.shape[0]] = s.routed_experts
    return out


def test_packed_routes_hold_what_padding_holds_and_no_padding():
    # The reference: each sample's routes written at its positions of a [B, T, L, K], -1 elsewhere (by hand).
    from megatron_rl.actor import PackedRoutes
    from megatron_rl.actor.distribute import select_rows

    rollouts = Rollouts(samples=_route_samples(), n_samples=1, weight_version=0)
    padded = _padded_by_hand(rollouts.samples)  # [4, 8, 2, 2] int16: one sample is int16
    assert torch.equal(rollouts.to_padded().routed_experts, padded) and rollouts.to_padded().routed_experts.dtype == torch.int16
    batch = train_batch_from_rollouts(rollouts.to_padded(pack_routes=True), torch.zeros(4))
    packed = batch.routed_experts
    assert isinstance(packed, PackedRoutes) and packed.values.dtype == torch.int16 == padded.dtype
    assert packed.lengths().tolist() == [7, 8, 5, 4] and packed.values.shape == (24, 2, 2)  # 24 positions, not 4 x 8
    assert torch.equal(packed.to_padded(8), padded)
    assert bool((packed.values[7:9] == -1).all())  # sample 1's prompt: not captured
    rows, positions = torch.tensor([3, 0, 1, 1]), torch.tensor([2, 6, 0, 7])
    assert torch.equal(packed.at(rows, positions), padded[rows, positions])
    picked = packed.select(torch.tensor([2, 0]))
    assert torch.equal(picked.to_padded(7), padded[[2, 0], :7])
    # a share (actor.distribute's select_rows) keeps its rows' routes, unpadded
    share = select_rows(batch, [0, 2])
    assert torch.equal(share.routed_experts.to_padded(share.seq_len), padded[[0, 2], :7])
    assert share.routed_experts.values.shape[0] == 12
    assert torch.equal(batch.select(torch.tensor([1])).routed_experts.to_padded(8), padded[[1]])
    limits = dict(vocab_size=100, max_positions=64, num_moe_layers=2, topk=2, num_experts=4)
    validate_batch(batch, **limits)  # sample 1's prompt holds no routes: fine unless they are replayed
    with pytest.raises(BatchError, match=r"routed_experts\[1, 0, 0, 0\] = -1 \(sample 1, position 0, MoE layer 0\): no captured "
                                         r"route \(-1\) on a real token, which replay needs in 1 sample\(s\)"):
        validate_batch(batch, complete_routes=("routed_experts",), **limits)


def test_packed_routes_are_refused_as_padded_routes_are():
    # The same bad routes, padded and packed, give the same message.
    from megatron_rl.actor import PackedRoutes

    rollouts = Rollouts(samples=[s for s in _route_samples() if s.routed_experts_include_prompt], n_samples=1, weight_version=0)
    padded_batch = train_batch_from_rollouts(rollouts, torch.zeros(3))
    packed_batch = train_batch_from_rollouts(rollouts.to_padded(pack_routes=True), torch.zeros(3))
    limits = dict(vocab_size=100, max_positions=64, num_moe_layers=2, topk=2, num_experts=4)
    packed_batch.routed_experts.values[7 + 3, 1, 0] = 9  # sample 1, position 3
    padded_batch.routed_experts[1, 3, 1, 0] = 9
    packed_batch.routed_experts.values[-1, 0, 1] = 4  # sample 2, position 3
    padded_batch.routed_experts[2, 3, 0, 1] = 4
    for batch in (padded_batch, packed_batch):
        with pytest.raises(BatchError, match=r"routed_experts\[1, 3, 1, 0\] = 9 \(sample 1, position 3, MoE layer 1\): expert "
                                             r"ids outside \[0, 4\) in 2 sample\(s\)"):
            validate_batch(batch, **limits)
        with pytest.raises(BatchError, match=r"the routes describe 2 MoE layer\(s\) x top-2, the model has 3 x top-2"):
            validate_batch(batch, **{**limits, "num_moe_layers": 3})
    routes = packed_batch.routed_experts
    short = packed_batch.replace(routed_experts=PackedRoutes(routes.values[:-1], routes.offsets - torch.tensor([0, 0, 0, 1])))
    with pytest.raises(BatchError, match="holds 3 positions of sample 2, which has 4 tokens: the routes are not aligned"):
        validate_batch(short, **limits)


def test_packed_routes_that_do_not_fit_their_samples_are_named():
    from megatron_rl.actor import PackedRoutes

    samples = _route_samples()
    samples[2].routed_experts = None
    with pytest.raises(ValueError, match="sample 2 has no routed experts while sample 0 has"):
        PackedRoutes.from_samples(samples)
    batch = train_batch_from_rollouts(Rollouts(samples=_route_samples(), n_samples=1, weight_version=0).to_padded(pack_routes=True),
                                      torch.zeros(4))
    routes = batch.routed_experts
    limits = dict(vocab_size=100, max_positions=64, num_moe_layers=2, topk=2, num_experts=4)
    for offsets in (routes.offsets + 1, routes.offsets[:-1].tolist() + [30]):  # not from 0; past the values' 24 rows
        bad = batch.replace(routed_experts=PackedRoutes(routes.values, torch.as_tensor(offsets)))
        with pytest.raises(BatchError, match=r"not aligned with `tokens` \(PackedRoutes.from_samples of the batch's samples"):
            validate_batch(bad, **limits)


def test_the_trainers_step_batch_holds_its_engine_routes_packed():
    # experience.assemble_experience (the sync and async trainers' step) pads the tokens and packs the routes; the
    # step's TrainBatch carries them to actor.distribute as they are, equal to the padded routes position for position.
    from types import SimpleNamespace

    from megatron_rl.actor import PackedRoutes
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.experience import assemble_experience
    from tests.e2e.train_runs import REPO

    cfg = load_config(RLConfig, str(REPO / "configs" / "tiny-gspo.yaml"), ["rollout.n_samples=2"])
    samples = _route_samples()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    experience = assemble_experience(samples, rewards, rewards, torch.zeros(4, dtype=torch.bool), torch.tensor([0, 0, 1, 1]),
                                     0, cfg, SimpleNamespace(pad_id=0))
    batch = train_batch_from_rollouts(experience.rollouts, experience.advantages)
    assert isinstance(batch.routed_experts, PackedRoutes) and batch.routed_experts.values.shape[0] == 24
    padded = _padded_by_hand(samples)
    assert torch.equal(batch.routed_experts.to_padded(batch.seq_len), padded)
