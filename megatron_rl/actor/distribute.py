"""The step's batch, distributed: each data-parallel rank receives only its rows.

Rank 0 holds the step's experience (it drives the rollout engine). In
`scatter_shares` it

    1. checks the whole batch and assigns its rows to DP ranks (the caller's
       `assign`: the actor's plan, balanced by token count per mini-batch), so
       the rows a rank receives are exactly the rows its microbatches hold; a
       failure is sent to every rank and raised there, so no rank waits for a
       batch that never comes;
    2. scatters over the host (gloo) group: every rank receives the rows of its
       DP rank (its TP/PP/CP peers receive the same rows), cut to the share's
       longest row. Ranks waiting here during a long generation sit in a gloo
       collective: no NCCL watchdog runs out.

Per rank that is B/D rows instead of B: 1024 samples x 9,216 tokens on D = 8
is 128 rows, and the [B, T] float32/int64 fields (tokens, masks, rollout
logprobs: about 21 bytes a token, 200 MB for the whole step) shrink to 25 MB.

Each share carries `row_ids` (its rows' indices in the step's batch) and
`step_lengths` (the [B] lengths of every row: 8 bytes a row), so every rank
computes the same plan (microbatch counts and shapes agree across DP ranks)
without another exchange.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import TrainBatch


def broadcast_object(obj: Any, ctx) -> Any:
    """Rank 0's object on every rank (pickled over the host group)."""
    if ctx.world_size == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0, group=ctx.host_group)
    return holder[0]


def select_rows(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    """The rows `rows` (step indices, ascending) of a whole-step batch, cut to their longest row.

    Every tensor field indexed by row ([B, ...]) is indexed; per-token fields
    ([B, T, ...]) keep T_share = the longest selected row's length columns.
    """
    if batch.row_ids is not None:
        raise ValueError("select_rows takes the whole step's batch, not a share (row_ids is set)")
    lengths = batch.lengths()
    index = torch.tensor(rows, dtype=torch.int64)
    width = max(1, int(lengths[index].max())) if rows else 1
    changes = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != batch.batch_size:
            continue
        value = value[index]
        if value.dim() >= 2 and value.shape[1] == batch.seq_len:
            value = value[:, :width]
        changes[f.name] = value.clone()
    changes["sequence_lengths"] = lengths[index].clone()
    return batch.replace(**changes, row_ids=index, step_lengths=lengths.clone())


def scatter_shares(batch: TrainBatch | None, ctx, assign: Callable[[TrainBatch], list[list[int]]]) -> tuple[TrainBatch, int]:
    """(this rank's share, bytes it received): rank 0 passes the step's batch, every other rank None.

    `assign(batch)` runs on rank 0 and returns the step rows of each DP rank; it
    may raise (bad input): the exception is then raised on every rank.
    """
    dp_rank_of = _dp_rank_of_every_rank(ctx)
    if ctx.rank == 0:
        if batch is None:
            raise ValueError("scatter_shares: rank 0 must pass the step's batch")
        try:
            rows_per_dp = assign(batch)
            shares = [select_rows(batch, rows) for rows in rows_per_dp]
            payloads = [pickle.dumps(shares[dp_rank_of[r]]) for r in range(ctx.world_size)]
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            payloads = [pickle.dumps(exc)] * ctx.world_size
    if ctx.world_size == 1:
        received = payloads[0]
    else:
        holder: list[Any] = [None]
        dist.scatter_object_list(holder, payloads if ctx.rank == 0 else None, src=0, group=ctx.host_group)
        received = holder[0]
    share = pickle.loads(received)
    if isinstance(share, Exception):
        raise share
    return share, len(received)


def _dp_rank_of_every_rank(ctx) -> list[int]:
    """dp_rank of each global rank (one small all-gather over the host group)."""
    if ctx.world_size == 1:
        return [0]
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, torch.tensor([ctx.dp_rank], dtype=torch.int64), group=ctx.host_group)
    return [int(t) for t in gathered]


__all__ = ["broadcast_object", "scatter_shares", "select_rows"]
