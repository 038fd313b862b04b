"""The export without a funnel: every owner rank yields HF buckets of its own shards (weight_sync.parallel).

    export = export_owned_weights(chunks, ctx, bucket_bytes=...)
    for bucket in export:            # one per round on every rank; [] where this rank sends nothing
        ...                          # export.rounds[r]: every sender's bucket of round r, as metadata

export_hf_weights (models.export) brings every shard to one pushing rank. Here
each parameter gets an owner among the ranks holding it, and the owner sends it:
  1. every rank tells all others (all_gather_object, names and shapes only)
     which shards it holds and of which replica (export._replica_shards): DP /
     CP / expert-DP replicas are interchangeable, so any complete replica's
     ranks may send a parameter;
  2. every rank computes the same assignment (greedy, largest parameter first,
     to the candidate whose bytes through it stay smallest): a parameter split
     by TP goes to one rank of one replica, whose TP peers send it their
     shards (the only trainer-to-trainer traffic); others to one holder;
  3. each owner cuts its parameters of each layer (the embedding, a decoder
     layer, the final norm, the output layer) into buckets of at most
     bucket_bytes and sends them in model order, at most one a round
     (`owner_rounds`). An engine loads a layer once all its tensors are in and
     keeps each received bucket until then, so the rounds keep the bytes of
     incomplete layers within the largest layer: a worker holds at most two
     layers, whatever the number of senders (rounds of every owner's r-th
     bucket of the whole model mixed layers: each kept most of a bucket per
     sender). The HF names, shapes
     and dtypes of every owner's bucket of every round are known to every rank
     from the metadata (the mapping run on meta tensors), so the rank that
     drives the engines announces them without touching a byte.
Bytes through a rank: what it owns (about model / senders after the greedy
balance) plus its TP peers' shards; never the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.config.rollout import sender_ranks
from megatron_rl.models.info import model_info
from megatron_rl.models.export import ParamShards, _buckets, _order_key, _replica_shards, held_signature, hf_entries
from megatron_rl.models.mapping import mapping_for

Entry = tuple[str, tuple[int, ...], str]


@dataclass
class _Param(ParamShards):
    """One megatron parameter and its complete replicas: replica id -> {shard index: rank}."""

    rows: dict[int, dict[int, int]] = field(default_factory=dict)
    owner: int = -1
    sources: dict[int, int] = field(default_factory=dict)
    """shard index -> the rank that gives it to the owner (the owner's own replica)."""


@dataclass
class SendStats:
    """Bytes this rank moved in one export (allocation-free counting)."""

    owned: int = 0
    """Bytes of the HF tensors this rank yielded (what it sends to the engines)."""
    peer_out: int = 0
    """Bytes of its TP shards it sent to other owners."""
    peer_in: int = 0
    """Bytes of TP shards it received from its peers."""


class OwnedExport:
    """Buckets of this rank's own parameters, one per round (see the module docstring).

    rounds: [[(owner rank, entries of its bucket)]] per round, the same on every rank;
    entries: every HF tensor of the push (all owners), in round order;
    senders: the ranks that own something; stats: bytes moved here (SendStats), filled while iterating.
    """

    def __init__(self, rounds: list[list[tuple[int, list[Entry]]]], buckets: Iterator[list], stats: SendStats):
        self.rounds = rounds
        self.entries = [entry for parts in rounds for _, entries in parts for entry in entries]
        self.senders = sorted({owner for parts in rounds for owner, _ in parts})
        self.stats = stats
        self._buckets = buckets

    def __iter__(self) -> Iterator[list]:
        return self._buckets


def _gather_params(held: dict, ctx) -> list[_Param]:
    mine = [(name, index, count, tuple(p.shape), str(p.dtype).removeprefix("torch."), replica)
            for (name, index), (p, count, replica, _) in held.items()]
    tables: list = [None] * ctx.world_size
    dist.all_gather_object(tables, mine, group=ctx.world_group)
    params: dict[str, _Param] = {}
    for rank, table in enumerate(tables):
        for name, index, count, shape, dtype, replica in table:
            param = params.setdefault(name, _Param(name, count, shape, dtype))
            param.rows.setdefault(replica, {})[index] = rank
    for param in params.values():
        complete = {r: row for r, row in param.rows.items() if sorted(row) == list(range(param.count))}
        if not complete:
            raise RuntimeError(f"export: no replica of {param.name} holds all {param.count} shards: {param.rows}")
        param.rows = complete
    return sorted(params.values(), key=lambda p: _order_key(p.name))


def assign_owners(params: list[_Param], world_size: int, senders: list[int] | None = None) -> list[int]:
    """Give each parameter an owner (see the module docstring, step 2); returns the bytes through each rank.

    senders: the ranks that may own (None: any holder). An owner that holds no shard of a parameter receives them
    all from one complete replica's holders."""
    load = [0] * world_size
    allowed = None if senders is None else set(senders)
    for param in sorted(params, key=lambda p: (-p.nbytes, _order_key(p.name))):
        size, share = param.nbytes, param.nbytes // param.count
        best = None
        least = None if senders is None else min(senders, key=lambda r: (load[r], r))
        for replica in sorted(param.rows):
            row = param.rows[replica]
            holders = set(row.values())
            # any holder; with senders, the allowed holders and the least loaded sender (which receives every shard)
            owners = sorted(holders) if allowed is None else sorted(holders & allowed) + [least]
            for owner in owners:
                received = sum(share for rank in row.values() if rank != owner)
                key = (load[owner] + size + received, owner)
                if best is None or key < best[0]:
                    best = (key, owner, row, received)
        (_, owner, row, received) = best
        param.owner, param.sources = owner, dict(row)
        load[owner] += size + received
        for rank in row.values():
            if rank != owner:
                load[rank] += share
    return load


def layer_of(name: str) -> tuple:
    """The model layer a megatron parameter belongs to, in model order: the embedding, each decoder layer, the
    final norm, the output layer (an engine loads each once all its tensors are in)."""
    return _order_key(name)[:2] if name.startswith(("embedding.", "decoder.layers.")) else _order_key(name)[:1] + (name,)


def owner_rounds(params: list[_Param], bucket_bytes: int) -> list[list[tuple[int, list[_Param]]]]:
    """The push's rounds (`params` with owners assigned, in model order): at most one bucket per owner a round.

    Each owner cuts its parameters of each layer into buckets of at most bucket_bytes, and sends them in model
    order. A worker keeps what it received of a layer until the layer is complete, so the rounds keep the bytes of
    incomplete layers within the largest layer's size: an owner's next bucket joins a round if it belongs to the
    oldest incomplete layer (which completes it soonest), or if it fits in that limit; otherwise the owner waits a
    round. Owners of other layers (other pipeline stages, other experts) send at once when they fit, so the rounds
    are about the owners' bucket counts where layers are small, and one layer at a time where a layer is the limit.
    A worker then holds at most two layers' bytes, whatever the number of senders.
    """
    from collections import deque

    owned: dict[int, dict[tuple, list[_Param]]] = {}  # owner -> layer -> its parameters, in model order
    for param in params:
        owned.setdefault(param.owner, {}).setdefault(layer_of(param.name), []).append(param)
    queues: dict[int, deque] = {}  # owner -> (layer, bucket, bytes) in model order
    left: dict[tuple, int] = {}  # layer -> buckets not sent yet
    size: dict[tuple, int] = {}
    for owner in sorted(owned):
        queues[owner] = deque((layer, bucket, sum(p.nbytes for p in bucket))
                              for layer in sorted(owned[owner]) for bucket in _buckets(owned[owner][layer], bucket_bytes))
        for layer, _, nbytes in queues[owner]:
            left[layer] = left.get(layer, 0) + 1
            size[layer] = size.get(layer, 0) + nbytes
    limit = max(size.values(), default=0)
    held = 0  # bytes sent of the layers not complete yet
    plan = []
    while any(queues.values()):
        oldest = min(layer for layer, count in left.items() if count)
        parts, done = [], []
        for owner, queue in queues.items():
            if queue and (queue[0][0] == oldest or held + queue[0][2] <= limit):
                layer, bucket, nbytes = queue.popleft()
                parts.append((owner, bucket))
                held += nbytes
                left[layer] -= 1
                if not left[layer]:
                    done.append(layer)
        held -= sum(size[layer] for layer in done)  # complete after this round: the worker loads and lets them go
        plan.append(parts)
    return plan


@dataclass
class OwnerPlan:
    """What every push of one model on one layout shares: this rank's shards (the parameters themselves, read at
    each push), every owner's buckets per round, and their HF entries. Made once (`owner_plan`: one all-gather of
    every rank's table, the greedy assignment, the rounds; about 1 s of host time and an 11 MB table per rank at
    Qwen3-235B on 256 ranks), not at every push."""

    held: dict
    plan: list
    rounds: list
    arch: object
    padded: int
    bucket_bytes: int
    signature: dict = field(default_factory=dict)


def owner_plan(model_chunks: list, ctx, *, bucket_bytes: int, max_senders: int = 0) -> OwnerPlan:
    """The owners, rounds and entries of `model_chunks`' pushes (a collective over the world: every rank calls it);
    max_senders: at most this many owners (`sender_ranks`; 0: any holder)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    info = model_info(model_chunks)
    arch, padded = info.arch, info.padded_vocab_size
    held = _replica_shards(model_chunks, ctx, arch, padded)
    params = _gather_params(held, ctx)
    assign_owners(params, ctx.world_size, sender_ranks(ctx.world_size, max_senders))
    plan = owner_rounds(params, bucket_bytes)
    rounds = [[(owner, hf_entries(bucket, arch, padded)) for owner, bucket in parts] for parts in plan]
    return OwnerPlan(held, plan, rounds, arch, padded, bucket_bytes, held_signature(held))


def export_owned_weights(model_chunks: list, ctx, *, bucket_bytes: int, fault: Callable[[int, int], None] | None = None,
                         plan: OwnerPlan | None = None) -> OwnedExport:
    """This rank's buckets of HF tensors, one per round ([] where it owns nothing that round); every rank
    iterates to the end (TP peers send owners their shards in the round that needs them).

    plan: `owner_plan` of these chunks, kept from an earlier push (None: made now, a collective).
    fault(rank, round): called on every rank after each round's bucket is made (tests break a push there).
    """
    if plan is None:
        plan = owner_plan(model_chunks, ctx, bucket_bytes=bucket_bytes)
    elif plan.bucket_bytes != bucket_bytes:
        raise ValueError(f"an owner plan made for {plan.bucket_bytes}-byte buckets used for {bucket_bytes}-byte ones")
    stats = SendStats()
    return OwnedExport(plan.rounds, _owned_buckets(plan.plan, plan.held, ctx, plan.arch, plan.padded, stats, fault), stats)


@torch.no_grad()
def _owned_buckets(plan: list, held: dict, ctx, arch, padded: int, stats: SendStats,
                   fault: Callable[[int, int], None] | None) -> Iterator[list]:
    rank = ctx.rank
    for round_index, parts in enumerate(plan):
        shards: dict[tuple[str, int], torch.Tensor] = {}
        requests, keep_alive, mine = [], [], []
        for owner, bucket in parts:
            for param in bucket:
                for index, src in sorted(param.sources.items()):
                    if src == owner:
                        if rank == owner:
                            shards[(param.name, index)] = held[(param.name, index)][0].detach().clone()
                    elif rank == src:
                        tensor = held[(param.name, index)][0].detach().contiguous()
                        keep_alive.append(tensor)
                        requests.append(dist.isend(tensor, owner))
                        stats.peer_out += tensor.numel() * tensor.element_size()
                    elif rank == owner:
                        buffer = torch.empty(param.shape, dtype=getattr(torch, param.dtype), device=ctx.device)
                        shards[(param.name, index)] = buffer
                        requests.append(dist.irecv(buffer, src))
                        stats.peer_in += buffer.numel() * buffer.element_size()
            if owner == rank:
                mine = bucket
        for request in requests:
            request.wait()
        del keep_alive
        out: list = []
        for param in mine:
            out += mapping_for(arch, param.name, padded).export([shards.pop((param.name, i)) for i in range(param.count)])
        stats.owned += sum(t.numel() * t.element_size() for _, t in out)
        if fault is not None:
            fault(rank, round_index)
        yield out
