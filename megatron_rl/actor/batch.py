"""The actor's input: one RL step's sequences as right-padded tensors, and their checks.

Alignment: every ``[B, T]`` per-token tensor is indexed by the position of the
token it scores. ``logprobs[b, t] = log pi(tokens[b, t] | tokens[b, :t])`` (the
model's output at position t - 1 predicts token t), ``response_mask[b, t]``
is True iff ``tokens[b, t]`` is a response token the loss trains on. Column 0
is never a response token (nothing predicts the first token). This is the
layout of `megatron_rl.data.batch.PaddedRollouts`, so the conversion is a copy
of references (`train_batch_from_rollouts`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_rl.data.batch import PackedRoutes

if TYPE_CHECKING:
    from megatron_rl.actor.routing import RankRoutes


class BatchError(ValueError):
    """A batch the actor cannot train on; the message names the sample and the fix."""


@dataclass(kw_only=True)
class TrainBatch:
    """One RL step's sequences (B rows, right-padded to T tokens): the whole step, or one DP rank's share.

    The trainer gives each rank its share (`Actor.distribute`: rows balanced by
    token count, `row_ids` set). A whole batch (row_ids None) given to every rank
    also works: each rank then takes its own rows, and results are assembled
    over DP (tests and tools that hold the whole batch anyway).
    """

    tokens: torch.Tensor
    """[B, T] int64: prompt then response, right-padded (the padding value is irrelevant)."""
    response_mask: torch.Tensor
    """[B, T] bool: True on the response tokens the loss trains on (column 0 is always False)."""
    advantages: torch.Tensor
    """[B] float32 (one per sequence) or [B, T] float32 (per token, gspo_token)."""
    prompt_lengths: torch.Tensor | None = None
    """[B] int64: prompt tokens of each row (informational; used to name positions in errors)."""
    sequence_lengths: torch.Tensor | None = None
    """[B] int64: real tokens (prompt + response) of each row; None = derived from the masks."""
    old_logprobs: torch.Tensor | None = None
    """[B, T] float32: log pi_old of each token (from `Actor.compute_logprobs`); needed by train_step."""
    old_logprobs_first_from_training: bool = False
    """Set by `Actor.prepare_batch` (train.old_logprobs): the rows of the step's first mini-batch have no
    old_logprobs of their own (0); that mini-batch's training forward gives them. With one mini-batch
    old_logprobs is then None."""
    rollout_logprobs: torch.Tensor | None = None
    """[B, T] float32: the rollout engine's logprob of each response token (TIS, mismatch metrics)."""
    ref_logprobs: torch.Tensor | None = None
    """[B, T] float32: the reference model's logprobs (needed when algorithm.beta > 0)."""
    token_versions: torch.Tensor | None = None
    """[B, T] int64: the weight version each response token was sampled with (-1 elsewhere); with
    policy_version, response tokens more than train.max_staleness versions old leave the loss."""
    policy_version: int | None = None
    """The weight version of the policy this step trains (the trainer's weights when the step starts)."""
    routed_experts: "torch.Tensor | PackedRoutes | RankRoutes | None" = None
    """[B, T, L, K] int8 / int16: the engine's top-k experts of each token per MoE layer (R3 source);
    L = MoE layers in model order, K = experts per token; -1 where not captured (padding). The trainer's
    step batch holds them as `PackedRoutes` (no padding), which ``Actor.distribute`` turns into each
    share's: under R3 a `routing.RankRoutes` (only what this rank replays), else the [B, T, L, K] tensor."""
    old_routed_experts: "torch.Tensor | RankRoutes | None" = None
    """The trainer's own top-k experts in the old-policy forward (R2 source), from
    ``Actor.compute_logprobs(batch, record_routes=True)``: a `routing.RankRoutes` holding only
    what this rank's routers computed (keyed by row and position of this batch), or a
    [B, T, L, K] int16 tensor."""
    row_ids: torch.Tensor | None = None
    """[B] int64: for a data-parallel rank's share (`Actor.distribute`), each row's index in the
    step's batch; None = the whole step's batch (then every rank must hold the same one)."""
    step_lengths: torch.Tensor | None = None
    """[B_step] int64: with row_ids, the lengths of every row of the step (the plan is computed from
    them, so microbatch counts and shapes agree across DP ranks)."""

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def lengths(self) -> torch.Tensor:
        """[B] int64 real tokens per row: sequence_lengths, else max(prompt length, last response token + 1)."""
        if self.sequence_lengths is not None:
            return self.sequence_lengths.to(torch.int64)
        positions = torch.arange(1, self.seq_len + 1, dtype=torch.int64)
        last_response = (self.response_mask.to(torch.int64) * positions).amax(dim=1)
        if self.prompt_lengths is not None:
            return torch.maximum(last_response, self.prompt_lengths.to(torch.int64))
        return last_response

    def replace(self, **changes) -> "TrainBatch":
        """A copy with some fields replaced (tensors are shared, not copied)."""
        return dataclasses.replace(self, **changes)

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        """The rows `rows` (a [b] int64 index) as a new batch."""
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, PackedRoutes):
                fields[f.name] = value.select(rows)
                continue
            if f.name in ("routed_experts", "old_routed_experts") and value is not None and not isinstance(value, torch.Tensor):
                raise BatchError(f"batch.{f.name} holds this rank's routes keyed by row: select rows before "
                                 f"actor.distribute / actor.prepare_batch, or drop them with batch.replace({f.name}=None)")
            fields[f.name] = value[rows] if isinstance(value, torch.Tensor) else value
        return TrainBatch(**fields)


def _name_position(batch: TrainBatch, b: int, t: int) -> str:
    where = f"sample {b}, position {t}"
    if batch.prompt_lengths is not None:
        where += f" (response token {t - int(batch.prompt_lengths[b])})"
    return where


def check_finite(batch: TrainBatch, name: str, values: torch.Tensor | None, *, fix: str) -> None:
    """Raise BatchError naming the first sample whose `name` is NaN/inf on a response token."""
    if values is None:
        return
    bad = batch.response_mask & ~torch.isfinite(values)
    if bool(bad.any()):
        rows = torch.nonzero(bad.any(dim=1)).flatten().tolist()
        b = rows[0]
        t = int(torch.nonzero(bad[b])[0])
        raise BatchError(
            f"{name}[{b}, {t}] = {values[b, t].item()} ({_name_position(batch, b, t)}); {int(bad.sum())} non-finite "
            f"response token(s) in {len(rows)} sample(s) {rows[:8]}{'...' if len(rows) > 8 else ''}: {fix}"
        )


def validate_batch(
    batch: TrainBatch,
    *,
    vocab_size: int,
    max_positions: int,
    num_moe_layers: int = 0,
    topk: int = 0,
    num_experts: int = 0,
    complete_routes: tuple[str, ...] = (),
) -> None:
    """Check shapes, dtypes, token ids, lengths, finiteness and routed experts; raise BatchError naming the sample.

    complete_routes: the route fields that will be replayed, which must hold an expert
    for every real token (elsewhere -1 marks a position the engine did not capture).

    1. tokens and response_mask: shapes, dtypes, no response token at position 0;
    2. sequence lengths: within the model's positions and the padded width, the mask inside them;
    3. token ids of the real tokens inside the vocabulary;
    4. advantages: shape and finiteness;
    5. the per-token fields (logprobs, token versions): shapes, versions not newer than the policy, finite;
    6. routed experts: recorded on this batch and model, or valid expert ids.
    """
    _check_tokens_and_mask(batch)
    lengths = batch.lengths()
    _check_lengths(batch, lengths, max_positions)
    _check_token_ids(batch, lengths, vocab_size)
    _check_advantages(batch)
    _check_per_token_fields(batch)
    for name in ("routed_experts", "old_routed_experts"):
        routes = getattr(batch, name)
        if routes is not None and not isinstance(routes, (torch.Tensor, PackedRoutes)):  # routing.RankRoutes of this rank
            _check_rank_routes(routes, name, batch, num_moe_layers=num_moe_layers, topk=topk)
        elif routes is not None:
            check_routes(routes, name, lengths, num_moe_layers=num_moe_layers, topk=topk, num_experts=num_experts,
                         batch_shape=(batch.batch_size, batch.seq_len), complete=name in complete_routes)


def _check_tokens_and_mask(batch: TrainBatch) -> None:
    tokens, mask = batch.tokens, batch.response_mask
    if tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise BatchError(f"tokens must be a [B, T] int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}")
    if tokens.shape[0] == 0:
        raise BatchError("the batch has no samples")
    if mask.shape != tokens.shape or mask.dtype != torch.bool:
        raise BatchError(f"response_mask must be [B, T] = {tuple(tokens.shape)} bool, got {tuple(mask.shape)} {mask.dtype}")
    if bool(mask[:, 0].any()):
        b = int(torch.nonzero(mask[:, 0])[0])
        raise BatchError(
            f"response_mask[{b}, 0] is True (sample {b}): position 0 has no logprob (nothing predicts the first token); "
            "the mask marks target tokens aligned with `tokens` (prompts must be at least one token long)"
        )


def _check_lengths(batch: TrainBatch, lengths: torch.Tensor, max_positions: int) -> None:
    B, T = batch.tokens.shape
    if lengths.shape != (B,):
        raise BatchError(f"sequence_lengths must be [B] = [{B}], got {tuple(lengths.shape)}")
    too_long = torch.nonzero(lengths > max_positions).flatten().tolist()
    if too_long:
        b = too_long[0]
        raise BatchError(
            f"sample {b} has {int(lengths[b])} tokens, more than the model's max_position_embeddings={max_positions} "
            f"({len(too_long)} sample(s) too long: {too_long[:8]}): lower rollout.max_prompt_tokens + "
            "rollout.max_new_tokens to at most that, or truncate the sequences before training"
        )
    if bool((lengths > T).any()) or bool((lengths < 1).any()):
        b = int(torch.nonzero((lengths > T) | (lengths < 1))[0])
        raise BatchError(f"sample {b}: sequence length {int(lengths[b])} outside [1, T={T}]")
    beyond = batch.response_mask & (torch.arange(T).unsqueeze(0) >= lengths.unsqueeze(1))
    if bool(beyond.any()):
        b = int(torch.nonzero(beyond.any(dim=1))[0])
        raise BatchError(f"sample {b}: response_mask is True past its sequence length {int(lengths[b])}")


def _check_token_ids(batch: TrainBatch, lengths: torch.Tensor, vocab_size: int) -> None:
    tokens = batch.tokens
    real = torch.arange(batch.seq_len).unsqueeze(0) < lengths.unsqueeze(1)
    bad_ids = real & ((tokens < 0) | (tokens >= vocab_size))
    if bool(bad_ids.any()):
        b, t = (int(i) for i in torch.nonzero(bad_ids)[0])
        raise BatchError(
            f"tokens[{b}, {t}] = {int(tokens[b, t])} ({_name_position(batch, b, t)}) is outside the model's vocabulary "
            f"[0, {vocab_size}): the tokenizer does not match the model"
        )


def _check_advantages(batch: TrainBatch) -> None:
    B, T = batch.tokens.shape
    adv = batch.advantages
    if tuple(adv.shape) not in ((B,), (B, T)):
        raise BatchError(f"advantages must be [B] = [{B}] or [B, T] = [{B}, {T}], got {tuple(adv.shape)}")
    bad_adv = ~torch.isfinite(adv) if adv.dim() == 1 else (batch.response_mask & ~torch.isfinite(adv)).any(dim=1)
    if bool(bad_adv.any()):
        b = int(torch.nonzero(bad_adv.reshape(B, -1).any(dim=1))[0])
        raise BatchError(f"advantages of sample {b} are not finite: check the rewards and the advantage estimator's std")


def _check_per_token_fields(batch: TrainBatch) -> None:
    tokens = batch.tokens
    for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs", "token_versions"):
        values = getattr(batch, name)
        if values is not None and values.shape != tokens.shape:
            raise BatchError(f"{name} has shape {tuple(values.shape)}, tokens has {tuple(tokens.shape)}")
    if batch.token_versions is not None and batch.policy_version is not None:
        newer = batch.response_mask & (batch.token_versions > batch.policy_version)
        if bool(newer.any()):
            b, t = (int(i) for i in torch.nonzero(newer)[0])
            raise BatchError(
                f"token_versions[{b}, {t}] = {int(batch.token_versions[b, t])} ({_name_position(batch, b, t)}) is newer than "
                f"the policy being trained (policy_version={batch.policy_version}): set policy_version to the trainer's "
                "weight version when the step starts"
            )
    check_finite(batch, "rollout_logprobs", batch.rollout_logprobs,
                 fix="the rollout engine returned NaN/inf logprobs; drop these samples or check the engine's dtype (fp16 overflow)")
    check_finite(batch, "old_logprobs", batch.old_logprobs,
                 fix="the old-policy forward diverged (check the weights for NaN) or the batch was corrupted")
    check_finite(batch, "ref_logprobs", batch.ref_logprobs,
                 fix="the reference model's forward diverged (check its weights for NaN)")


def _check_rank_routes(routes: "RankRoutes", name: str, batch: TrainBatch, *, num_moe_layers: int, topk: int) -> None:
    """A rank's recorded routes (`routing.RankRoutes`) belong to this batch's shape and this model's MoE layers."""
    shape = (batch.batch_size, batch.seq_len)
    if tuple(routes.batch_shape) != shape or routes.num_moe_layers != num_moe_layers or routes.topk != topk:
        raise BatchError(
            f"batch.{name} was recorded on a [B, T] = {tuple(routes.batch_shape)} batch with {routes.num_moe_layers} MoE "
            f"layers x top-{routes.topk}; this batch is {shape} and the model {num_moe_layers} x top-{topk}: record "
            "the routes on this batch with actor.prepare_batch(batch)"
        )


def check_routes(
    routes: "torch.Tensor | PackedRoutes",
    name: str,
    lengths: torch.Tensor,
    *,
    num_moe_layers: int,
    topk: int,
    num_experts: int,
    batch_shape: tuple[int, int],
    complete: bool = True,
) -> None:
    """routes must be [B, T, L, K] integers in [-1, E) (or `PackedRoutes` of the rows' lengths); with `complete`,
    no -1 on a real token (replay needs them)."""
    B, T = batch_shape
    if num_moe_layers == 0:
        raise BatchError(f"batch.{name} is set but the model has no MoE layers: drop it (rollout.return_routed_experts=false)")
    packed = isinstance(routes, PackedRoutes)
    values = routes.values if packed else routes
    expected = (B, T, num_moe_layers, topk)
    if packed:  # [B, (each row's length), L, K]
        offsets = routes.offsets
        got = (routes.batch_size, "...", *values.shape[1:])
        aligned = (values.dim() == 3 and routes.batch_size == B and int(offsets[0]) == 0
                   and int(offsets[-1]) == values.shape[0] and bool((offsets.diff() >= 0).all()))
        fix = "PackedRoutes.from_samples of the batch's samples, in the batch's order"
    else:
        got, aligned = tuple(values.shape), values.dim() == 4 and tuple(values.shape[:2]) == (B, T)
        fix = "pad them to the batch's [B, T] as PaddedRollouts does"
    if not aligned or tuple(got[2:]) != expected[2:]:
        hint = ""
        if aligned:
            hint = (f": the routes describe {got[2]} MoE layer(s) x top-{got[3]}, the model has {num_moe_layers} x "
                    f"top-{topk}; the engine ran another model than the trainer (check rollout and model paths)")
        elif packed or values.dim() == 4:
            hint = f": the routes are not aligned with `tokens` ({fix})"
        raise BatchError(f"batch.{name} has shape {got}, expected [B, T, L, K] = {list(expected)}{hint}")
    if packed and not torch.equal(routes.lengths(), lengths):
        b = int(torch.nonzero(routes.lengths() != lengths)[0])
        raise BatchError(f"batch.{name} holds {int(routes.lengths()[b])} positions of sample {b}, which has {int(lengths[b])} "
                         f"tokens: the routes are not aligned with `tokens` ({fix})")
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise BatchError(f"batch.{name} must hold integer expert ids (int8 / int16), got {values.dtype}")
    # flat [N, L, K] over the positions, with each one's (row, position) and whether it is a real token
    if packed:
        flat, (rows, positions) = values, routes.token_index()
        real = torch.ones(rows.shape, dtype=torch.bool)
    else:
        flat, rows, positions = values.reshape(B * T, *values.shape[2:]), torch.arange(B).repeat_interleave(T), torch.arange(T).repeat(B)
        real = positions < lengths[rows]
    out_of_range = (flat >= num_experts) | (flat < -1)
    missing = (flat == -1) & real[:, None, None] if complete else torch.zeros_like(out_of_range)
    for problem, what, fix in (
        (out_of_range, f"expert ids outside [0, {num_experts})", "the engine ran a model with another number of experts"),
        (missing, "no captured route (-1) on a real token, which replay needs",
         "the engine did not capture every position; set rollout.routed_experts_include_prompt=true (R3 replays the "
         "prompt's routing too) or use algorithm.routing_replay=R2"),
    ):
        per_position = problem.any(dim=2).any(dim=1)
        if bool(per_position.any()):
            n = int(torch.nonzero(per_position)[0])
            b, t = int(rows[n]), int(positions[n])
            layer, k = (int(i) for i in torch.nonzero(problem[n])[0])
            samples = int(torch.zeros(B, dtype=torch.bool).index_fill_(0, rows[per_position], True).sum())
            raise BatchError(
                f"batch.{name}[{b}, {t}, {layer}, {k}] = {int(flat[n, layer, k])} (sample {b}, position {t}, MoE "
                f"layer {layer}): {what} in {samples} sample(s); {fix}"
            )


def train_batch_from_rollouts(rollouts, advantages: torch.Tensor, policy_version: int | None = None) -> TrainBatch:
    """A TrainBatch from `megatron_rl.data.batch.PaddedRollouts` (same layout; `Rollouts` are padded first) and
    the advantages ([B] or [B, T]); policy_version: the weight version the step trains (see TrainBatch). Routes
    packed by sample (`PackedRoutes`, `Rollouts.to_padded(pack_routes=True)`: the trainer's, from
    experience.assemble_experience) are for ``Actor.distribute``, which makes each rank's share of them."""
    padded = rollouts.to_padded() if hasattr(rollouts, "to_padded") else rollouts
    return TrainBatch(
        tokens=padded.tokens,
        response_mask=padded.response_mask,
        advantages=advantages,
        prompt_lengths=padded.prompt_lengths,
        sequence_lengths=padded.prompt_lengths + padded.response_lengths,
        rollout_logprobs=padded.rollout_logprobs,
        routed_experts=padded.routed_experts,
        token_versions=padded.token_versions,
        policy_version=policy_version,
    )


__all__ = ["BatchError", "PackedRoutes", "TrainBatch", "check_finite", "check_routes", "train_batch_from_rollouts", "validate_batch"]
