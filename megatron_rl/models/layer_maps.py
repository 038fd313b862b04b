"""The ways one megatron parameter maps to Hugging Face tensors, and the shard of it a rank holds.

Each mapping kind (Direct, VocabPadded, QKV, GatedFC1, RopeRows, GroupedExperts)
loads HF tensors into one rank's shard and exports the full tensor back; the
layouts they implement are described in models/mapping.py. This module knows
no family: the families (models/families/) build their layer tables from these
kinds, and mapping.py asks a model's family for the table (mapping_for).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_rl.models.arch import UnsupportedModelError


class HFReader(Protocol):
    """Read access to HF tensors by name, optionally a contiguous range along one dim."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Shard:
    """The piece of a full megatron tensor one rank holds: part `rank` of `size` along `dim`."""

    dim: int | None
    rank: int = 0
    size: int = 1

    def bounds(self, length: int) -> tuple[int, int]:
        if length % self.size:
            raise UnsupportedModelError(f"dimension of length {length} cannot be split into {self.size} equal TP shards")
        step = length // self.size
        return self.rank * step, (self.rank + 1) * step


@dataclass(frozen=True)
class Direct:
    """One HF tensor, the same layout; TP splits `tp_dim` into contiguous chunks."""

    hf_name: str
    tp_dim: int | None = None

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf_name,)

    def load(self, reader: HFReader, shard: Shard) -> torch.Tensor:
        if shard.dim is None or shard.size == 1:
            return reader.read(self.hf_name)
        start, stop = shard.bounds(reader.shape(self.hf_name)[shard.dim])
        return reader.read(self.hf_name, shard.dim, start, stop)

    def export(self, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=self.tp_dim)
        return [(self.hf_name, full)]


@dataclass(frozen=True)
class VocabPadded:
    """Embedding / LM head: vocabulary rows (dim 0) padded with zeros to `padded_vocab`."""

    hf_name: str
    vocab_size: int
    padded_vocab: int
    tp_dim: int | None = 0
    export_name: str | None = ""
    """HF name on export; "" = hf_name, None = not exported (a tied output layer)."""

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf_name,)

    def load(self, reader: HFReader, shard: Shard) -> torch.Tensor:
        rows = reader.shape(self.hf_name)[0]
        if rows != self.vocab_size:
            raise UnsupportedModelError(f"{self.hf_name} has {rows} rows but config.json says vocab_size={self.vocab_size}")
        start, stop = Shard(0, shard.rank, shard.size).bounds(self.padded_vocab)
        part = reader.read(self.hf_name, 0, min(start, rows), min(stop, rows))
        if part.shape[0] < stop - start:
            pad = part.new_zeros((stop - start - part.shape[0],) + tuple(part.shape[1:]))
            part = torch.cat([part, pad], dim=0)
        return part

    def export(self, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        if self.export_name is None:
            return []
        full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=0)
        return [(self.export_name or self.hf_name, full[: self.vocab_size])]


@dataclass(frozen=True)
class QKV:
    """q_proj, k_proj, v_proj (weights or biases) <-> megatron's per-group interleaved linear_qkv."""

    q: str
    k: str
    v: str
    num_heads: int
    num_groups: int
    head_dim: int
    tp_dim: int = 0

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def load(self, reader: HFReader, shard: Shard) -> torch.Tensor:
        per_group = self.num_heads // self.num_groups
        g0, g1 = Shard(0, shard.rank, shard.size).bounds(self.num_groups)
        d = self.head_dim
        q = reader.read(self.q, 0, g0 * per_group * d, g1 * per_group * d)
        k = reader.read(self.k, 0, g0 * d, g1 * d)
        v = reader.read(self.v, 0, g0 * d, g1 * d)
        rest = tuple(q.shape[1:])
        groups = g1 - g0
        parts = [q.reshape((groups, per_group * d) + rest), k.reshape((groups, d) + rest), v.reshape((groups, d) + rest)]
        return torch.cat(parts, dim=1).reshape((-1,) + rest)

    def export(self, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=0)
        per_group, d = self.num_heads // self.num_groups, self.head_dim
        rest = tuple(full.shape[1:])
        grouped = full.reshape((self.num_groups, (per_group + 2) * d) + rest)
        q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
        return [(self.q, q.reshape((-1,) + rest)), (self.k, k.reshape((-1,) + rest)), (self.v, v.reshape((-1,) + rest))]


@dataclass(frozen=True)
class GatedFC1:
    """gate_proj + up_proj <-> linear_fc1 = [gate; up]; TP rank r holds [gate_r; up_r]."""

    gate: str
    up: str
    tp_dim: int = 0

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.gate, self.up)

    def load(self, reader: HFReader, shard: Shard) -> torch.Tensor:
        start, stop = Shard(0, shard.rank, shard.size).bounds(reader.shape(self.gate)[0])
        return torch.cat([reader.read(self.gate, 0, start, stop), reader.read(self.up, 0, start, stop)], dim=0)

    def export(self, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0) if len(shards) > 1 else halves[0][0]
        up = torch.cat([h[1] for h in halves], dim=0) if len(shards) > 1 else halves[0][1]
        return [(self.gate, gate), (self.up, up)]


@dataclass(frozen=True)
class RopeRows:
    """Rows in blocks of `block` whose last `rope` rows are rotary dimensions in halves; megatron's MLA wants pairs.

    megatron-core's multi-latent attention reads rotary dimensions as interleaved
    pairs (x0, x1), (x2, x3), ... (rope_utils: t[..., 0::2], t[..., 1::2]), as
    DeepSeek's checkpoints store them (rope_interleave=true: copied as they are,
    use Direct). A checkpoint with rope_interleave=false rotates halves
    (x_i, x_{i + rope/2}): its rows are put in pair order on load,
    [h_0, h_{r/2}, h_1, h_{r/2 + 1}, ...], and back on export. TP splits rows (dim 0) contiguously.
    """

    hf_name: str
    block: int
    rope: int
    tp_dim: int | None = 0

    @property
    def hf_names(self) -> tuple[str, ...]:
        return (self.hf_name,)

    def _reordered(self, full: torch.Tensor, inverse: bool) -> torch.Tensor:
        rest = tuple(full.shape[1:])
        blocks = full.reshape((-1, self.block) + rest)
        half = self.rope // 2
        order = torch.stack([torch.arange(half), torch.arange(half, self.rope)], dim=1).reshape(-1).to(full.device)  # 0, r/2, 1, ...
        if inverse:
            order = torch.argsort(order)
        head = self.block - self.rope
        rope = blocks[:, head:].index_select(1, order)
        return torch.cat([blocks[:, :head], rope], dim=1).reshape((-1,) + rest)

    def load(self, reader: HFReader, shard: Shard) -> torch.Tensor:
        full = self._reordered(reader.read(self.hf_name), inverse=False)
        if shard.dim is None or shard.size == 1:
            return full
        start, stop = shard.bounds(full.shape[0])
        return full[start:stop]

    def export(self, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=0)
        return [(self.hf_name, self._reordered(full, inverse=True))]


@dataclass(frozen=True)
class GroupedExperts:
    """A range of routed experts <-> megatron-core GroupedMLP's fused `weight1` / `weight2` (one tensor per EP rank).

    GroupedMLP (transformer/moe/experts.py) stores the local experts' fc1 as
    weight1 [H, E_local x F1] with F1 = 2 x ffn / TP (gated) and fc2 as
    weight2 [E_local x ffn / TP, H]; its sharded_state_dict reads them as
    weight1.view(E_local, H, F1).transpose(-1, -2) and weight2.view(E_local, ffn / TP, H).transpose(-1, -2),
    i.e. per expert the transpose of what SequentialMLP holds: fc1 [gate_r; up_r], fc2 [H, ffn / TP].
    `experts` are the per-expert mappings (GatedFC1 for weight1, Direct for weight2) of this
    EP rank's experts; TP splits dim 1 of weight1 and dim 0 of weight2 (megatron's partition_dim).
    """

    experts: tuple[GatedFC1 | Direct, ...]
    tp_dim: int

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(name for expert in self.experts for name in expert.hf_names)

    def load(self, reader: HFReader, shard: Shard) -> torch.Tensor:
        per_expert = [expert.load(reader, Shard(expert.tp_dim, shard.rank, shard.size)) for expert in self.experts]
        stacked = torch.stack(per_expert).transpose(-1, -2)  # fc1: [E, H, F1]; fc2: [E, F, H]
        if self.tp_dim == 1:  # megatron reads weight1 [H, E x F1] as .view(E, H, F1): same memory order
            return stacked.reshape(stacked.shape[1], -1)
        return stacked.reshape(-1, stacked.shape[-1])  # [E x F, H], read as .view(E, F, H)

    def export(self, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        count = len(self.experts)
        if self.tp_dim == 1:
            per_rank = [s.reshape(count, s.shape[0], -1).transpose(-1, -2) for s in shards]  # [E, F1, H]
        else:
            per_rank = [s.reshape(count, -1, s.shape[-1]).transpose(-1, -2) for s in shards]  # [E, H, F]
        out: list[tuple[str, torch.Tensor]] = []
        for index, expert in enumerate(self.experts):
            out += expert.export([part[index].contiguous() for part in per_rank])
        return out


Mapping = Direct | VocabPadded | QKV | GatedFC1 | RopeRows | GroupedExperts


_EXPERT = re.compile(
    r"mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.(?P<seq_fc>linear_fc1|linear_fc2)\.weight"
    r"|(?P<te_fc>linear_fc1|linear_fc2)\.weight(?P<te>\d+))"
)
"""SequentialMLP's local_experts.<e>.linear_fc<k>.weight, or TEGroupedMLP's linear_fc<k>.weight<e> (same tensor per expert)."""


def expert_mapping(rest: str, hf_experts: str, matrices: tuple[str, str, str]) -> Mapping | None:
    """A routed expert's linear_fc1 / linear_fc2 (`rest` after decoder.layers.<i>.) <-> `hf_experts`.<e>.<gate|up|down>.

    Both per-expert layouts map here: SequentialMLP (`mlp.experts.local_experts.<e>.linear_fc1.weight`)
    and Transformer Engine's TEGroupedMLP (`mlp.experts.linear_fc1.weight<e>`), whose tensors are the same.
    """
    expert = _EXPERT.fullmatch(rest)
    if not expert:
        return None
    index, fc = (expert.group("seq"), expert.group("seq_fc")) if expert.group("seq") is not None else (expert.group("te"), expert.group("te_fc"))
    return _one_expert(hf_experts, int(index), fc, matrices)


def _one_expert(hf_experts: str, index: int, fc: str, matrices: tuple[str, str, str]) -> GatedFC1 | Direct:
    gate, up, down = matrices
    prefix = f"{hf_experts}.{index}"
    if fc == "linear_fc1":
        return GatedFC1(f"{prefix}.{gate}.weight", f"{prefix}.{up}.weight")
    return Direct(f"{prefix}.{down}.weight", tp_dim=1)


_GROUPED = re.compile(r"mlp\.experts\.(?P<weight>weight[12])(?:\[(?P<first>\d+):(?P<stop>\d+)\])?")
"""GroupedMLP's fused tensors by global name: weight1 / weight2 (every expert), or weight1[a:b] (experts a..b-1, one EP rank's)."""


def grouped_mapping_for(rest: str, hf_experts: str, num_experts: int, matrices: tuple[str, str, str]) -> GroupedExperts | None:
    """GroupedMLP's `mlp.experts.weight<k>[a:b]` (`rest` after decoder.layers.<i>.) <-> experts a..b-1 of `hf_experts`, or None.

    The fused tensors carry no expert number, so GlobalNamer appends the EP rank's range:
    EP rank 1 of 2 with 8 experts holds `mlp.experts.weight1[4:8]`; without a range the name means every expert.
    """
    grouped = _GROUPED.fullmatch(rest)
    if not grouped:
        return None
    first, stop = (int(grouped["first"]), int(grouped["stop"])) if grouped["first"] is not None else (0, num_experts)
    if not 0 <= first < stop <= num_experts:
        raise UnsupportedModelError(f"GroupedMLP tensor {rest!r} names experts [{first}, {stop}) of a model with {num_experts}")
    return grouped_expert_mapping(hf_experts, grouped["weight"], first, stop - first, matrices)


def grouped_expert_mapping(
    hf_experts: str, weight: str, first_expert: int, num_local_experts: int, matrices: tuple[str, str, str]
) -> GroupedExperts:
    """GroupedMLP's `weight1` (fc1) or `weight2` (fc2) holding experts [first_expert, first_expert + num_local_experts).

    The fused tensor has no expert number in its name, so the EP rank's expert range is given here
    (first_expert = ep_rank x num_local_experts).
    """
    if weight not in ("weight1", "weight2"):
        raise UnsupportedModelError(f"GroupedMLP has parameters weight1 and weight2, not {weight!r}")
    fc = "linear_fc1" if weight == "weight1" else "linear_fc2"
    experts = tuple(_one_expert(hf_experts, first_expert + e, fc, matrices) for e in range(num_local_experts))
    return GroupedExperts(experts, tp_dim=1 if weight == "weight1" else 0)
