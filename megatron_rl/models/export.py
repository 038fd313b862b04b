"""Export megatron weights of any TP/PP/EP/DP layout as HF-named tensors, in buckets.

    for bucket in export_hf_weights(chunks, ctx, bucket_bytes=512 << 20):
        if ctx.rank == 0:
            engine.update_weights(bucket)        # [(hf_name, tensor), ...]

Every rank runs the generator and yields the same number of buckets; only the
pushing rank (dst_rank, default 0) gets tensors, the others get empty lists,
so the loop body may hold collectives of its own.

How one bucket travels:
  1. Once per call, every rank tells all others (all_gather_object, names and
     shapes only) which parameter shards it holds as the first replica: dense
     shards from DP rank 0 (CP rank 0), expert shards from expert-DP rank 0;
     replicated tensors (norms, router) from TP rank 0 only. Global names make
     PP stages and EP ranks disjoint, so this table has each shard exactly once.
  2. Every rank cuts the same table, in model order, into buckets whose HF
     tensors total at most bucket_bytes (a single tensor larger than that
     travels alone).
  3. Per bucket, each holder sends its shards straight to the pushing rank
     (point-to-point; no TP/EP/PP collectives, so no stage waits on another),
     which reassembles TP shards, converts to HF names and layouts with the
     same mapping the loader uses (mapping.py), strips the vocabulary padding
     and yields. Peak extra memory on the pushing rank: about one bucket;
     elsewhere: nothing beyond a contiguous copy of a shard being sent.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_rl.models.info import model_info
from megatron_rl.models.mapping import GlobalNamer, named_weights, VocabPadded, is_expert_param, mapping_for, unwrap_model


@dataclass
class ParamShards:
    """One megatron parameter: its global name, its TP shard count, and one shard's shape and dtype (torch's name)."""

    name: str
    count: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return shards_nbytes(self.shape, self.count, self.dtype)


@dataclass
class _Unit(ParamShards):
    """One megatron parameter and where its TP shards are."""

    holders: dict[int, int] = field(default_factory=dict)
    """shard index -> global rank."""


def shards_nbytes(shape: tuple[int, ...], count: int, dtype: str) -> int:
    """Bytes of `count` shards of `shape` in torch dtype `dtype` (its name, e.g. "bfloat16")."""
    numel = math.prod(shape)
    return numel * count * torch.empty((), dtype=getattr(torch, dtype)).element_size()


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def _order_key(name: str) -> tuple:
    """Model order: embedding, layers by number (experts by number), final norm, output layer."""
    if name.startswith("embedding."):
        return (0, 0, 0, name)
    layer = _LAYER.match(name)
    if layer:
        expert = _EXPERT.search(name)
        return (1, int(layer.group(1)), int(expert.group(1)) if expert else -1, name)
    return (2 if name.startswith("decoder.") else 3, 0, 0, name)


def _replica_shards(model_chunks: list, ctx, arch, padded_vocab: int) -> dict[tuple[str, int], tuple[torch.Tensor, int, int, bool]]:
    """(global name, shard index) -> (parameter, shard count, replica id, first replica?) for every shard this rank holds.

    A replica id names one complete copy: the ranks holding shards 0..count-1 of a name with the same id
    together hold the whole parameter (DP x CP replicas of dense shards, expert-DP replicas of expert shards;
    a tensor not split by TP is a copy of its own on every rank, its id the rank)."""
    num_local_experts = arch.num_experts // ctx.ep_size if arch.num_experts else 0
    held = {}
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        to_global = GlobalNamer(model, ctx.ep_rank, num_local_experts)
        for local_name, param in named_weights(model):
            name = to_global(local_name)
            mapping = mapping_for(arch, name, padded_vocab)
            if isinstance(mapping, VocabPadded) and mapping.export_name is None:
                continue  # the last stage's copy of a tied embedding
            if is_expert_param(name):
                first_replica, replica = ctx.expert_dp_rank == 0, ctx.expert_dp_rank
                index, count = ctx.expert_tp_rank, ctx.expert_tp_size
            else:
                first_replica, replica = ctx.dp_rank == 0 and ctx.cp_rank == 0, ctx.dp_rank * ctx.cp_size + ctx.cp_rank
                index, count = ctx.tp_rank, ctx.tp_size
            if mapping.tp_dim is None:
                first_replica, replica, index, count = first_replica and index == 0, ctx.rank, 0, 1
            held[(name, index)] = (param, count, replica, first_replica)
    return held


def _holder_shards(model_chunks: list, ctx, arch, padded_vocab: int) -> dict[tuple[str, int], tuple[torch.Tensor, int]]:
    """(global name, shard index) -> (parameter, shard count) for the shards this rank sends (first replicas)."""
    shards = _replica_shards(model_chunks, ctx, arch, padded_vocab)
    return {key: (param, count) for key, (param, count, _, first) in shards.items() if first}


def _plan(held: dict, ctx) -> list[_Unit]:
    mine = [(name, index, count, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for (name, index), (p, count) in held.items()]
    tables: list = [None] * ctx.world_size
    dist.all_gather_object(tables, mine, group=ctx.world_group)
    units: dict[str, _Unit] = {}
    for rank, table in enumerate(tables):
        for name, index, count, shape, dtype in table:
            unit = units.setdefault(name, _Unit(name, count, shape, dtype))
            if index in unit.holders:
                raise RuntimeError(f"export: shard {index} of {name} is held by ranks {unit.holders[index]} and {rank}")
            unit.holders[index] = rank
    for unit in units.values():
        if sorted(unit.holders) != list(range(unit.count)):
            raise RuntimeError(f"export: {unit.name} has shards {sorted(unit.holders)} of {unit.count}")
    return sorted(units.values(), key=lambda u: _order_key(u.name))


def _buckets(units: list[_Unit], bucket_bytes: int) -> list[list[_Unit]]:
    buckets: list[list[_Unit]] = [[]]
    size = 0
    for unit in units:
        if buckets[-1] and size + unit.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(unit)
        size += unit.nbytes
    return [b for b in buckets if b]


class HFExport:
    """An export's buckets (iterate once) and `entries`: [(HF name, shape, dtype name)] of all of them, in order.

    weight_sync takes any iterable with `entries` as a push announced up front (weight_sync.stream).
    """

    def __init__(self, entries: list[tuple[str, tuple[int, ...], str]], buckets: Iterator[list[tuple[str, torch.Tensor]]]):
        self.entries = entries
        self._buckets = buckets

    def __iter__(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return self._buckets


def held_signature(held: dict) -> dict:
    """(shape, dtype) of every shard a rank holds: what an export plan was made for."""
    return {key: (tuple(value[0].shape), value[0].dtype) for key, value in held.items()}


def plan_is_current(plan) -> bool:
    """Whether this rank's shards still have the shapes and dtypes `plan` (a FunnelPlan or an OwnerPlan) was made
    for. A module may change a tensor's dtype in place (megatron's router keeps its expert bias in fp32 once a
    forward ran: `.data` replaced); every rank must agree before re-planning (weight_sync.push.any_rank)."""
    return held_signature(plan.held) == plan.signature


@dataclass
class FunnelPlan:
    """What every funnel export of one model on one layout shares: this rank's shards (the parameters themselves,
    read at each export), every parameter's holders, and dst_rank's announced entries. Made once by
    `funnel_plan` (one all-gather of every rank's table, a collective), not at every push."""

    held: dict
    units: list
    entries: list
    dst_rank: int
    signature: dict = field(default_factory=dict)


def funnel_plan(model_chunks: list, ctx, *, dst_rank: int = 0) -> FunnelPlan:
    info = model_info(model_chunks)
    held = _holder_shards(model_chunks, ctx, info.arch, info.padded_vocab_size)
    units = _plan(held, ctx)
    entries = hf_entries(units, info.arch, info.padded_vocab_size) if ctx.rank == dst_rank else []
    return FunnelPlan(held, units, entries, dst_rank, held_signature(held))


def export_hf_weights(model_chunks: list, ctx, *, bucket_bytes: int, dst_rank: int = 0, fresh: bool = True,
                      plan: FunnelPlan | None = None) -> HFExport:
    """Buckets of (HF name, tensor) on dst_rank, empty lists elsewhere; every rank must iterate to the end.

    Tensors are on dst_rank's device, in the parameters' dtype, in model order. With `fresh` they are copies
    (safe to keep across optimizer steps); without, what dst_rank holds itself comes as views of its parameters
    (valid until they change: a push writes each bucket into its transport's buffer at once, weight_sync, so the
    bytes are copied once on their way out, not twice); shards gathered from other ranks are new tensors either
    way. The stream's `entries`
    (HF names, shapes, dtypes of the whole push; empty off dst_rank) are known
    at once: the table of step 1 is gathered when this is called, on every rank (or was, into `plan`: a
    `funnel_plan` of these chunks kept from an earlier export).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    if plan is None:
        plan = funnel_plan(model_chunks, ctx, dst_rank=dst_rank)
    elif plan.dst_rank != dst_rank:
        raise ValueError(f"a funnel plan made for dst_rank={plan.dst_rank} used for dst_rank={dst_rank}")
    info = model_info(model_chunks)
    arch, padded = info.arch, info.padded_vocab_size
    return HFExport(plan.entries, _export_buckets(plan.units, plan.held, ctx, arch, padded, bucket_bytes, dst_rank, fresh))


def hf_entries(params: list[ParamShards], arch, padded: int) -> list[tuple[str, tuple[int, ...], str]]:
    """HF names, shapes and dtypes that exporting `params` yields, from the mapping run on meta tensors (no data)."""
    entries = []
    for param in params:
        shards = [torch.empty(param.shape, dtype=getattr(torch, param.dtype), device="meta")] * param.count
        for name, tensor in mapping_for(arch, param.name, padded).export(shards):
            entries.append((name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
    return entries


@torch.no_grad()
def _export_buckets(units: list[_Unit], held: dict, ctx, arch, padded: int, bucket_bytes: int,
                    dst_rank: int, fresh: bool = True) -> Iterator[list[tuple[str, torch.Tensor]]]:
    rank = ctx.rank
    for bucket in _buckets(units, bucket_bytes):
        shards: dict[tuple[str, int], torch.Tensor] = {}
        requests, keep_alive = [], []
        for unit in bucket:
            for index, src in sorted(unit.holders.items()):
                if src == dst_rank:
                    if rank == dst_rank:
                        shard = held[(unit.name, index)][0].detach()
                        shards[(unit.name, index)] = shard.clone() if fresh else shard
                elif rank == src:
                    tensor = held[(unit.name, index)][0].detach().contiguous()
                    keep_alive.append(tensor)
                    requests.append(dist.isend(tensor, dst_rank))
                elif rank == dst_rank:
                    buffer = torch.empty(unit.shape, dtype=getattr(torch, unit.dtype), device=ctx.device)
                    shards[(unit.name, index)] = buffer
                    requests.append(dist.irecv(buffer, src))
        for request in requests:
            request.wait()
        del keep_alive
        if rank != dst_rank:
            yield []
            continue
        out: list[tuple[str, torch.Tensor]] = []
        for unit in bucket:
            mapping = mapping_for(arch, unit.name, padded)
            out += mapping.export([shards.pop((unit.name, i)) for i in range(unit.count)])
        yield out


def export_hf_state_dict(model_chunks: list, ctx, *, bucket_bytes: int = 64 << 20, dst_rank: int = 0) -> dict[str, torch.Tensor]:
    """All HF tensors on dst_rank as one dict (empty elsewhere): for tests and small models."""
    state: dict[str, torch.Tensor] = {}
    for bucket in export_hf_weights(model_chunks, ctx, bucket_bytes=bucket_bytes, dst_rank=dst_rank):
        for name, tensor in bucket:
            if name in state:
                raise RuntimeError(f"export produced {name} twice")
            state[name] = tensor.contiguous()
    return state
