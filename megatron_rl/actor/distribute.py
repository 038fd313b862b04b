"""The step's batch, distributed: each data-parallel rank receives only its rows.

Rank 0 holds the step's experience (it drives the rollout engine). In
`scatter_shares` it

    1. checks the whole batch and assigns its rows to DP ranks (the caller's
       `assign`: the actor's plan, balanced by token count per mini-batch), so
       the rows a rank receives are exactly the rows its microbatches hold; a
       failure is sent to every rank and raised there, so no rank waits for a
       batch that never comes;
    2. pickles each DP rank's rows once (cut to the share's longest row) and
       sends them to that DP rank's leader (its rank with tp = pp = cp = 0)
       over the host (gloo) group; each leader broadcasts them in its TP x PP x
       CP peers' gloo group (ctx.share_group). Ranks waiting here during a long
       generation sit in gloo: no NCCL watchdog runs out;
    3. with a `split` (R3's engine routes, of which each peer replays only its
       sequence-parallel / CP tokens at its stage's layers), the leader
       broadcasts the share without what it splits off and sends each peer only
       its own part.

Per rank that is B/D rows instead of B: 1024 samples x 9,216 tokens on D = 8
is 128 rows, and the [B, T] float32/int64 fields (tokens, masks, rollout
logprobs: about 21 bytes a token, 200 MB for the whole step) shrink to 25 MB.
Rank 0 pickles, holds and sends one copy of the step (D payloads), whatever
the model-parallel size W / D: one payload per rank would be W / D copies
(8 x 1.6 GB on 256 ranks at TP4 x PP2, more with R3's routes).

Each share carries `row_ids` (its rows' indices in the step's batch) and
`step_lengths` (the [B] lengths of every row: 8 bytes a row), so every rank
computes the same plan (microbatch counts and shapes agree across DP ranks)
without another exchange.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import PackedRoutes, TrainBatch


def broadcast_object(obj: Any, ctx) -> Any:
    """Rank 0's object on every rank (pickled over the host group)."""
    if ctx.world_size == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0, group=ctx.host_group)
    return holder[0]


def on_rank0(fn: Callable[[], Any], ctx) -> Any:
    """fn() on rank 0 only: its result there, None on every other rank. An exception it raises is raised on every
    rank (one broadcast), so no rank goes on to wait in a collective for a rank 0 that has stopped."""
    result, error, sent = None, None, None
    if ctx.rank == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error, sent = exc, _portable(exc)
    if ctx.world_size > 1:
        sent = broadcast_object(sent, ctx)
    if ctx.rank == 0 and error is not None:
        raise error
    if sent is not None:
        raise sent
    return result


def _portable(exc: Exception) -> Exception:
    """`exc`, or its one line as a RuntimeError where pickle cannot build it again on another rank (an exception
    whose __init__ takes more than its message)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - whatever pickle raises, the line still reaches the other ranks
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def select_rows(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    """The rows `rows` (step indices, ascending) of a whole-step batch, cut to their longest row.

    Every tensor field indexed by row ([B, ...]) is indexed; per-token fields
    ([B, T, ...]) keep T_share = the longest selected row's length columns; `PackedRoutes` keep
    the selected rows' routes, still without padding.
    """
    if batch.row_ids is not None:
        raise ValueError("select_rows takes the whole step's batch, not a share (row_ids is set)")
    lengths = batch.lengths()
    index = torch.tensor(rows, dtype=torch.int64)
    width = max(1, int(lengths[index].max())) if rows else 1
    changes = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, PackedRoutes):  # the rows' routes without padding (the trainer's: data.batch.PackedRoutes)
            changes[f.name] = value.select(index)
            continue
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != batch.batch_size:
            continue
        value = value[index]
        if value.dim() >= 2 and value.shape[1] == batch.seq_len:
            value = value[:, :width]
        changes[f.name] = value.clone()
    changes["sequence_lengths"] = lengths[index].clone()
    return batch.replace(**changes, row_ids=index, step_lengths=lengths.clone())


def scatter_shares(batch: TrainBatch | None, ctx, assign: Callable[[TrainBatch], list[list[int]]],
                   split: Callable[[TrainBatch], tuple[TrainBatch, dict[int, dict]]] | None = None) -> tuple[TrainBatch, int]:
    """(this rank's share, bytes it received): rank 0 passes the step's batch, every other rank None.

    `assign(batch)` runs on rank 0 and returns the step rows of each DP rank; it
    may raise (bad input): the exception is then raised on every rank.
    `split(share)` (optional) runs on each share group's leader: (the share every peer gets, {global rank: that
    rank's own fields}); the leader broadcasts the first and sends each peer only its own fields (R3's routes:
    each rank's cut), so a peer never receives what only the others use.
    """
    payloads: list[bytes] = []
    if ctx.rank == 0:
        if batch is None:
            raise ValueError("scatter_shares: rank 0 must pass the step's batch")
        try:
            # one pickle per DP rank, each share dropped once pickled: rank 0 holds the step and one copy of it
            rows_per_dp = assign(batch)
            if len(rows_per_dp) != ctx.dp_size:
                raise RuntimeError(f"assign gave rows for {len(rows_per_dp)} data-parallel ranks, the layout has {ctx.dp_size}")
            payloads = [pickle.dumps(select_rows(batch, rows)) for rows in rows_per_dp]
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            payloads = [pickle.dumps(_portable(exc))] * ctx.dp_size
    received = _to_leaders(payloads, ctx) if ctx.world_size > 1 else payloads[0]
    if ctx.share_group is not None and split is not None:
        return _split_to_peers(received, ctx, split)
    if ctx.share_group is not None:
        received = _to_peers(received, ctx)
    share = pickle.loads(received)
    if isinstance(share, Exception):
        raise share
    return share, len(received)


def _split_to_peers(received, ctx, split) -> tuple[TrainBatch, int]:
    """The leader splits its share (`split`), broadcasts the common part and sends each peer its own fields."""
    leader = ctx.dp_leaders[ctx.dp_rank]
    common, parts = received, None
    if ctx.rank == leader:
        share = pickle.loads(received)
        if not isinstance(share, Exception):
            try:
                base, parts = split(share)
                common = pickle.dumps(base)
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                common, parts = pickle.dumps(_portable(exc)), None
    common = _to_peers(common, ctx)
    base = pickle.loads(common)
    if isinstance(base, Exception):
        raise base
    own = _each_peer(parts, ctx, leader)
    received_bytes = len(received) if ctx.rank == leader else len(common) + len(own)
    return base.replace(**pickle.loads(own)), received_bytes


def _each_peer(parts: dict[int, dict] | None, ctx, leader: int):
    """The leader sends each rank of its share group that rank's pickled fields (size, then bytes); every rank
    returns its own."""
    if ctx.rank != leader:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src=leader, group=ctx.share_group, tag=_SIZE)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src=leader, group=ctx.share_group, tag=_DATA)
        return memoryview(data.numpy())
    works, sent, mine = [], [], None  # `sent` keeps each payload alive until its send is done
    for rank in dist.get_process_group_ranks(ctx.share_group):
        payload = pickle.dumps(parts.get(rank, {}))
        if rank == leader:
            mine = payload
            continue
        sent.append(payload)
        works.append(dist.isend(torch.tensor([len(payload)], dtype=torch.int64), dst=rank, group=ctx.share_group, tag=_SIZE))
        works.append(dist.isend(_as_tensor(payload), dst=rank, group=ctx.share_group, tag=_DATA))
    for work in works:
        work.wait()
    return mine


def _as_tensor(payload: bytes) -> torch.Tensor:
    """The bytes as a uint8 tensor, without a copy (sent only: the buffer is never written)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.frombuffer(payload, dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)


def _to_leaders(payloads: list[bytes], ctx) -> bytes | None:
    """Rank 0 sends DP rank d's payload to its leader (ctx.dp_leaders[d]) over the host group; a leader returns
    its payload, any other rank None. Sizes go first (8 bytes), each payload once, as it is (no second pickle)."""
    if ctx.rank == 0:
        works, mine = [], None
        for leader, payload in zip(ctx.dp_leaders, payloads):
            if leader == 0:
                mine = payload
                continue
            works.append(dist.isend(torch.tensor([len(payload)], dtype=torch.int64), dst=leader, group=ctx.host_group, tag=_SIZE))
            works.append(dist.isend(_as_tensor(payload), dst=leader, group=ctx.host_group, tag=_DATA))
        for work in works:
            work.wait()
        return mine
    if ctx.rank != ctx.dp_leaders[ctx.dp_rank]:
        return None
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=0, group=ctx.host_group, tag=_SIZE)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src=0, group=ctx.host_group, tag=_DATA)
    return memoryview(data.numpy())


def _to_peers(payload: bytes | None, ctx):
    """The leader's payload on every rank of its share group (its TP x PP x CP peers): size, then the bytes."""
    leader = ctx.dp_leaders[ctx.dp_rank]
    size = torch.tensor([len(payload) if ctx.rank == leader else 0], dtype=torch.int64)
    dist.broadcast(size, src=leader, group=ctx.share_group)
    data = _as_tensor(payload) if ctx.rank == leader else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=leader, group=ctx.share_group)
    return payload if ctx.rank == leader else memoryview(data.numpy())


_SIZE, _DATA = 1, 2
"""Tags of the two messages rank 0 sends each leader."""


__all__ = ["broadcast_object", "scatter_shares", "select_rows"]
