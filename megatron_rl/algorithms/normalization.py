"""The normalisation contract: one set of global denominators per optimizer step.

One optimizer step sees its batch split over D data-parallel ranks (x CP
context-parallel ranks) and M microbatches per rank. Every policy loss in
`megatron_rl.algorithms.losses` returns, for one microbatch, ``loss_sum``: the
part of the *whole-batch* loss that the microbatch's tokens contribute, already
divided by the step's global denominator. Hence

    whole-batch loss = sum over ranks r, microbatches m of loss_sum[r, m]

exactly, for every loss and every split, and so is its gradient. The
denominators are computed once per step, before the first microbatch, by
`compute_loss_denominators` (one all-reduce of a few integers):

* ``global_num_tokens``: response tokens (``response_mask`` true) of the step,
  over all microbatches and all DP(+CP) ranks. Token-mean losses (dapo) divide
  by it.
* ``global_num_sequences``: sequences with at least one response token, over
  all microbatches and ranks. Sequence-mean losses (grpo, gspo, gspo_token)
  divide by it; a row with no valid token (padding, an overlong-filtered
  response) counts for nothing anywhere.
* ``max_response_tokens``: Dr. GRPO's constant; dr_grpo divides by
  ``global_num_sequences * max_response_tokens``.

What the caller (the actor) must do with ``loss_sum``
----------------------------------------------------
The gradient that reaches the optimizer must be d(sum of all loss_sum)/d(theta),
i.e. gradients are *summed* over microbatches and ranks, never averaged.
Frameworks average by default, so multiply ``loss_sum`` by the factor they
divide by before backward (`framework_loss_scale` computes it). In
megatron-core (0.16; pipeline_parallel/schedules.py ``forward_step`` and
distributed/distributed_data_parallel.py), with D the data-parallel size
*without* CP:

* ``calculate_per_token_loss=False``, loss function returns 2 values
  ``(loss, metrics)``: the schedule multiplies the loss by CP and divides it by
  M (num_microbatches); DDP scales gradients by 1/(D x CP) (the dp-cp group)
  before its all-reduce. Return ``loss_sum * M * D``
  (``framework_loss_scale(M, D, CP, schedule_multiplies_by_context_parallel=True)``).
* ``calculate_per_token_loss=False``, 3 values ``(loss, num_tokens, metrics)``:
  the schedule divides by max(num_tokens, 1) and by M, DDP by D x CP. Return
  ``(loss_sum * M * D * CP, 1, metrics)`` (``framework_loss_scale(M, D, CP)``).
* ``calculate_per_token_loss=True`` (3 values): no 1/M and no DDP scaling, but
  ``finalize_model_grads`` divides the gradients by the sum of the returned
  ``num_tokens`` over microbatches and DP x CP ranks. Return
  ``(loss_sum * N, n_local, metrics)`` where the n_local add up to N over the
  step, e.g. N = ``global_num_tokens`` and n_local = the microbatch's response
  tokens as counted by `compute_loss_denominators`.
* plain torch DDP (averages over its world of D ranks, no accumulation
  scaling): ``loss_sum * D``; a hand-written loop that sums gradients: ``loss_sum``.

PP: only the last stage computes the loss; compute the denominators on every
stage (one small all-reduce) so all stages agree. Metrics are never scaled.

Sequences split across rows
---------------------------
Each row of a loss's [B, T] inputs is one sequence's response. Token-level
losses (dapo, dr_grpo) are exact however a sequence's tokens are spread over
rows, microbatches or CP ranks, provided ``global_num_sequences`` counts each
sequence once: pass ``sequence_ids`` so that rows of one sequence count once.
Sequence-level losses (grpo, gspo, gspo_token) need each sequence *whole in one
row* (their per-sequence length and GSPO's geometric-mean ratio are not sums of
per-token terms); with ``sequence_ids`` given, the denominators record how many
sequences were found in more than one row, and those losses raise if any was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class LossDenominators:
    """Global counts of one optimizer step (all microbatches, all DP(+CP) ranks)."""

    global_num_tokens: int
    """Response tokens of the step (response_mask true)."""
    global_num_sequences: int
    """Sequences of the step with at least one response token."""
    max_response_tokens: int = 0
    """Dr. GRPO's constant MAX_TOKENS (the generation length limit); 0 = not set."""
    num_split_sequences: int | None = None
    """Sequences found in more than one row (None: not checked, no sequence_ids given)."""
    context_parallel_group: Any = field(default=None, compare=False, repr=False)
    """With context parallelism: the CP group over which each row's tokens are split (every CP rank
    holds the same rows, each a part of their tokens). Sequence-level terms then sum a row's
    log-ratios and token counts over it (`context_parallel_row_sum`) before the ratio is formed."""
    context_parallel_rank: int = 0
    """This rank's place in that group: rank 0 reports each sequence-level value once (`count_once`)."""

    def __post_init__(self) -> None:
        if self.global_num_tokens < 0 or self.global_num_sequences < 0 or self.max_response_tokens < 0:
            raise ValueError(f"{self}: counts must be >= 0")

    @property
    def tokens(self) -> int:
        """global_num_tokens, at least 1 (a step without tokens then gives loss 0, gradient 0)."""
        return max(self.global_num_tokens, 1)

    @property
    def sequences(self) -> int:
        """global_num_sequences, at least 1."""
        return max(self.global_num_sequences, 1)


def compute_loss_denominators(
    response_masks: Sequence[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    max_response_tokens: int = 0,
    sequence_ids: Sequence[torch.Tensor] | None = None,
    num_sequence_ids: int | None = None,
) -> LossDenominators:
    """Count the step's response tokens and sequences over microbatches and ranks (one all-reduce).

    Args:
        response_masks: this rank's microbatches, each ``[B_m, T_m] bool`` (T_m may differ).
        group: the data-parallel group *including context-parallel ranks*; the
            counts are summed over it. ``None`` means no communication: the
            counts are this process's own (single-process training, or tests).
        max_response_tokens: Dr. GRPO's MAX_TOKENS, carried into the result.
        sequence_ids: optional, one ``[B_m] int64`` per microbatch: the step-wide id
            (0 <= id < num_sequence_ids) of the sequence each row belongs to;
            negative ids mark padding rows. With them each sequence is counted
            once even when its tokens span several rows, and rows of one
            sequence in several places are counted into ``num_split_sequences``.
        num_sequence_ids: number of sequence ids of the step (the same on every rank).

    Host synchronisation: one, to turn the counts into Python ints; this runs
    once per optimizer step, outside the loss.
    """
    masks = list(response_masks)
    if not masks:
        raise ValueError("compute_loss_denominators needs this rank's microbatch masks (got none)")
    for i, mask in enumerate(masks):
        if mask.dtype != torch.bool or mask.dim() != 2:
            raise ValueError(f"response_masks[{i}]: expected a [B, T] bool tensor, got {tuple(mask.shape)} {mask.dtype}")
    num_tokens = sum(mask.sum(dtype=torch.int64) for mask in masks).reshape(1)
    if sequence_ids is None:
        num_sequences = sum(mask.any(dim=-1).sum(dtype=torch.int64) for mask in masks).reshape(1)
        counts = torch.cat([num_tokens, num_sequences])
    else:
        rows_per_sequence = _rows_per_sequence(masks, sequence_ids, num_sequence_ids)
        counts = torch.cat([num_tokens, rows_per_sequence])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    host = counts.tolist()
    if sequence_ids is None:
        return LossDenominators(global_num_tokens=host[0], global_num_sequences=host[1], max_response_tokens=max_response_tokens)
    rows = host[1:]
    return LossDenominators(
        global_num_tokens=host[0],
        global_num_sequences=sum(1 for r in rows if r > 0),
        max_response_tokens=max_response_tokens,
        num_split_sequences=sum(1 for r in rows if r > 1),
    )


def _rows_per_sequence(masks: list[torch.Tensor], sequence_ids: Sequence[torch.Tensor], num_sequence_ids: int | None) -> torch.Tensor:
    """[num_sequence_ids] int64: how many rows with response tokens each sequence id has on this rank."""
    ids_list = list(sequence_ids)
    if num_sequence_ids is None or num_sequence_ids < 1:
        raise ValueError(f"num_sequence_ids={num_sequence_ids}: give the step's number of sequence ids (>= 1) with sequence_ids")
    if len(ids_list) != len(masks):
        raise ValueError(f"{len(ids_list)} sequence_ids tensors for {len(masks)} microbatch masks: give one per microbatch")
    rows = torch.zeros(num_sequence_ids, dtype=torch.int64, device=masks[0].device)
    for i, (mask, ids) in enumerate(zip(masks, ids_list)):
        if ids.shape != mask.shape[:1]:
            raise ValueError(f"sequence_ids[{i}] has shape {tuple(ids.shape)}, its mask has {mask.shape[0]} rows")
        ids = ids.to(device=rows.device, dtype=torch.int64)
        if bool((ids >= num_sequence_ids).any()):
            raise ValueError(f"sequence_ids[{i}] holds ids >= num_sequence_ids={num_sequence_ids}: ids must lie in [0, num_sequence_ids)")
        real = ids >= 0
        rows.index_add_(0, ids[real], mask[real].any(dim=-1).to(torch.int64))
    return rows


class _SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce SUM over a group; backward: the incoming gradient unchanged.

    Each rank of the group goes on to use the sum in a term that `count_once` keeps in
    value on one rank only but in gradient on all: d(total)/d(part_r) = d(term)/d(sum),
    which is exactly the gradient each rank receives, with no collective in backward.
    """

    @staticmethod
    def forward(ctx, part, group):
        total = part.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def context_parallel_row_sum(per_token: torch.Tensor, denom: LossDenominators) -> torch.Tensor:
    """[B, T] -> [B]: each row's sum over its tokens, on every CP rank the whole sequence's (gradient
    to the local tokens, see `_SumOverGroup`); a plain sum without context parallelism."""
    partial = per_token.sum(dim=-1)
    group = denom.context_parallel_group
    if group is None or dist.get_world_size(group) == 1:
        return partial
    if not partial.requires_grad:
        partial = partial.clone()
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
        return partial
    return _SumOverGroup.apply(partial, group)


def count_once(per_sequence: torch.Tensor, denom: LossDenominators) -> torch.Tensor:
    """A per-sequence term every CP rank computed in full: its value on CP rank 0 only (so the sum over
    ranks counts it once), its gradient on every rank (each rank's gradient reaches only its own tokens)."""
    if denom.context_parallel_group is None or denom.context_parallel_rank == 0:
        return per_sequence
    return per_sequence - per_sequence.detach()


def require_whole_sequences(denom: LossDenominators, loss_name: str) -> None:
    """Raise if the denominators saw a sequence in several rows (sequence-level losses need whole rows)."""
    if denom.num_split_sequences:
        raise ValueError(
            f"loss {loss_name!r} is sequence-level but {denom.num_split_sequences} sequence(s) of this step have "
            "response tokens in more than one row (split across microbatches, ranks or context-parallel chunks): "
            "keep each sequence whole in one row of one microbatch (no context parallelism for its response), "
            "or use a token-level loss (dapo, dr_grpo)"
        )


def framework_loss_scale(
    num_microbatches: int,
    data_parallel_size: int,
    context_parallel_size: int = 1,
    *,
    schedule_divides_by_microbatches: bool = True,
    ddp_averages: bool = True,
    schedule_multiplies_by_context_parallel: bool = False,
) -> int:
    """The factor to multiply ``loss_sum`` by before backward so that the framework's averaging cancels.

    Defaults: megatron-core with a 3-value loss function and
    calculate_per_token_loss=False: M x D x CP (the schedule divides by M, DDP by
    D x CP). A 2-value loss function also gets multiplied by CP in the schedule:
    pass ``schedule_multiplies_by_context_parallel=True`` (-> M x D). Gradients then
    equal d(sum of loss_sum over all microbatches and ranks)/d(theta).
    """
    if num_microbatches < 1 or data_parallel_size < 1 or context_parallel_size < 1:
        raise ValueError(
            f"num_microbatches={num_microbatches}, data_parallel_size={data_parallel_size}, "
            f"context_parallel_size={context_parallel_size}: all must be >= 1"
        )
    scale = 1
    if schedule_divides_by_microbatches:
        scale *= num_microbatches
    if ddp_averages:
        scale *= data_parallel_size * context_parallel_size
    if schedule_multiplies_by_context_parallel:
        if scale % context_parallel_size:
            raise ValueError("schedule_multiplies_by_context_parallel needs ddp_averages over D x CP to cancel against")
        scale //= context_parallel_size
    return scale


__all__ = [
    "LossDenominators",
    "compute_loss_denominators",
    "context_parallel_row_sum",
    "count_once",
    "framework_loss_scale",
    "require_whole_sequences",
]
