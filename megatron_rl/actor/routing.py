"""MoE routing replay (R2/R3) on megatron-core's RouterReplay, and routing-drift metrics.

Why: after one gradient step about 10% of a token's activated experts change
(GSPO, arXiv 2507.18071, Sec. 5.3), so token-level importance ratios compare
two different sparse networks. R2 replays, in the training forward and
backward, the experts the old-policy forward chose; R3 (Rollout Routing
Replay, arXiv 2510.11370) replays the experts the rollout engine chose. The
router logits stay live: the gates of the replayed experts still train the
router.

Where routes live: R2 routes stay on the rank whose routers computed them
(`RankRoutes`: its DP share's rows, its pipeline stage's MoE layers, its
sequence-parallel / CP tokens), keyed by (row, position), so the training
forward of the same rows replays them on that rank whatever its microbatch
plan; no collective moves them. Per rank that is B/D x T/(TP x CP) x L/PP x K
bytes (uint8 ids for fewer than 256 experts). R2 keeps the padding positions of padded
microbatches too: replayed as the routers chose them, a replayed forward is bit-identical
to the model's own (old_logprobs=training_forward's first mini-batch equals the forward's);
routed elsewhere (R3's padding gets experts 0..K-1) they change the experts' token batches,
and real tokens' logprobs move by about 6e-6. R3 routes come from the engine per
sample and travel with their rows, packed without padding (data.batch.PackedRoutes),
to each DP rank's leader (actor.distribute); the leader sends each of its TP x PP x
CP peers only what that rank's routers replay, as the same `RankRoutes`
(`RoutingControl.split_share`, `replay_routes`).

Global layout (what the engine returns and what the actor records):
``routes[b, t, l, k]`` = the k-th expert MoE layer l (MoE layers in model
order, dense layers skipped) sends the token at position t of row b to.

megatron's layout (what a router sees): per rank, per *local* MoE layer, one
``[N_local, K]`` index tensor over the rank's local tokens, in the order
hidden states are flattened: ``[s, b]`` (sequence-major), and under
sequence parallelism only this TP rank's contiguous slice of the sequence.
`local_tokens` converts one microbatch's ``[B_m, T_m, ...]`` tensor to that
order; each pipeline stage uses only the MoE layers it holds.

One microbatch forward, as the actor drives it:
  1. `begin_microbatch`: for every local router, set RouterReplay's action
     (RECORD, REPLAY_FORWARD with this microbatch's indices, or none) and the
     drift monitor's reference routes;
  2. the model forward: each router's top-k goes through RouterReplay
     (moe_utils.topk_routing_with_score_function); a forward hook on each
     router compares the experts it actually used (its routing_map) and its
     own top-k with the reference routes;
  3. `end_microbatch`: collect recorded indices; switch replay to
     REPLAY_BACKWARD, so that activation recomputation in backward pops this
     step's indices in microbatch order (megatron's FIFO replay_backward_list).

Replay data is set per microbatch because REPLAY_FORWARD uses only the last
`set_target_indices` (several microbatches and pipeline schedules interleave
forwards).

Padding and the expert-bias update. A sigmoid router with an expert bias
(aux-loss-free balancing) counts, in every forward with gradients, the tokens
it sends to each expert (router.local_tokens_per_expert); megatron-core moves
the bias by those counts after the step. Padding positions (padded rows, the
end padding of packed sequences) are routed like any token. megatron-core
0.16.1's own `padding_mask` cannot be used for this (Router._apply_expert_bias
ANDs a [tokens, experts] map with a [tokens] mask: a shape error), so the hook
on each router takes the padding positions' routes back out of that count, in
the same forwards megatron counts in (gradients enabled: the training forward,
or the recomputation in backward under model.recompute (moe, full), microbatches in
order: a FIFO of padding masks per router).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megatron_rl.actor.packing import TokenLayout, gather_positions, microbatch_layout, padded_layout
from megatron_rl.actor.microbatches import Microbatch
from megatron_rl.models.mapping import unwrap_model
from megatron_rl.parallel.devices import group_device, host_to_device


def local_tokens(x: torch.Tensor, *, tp_rank: int, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """[B_m, T_m, ...] -> [N_local, ...]: megatron's [s, b] token order, this rank's sequence-parallel slice."""
    x = x.transpose(0, 1)
    if sequence_parallel and tp_size > 1:
        if x.shape[0] % tp_size:
            raise ValueError(f"microbatch width {x.shape[0]} is not divisible by TP={tp_size} (sequence parallelism)")
        x = x.chunk(tp_size, dim=0)[tp_rank]
    return x.reshape(-1, *x.shape[2:])


def set_differs(routing_map: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[N] bool: the set of experts a router used differs from reference ([N, K] distinct ids).

    routing_map: megatron's [N, E] bool map (top-k marks K experts per token, at most K with capacity dropping, so
    the sets are equal iff every reference expert is marked: one gather), or the [N, K] distinct ids a
    models.moe.SortedTopKRouter returns (equal iff every used id is among the reference's).
    """
    if routing_map.dtype == torch.bool:
        return ~routing_map.gather(-1, reference).all(dim=-1)
    return ~(routing_map[..., :, None] == reference[..., None, :]).any(dim=-1).all(dim=-1)


def experts_count(routing_map: torch.Tensor, tokens: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E]: how many of the tokens marked in `tokens` ([N] bool) each expert received, from an [N, E] bool map or
    [N, K] expert ids (see set_differs)."""
    if routing_map.dtype == torch.bool:
        return (routing_map & tokens[:, None]).sum(dim=0)
    weights = tokens[:, None].expand_as(routing_map).reshape(-1).to(torch.int64)
    return torch.zeros(num_experts, dtype=torch.int64, device=routing_map.device).scatter_add_(0, routing_map.reshape(-1), weights)


def _layout(x) -> TokenLayout:
    return padded_layout(x) if isinstance(x, Microbatch) else x


def microbatch_routes(routes: torch.Tensor, layout: TokenLayout | Microbatch, topk: int) -> torch.Tensor:
    """[N_in, W_in, L, K] int64 routes at a microbatch's input positions; padding and -1 entries get experts 0..K-1."""
    return _default_where_missing(gathered_routes(routes, _layout(layout)), topk)


def _default_where_missing(routes: torch.Tensor, topk: int) -> torch.Tensor:
    """Experts 0..K-1 where `routes` ([..., K] int64) holds -1 (a token the replay must still route somewhere)."""
    return torch.where(routes < 0, torch.arange(topk, dtype=torch.int64).expand_as(routes), routes)


def gathered_routes(routes: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """[N_in, W_in, L, K] int64 routes at a microbatch's input positions, -1 where none (padding, not captured).

    The microbatch's positions are picked first and only they are widened to int64: the batch's [B, T, L, K]
    routes (every layer of every token: a whole batch's R3 routes, or engine routes kept for the metrics) are
    never copied whole.
    """
    valid = (layout.rows >= 0) & (layout.positions >= 0) & (layout.positions < routes.shape[1])
    out = gather_positions(routes, layout, valid, fill=0).to(torch.int64)
    return torch.where(valid[..., None, None], out, -1)


def microbatch_positions(layout: TokenLayout | Microbatch, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row index, position, counted) [N_in, W_in] of a microbatch; counted = a real token with t < length - 1.

    Drift counts positions whose routing can affect the loss: the last token of a
    sequence only predicts past its end (and the engine never computes it).
    """
    layout = _layout(layout)
    rows, positions = layout.rows, layout.positions
    row_len = torch.where(rows >= 0, lengths[rows.clamp(min=0)], 0)
    return rows, positions, (positions >= 0) & (positions < row_len - 1)


@dataclass
class RankRoutes:
    """The routes this rank's routers replay, keyed by (row, position): R2's, computed by them in the old-policy
    forward (`RouteRecorder`), or R3's, the engine's cut to this rank (`replay_routes`).

    keys [N] int64, sorted: row * seq_len + position (row in the batch the forward ran on);
    experts [N, L_local, K] (uint8 / int16 expert ids) for the MoE layers `layer_ids` (global
    MoE-layer index of each column, this rank's pipeline stage). Only the tokens this rank's
    routers saw are held: its sequence-parallel slice and its CP chunks.
    """

    keys: torch.Tensor
    experts: torch.Tensor
    layer_ids: tuple[int, ...]
    batch_shape: tuple[int, int]
    num_moe_layers: int
    topk: int

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds (keys and expert ids)."""
        return self.keys.numel() * self.keys.element_size() + self.experts.numel() * self.experts.element_size()

    def lookup(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [N, L_local, K] int64, found [N] bool) at the tokens (rows [N], positions [N]); 0 where not found."""
        wanted = rows.clamp(min=0) * self.batch_shape[1] + positions.clamp(min=0)
        index = torch.searchsorted(self.keys, wanted).clamp(max=max(self.keys.numel() - 1, 0))
        if self.keys.numel() == 0:
            found = torch.zeros_like(wanted, dtype=torch.bool)
            return torch.zeros(wanted.numel(), len(self.layer_ids), self.topk, dtype=torch.int64), found
        found = (self.keys[index] == wanted) & (rows >= 0) & (positions >= 0) & (positions < self.batch_shape[1])
        experts = torch.where(found[:, None, None], self.experts[index].to(torch.int64), 0)
        return experts, found

    def gather(self, groups: list) -> torch.Tensor:
        """[B, T, L, K] int16 over `groups` (-1 where no rank computed a token): a collective for
        inspection (tests, offline analysis), never on the training path."""
        B, T = self.batch_shape
        dense = torch.zeros(B * T, self.num_moe_layers, self.topk, dtype=torch.int32)
        for column, layer in enumerate(self.layer_ids):
            dense[self.keys, layer] = self.experts[:, column].to(torch.int32) + 1
        for group in groups:  # several ranks may hold the same token (TP without SP): max is idempotent
            if group is not None and dist.get_world_size(group) > 1:
                on_device = dense.to(group_device(group))  # NCCL's groups take no host tensor
                dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=group)
                dense = on_device.cpu()
        return (dense.reshape(B, T, self.num_moe_layers, self.topk) - 1).to(torch.int16)


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The narrowest type of an expert id (0..num_experts-1): uint8 up to 256 experts, else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class RouteRecorder:
    """Collects one forward's recorded routes on this rank (see `RoutingControl.end_microbatch`)."""

    def __init__(self, batch_shape: tuple[int, int], num_moe_layers: int, topk: int, num_experts: int) -> None:
        self.batch_shape, self.num_moe_layers, self.topk = batch_shape, num_moe_layers, topk
        self.dtype = expert_id_dtype(num_experts)
        self._keys: list[torch.Tensor] = []
        self._experts: list[torch.Tensor] = []

    def add(self, keys: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """keys [N_keep] (host); experts [N, L_local, K] on any device, `keep` [N] (host) the rows of it to keep (all
        by default). Experts on a GPU stay there, narrowed to the id type, until `finish` copies them all at once:
        no wait for the device inside the forward."""
        self._keys.append(keys)
        self._experts.append((experts.to(self.dtype), keep))

    def finish(self, layer_ids: list[int]) -> RankRoutes:
        """Sorted by key; a token seen twice (the same row in two forwards) keeps its last record."""
        keys = torch.cat(self._keys) if self._keys else torch.zeros(0, dtype=torch.int64)
        parts = [experts for experts, _ in self._experts]
        on_host = torch.cat(parts).cpu().split([len(p) for p in parts]) if parts else []  # one copy off the device
        kept = [part if keep is None else part[keep] for part, (_, keep) in zip(on_host, self._experts)]
        experts = torch.cat(kept) if kept else torch.zeros(0, len(layer_ids), self.topk, dtype=self.dtype)
        order = torch.arange(keys.numel() - 1, -1, -1)  # newest first, so unique's first occurrence is the newest
        keys, experts = keys[order], experts[order]
        unique, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        first = torch.full((unique.numel(),), keys.numel(), dtype=torch.int64).scatter_reduce_(
            0, inverse, torch.arange(keys.numel()), reduce="amin")
        return RankRoutes(unique, experts[first].contiguous(), tuple(layer_ids), self.batch_shape, self.num_moe_layers, self.topk)


def replay_routes(routes, layouts, lengths: torch.Tensor, *, batch_shape: tuple[int, int], layer_ids, local,
                  num_moe_layers: int, topk: int, num_experts: int) -> RankRoutes:
    """Of the engine's routes ([B, T, L, K] or `batch.PackedRoutes`; R3, validated complete), what one rank's routers replay: the real
    tokens of `layouts` (its microbatches', CP-local) in its sequence-parallel slice (`local`: [B_m, T_m, ...]
    -> [N_local, ...], `local_tokens`), at the MoE layers `layer_ids` of its pipeline stage; keyed like recorded
    R2 routes (uint8 ids up to 256 experts) of a batch of `batch_shape` [B, T]."""
    T = batch_shape[1]
    recorder = RouteRecorder(tuple(batch_shape), num_moe_layers, topk, num_experts)
    layers = torch.tensor(list(layer_ids), dtype=torch.int64)
    for layout in layouts:
        layout = _layout(layout)
        rows, positions = local(layout.rows), local(layout.positions)
        keep = (rows >= 0) & (positions >= 0) & (positions < lengths[rows.clamp(min=0)])
        rows, positions = rows[keep], positions[keep]
        picked = routes[rows, positions] if isinstance(routes, torch.Tensor) else routes.at(rows, positions)
        recorder.add(rows * T + positions, picked.index_select(1, layers))
    return recorder.finish(list(layer_ids))


class RoutingControl:
    """This rank's routers: replay, record and drift measurement (see the module docstring)."""

    def __init__(self, model_chunks: list, arch, ctx) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._actions = RouterReplayAction
        self.ctx = ctx
        self.num_moe_layers = sum(arch.moe_layers) if arch.num_experts else 0
        self.topk = arch.moe_topk
        self.num_experts = arch.num_experts
        moe_index = [sum(arch.moe_layers[:i]) for i in range(arch.num_layers)] if arch.num_experts else []
        self.routers: list = []
        self.layer_ids: list[int] = []  # global MoE-layer index of each local router
        for chunk in model_chunks:
            model = unwrap_model(chunk)
            for layer in getattr(getattr(model, "decoder", None), "layers", []):
                router = getattr(getattr(layer, "mlp", None), "router", None)
                if router is None:
                    continue
                if router.router_replay is None:
                    raise RuntimeError("the model's routers have no RouterReplay: build it with moe_enable_routing_replay=True")
                self.routers.append(router)
                self.layer_ids.append(moe_index[layer.layer_number - 1])
        self._hooks = [r.register_forward_hook(self._make_hook(i)) for i, r in enumerate(self.routers)]
        self._counts_tokens = [bool(r.enable_expert_bias) for r in self.routers]
        # Per router, the padding masks [N_local] of the microbatches whose counted forward is still to come (FIFO).
        self._padding: list[deque] = [deque() for _ in self.routers]
        self._active = False
        self._reference: list[torch.Tensor] | None = None
        self._counted: torch.Tensor | None = None
        # per MoE layer: [used differs, own differs, counted] (on the device: no host sync per forward)
        self.counts = torch.zeros(max(self.num_moe_layers, 1), 3, dtype=torch.float64, device=ctx.device)
        self._layer_index = torch.tensor(self.layer_ids, dtype=torch.int64, device=ctx.device)
        # This forward's experts of each local router (used: its routing map or ids; own: its own top-k ids under replay,
        # else None), compared with the reference for every layer at once in end_microbatch rather than once per layer.
        self._flags: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(self.routers)
        self._peers: dict[int, tuple] | None = None  # R3: the share group's (TP rank, CP rank, MoE layers) by rank

    # -- conversion -------------------------------------------------------------------------------

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        return local_tokens(x, tp_rank=self.ctx.tp_rank, tp_size=self.ctx.tp_size, sequence_parallel=self.ctx.sequence_parallel)

    def _per_layer(self, routes_mb: torch.Tensor) -> list[torch.Tensor]:
        local = self._local(routes_mb)  # [N_local, L, K]
        return self._to_routers(local[:, list(self.layer_ids)])

    def _to_routers(self, routes: torch.Tensor) -> list[torch.Tensor]:
        """[N_local, L_local, K] host routes (ids >= 0) -> one [N_local, K] int64 tensor per local router on the device:
        one copy for every layer (pinned, non-blocking: no stream synchronisation per layer), of the ids in their
        narrowest type (a quarter or an eighth of int64's bytes over the host link), widened on the device."""
        wire = host_to_device(routes.to(expert_id_dtype(self.num_experts)).contiguous(), self.ctx.device)
        return [wire[:, c].to(torch.int64, memory_format=torch.contiguous_format) for c in range(wire.shape[1])]

    def _rank_lookup(self, routes: RankRoutes, layout: TokenLayout, lengths: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per local router [N_local, K] int64 from this rank's recorded routes (padding: experts 0..K-1), and found [N_local]."""
        if routes.layer_ids != tuple(self.layer_ids):
            raise ValueError(
                f"this rank's routes hold MoE layers {routes.layer_ids} of a [B, T] = {routes.batch_shape} batch, its "
                f"routers are layers {tuple(self.layer_ids)}: replay routes on the rank and layout that made them (R2: "
                "actor.prepare_batch and actor.train_step on the same actor and batch; R3: the share this actor's "
                "actor.distribute made)"
            )
        rows, positions = self._local(layout.rows), self._local(layout.positions)
        experts, found = routes.lookup(rows, positions)
        real = (rows >= 0) & (positions >= 0) & (positions < lengths[rows.clamp(min=0)])
        if bool((real & ~found).any()):
            missing = int((real & ~found).nonzero()[0, 0])
            raise ValueError(
                f"no route on this rank for row {int(rows[missing])} position {int(positions[missing])}: routes are replayed "
                "on the rank that holds them; R2: record them with actor.prepare_batch(batch) on this batch share; R3: "
                "train the share this actor's actor.distribute made"
            )
        default = torch.arange(self.topk, dtype=torch.int64).expand_as(experts[:, 0])
        return self._to_routers(torch.where(found[:, None, None], experts, default[:, None])), found

    # -- R3's engine routes under actor.distribute --------------------------------------------------

    def share_cut(self, share, microbatches, multiple: int, *, tp_rank: int | None = None, cp_rank: int | None = None,
                  layer_ids=None) -> RankRoutes:
        """Of a share's engine routes, those a rank of this layout replays (this rank's by default): its TP rank's
        sequence-parallel slice of its CP rank's chunks of the share's `microbatches` (packed with `multiple`), at
        its stage's MoE layers `layer_ids` (none: no token kept)."""
        ctx = self.ctx
        tp_rank, cp_rank = ctx.tp_rank if tp_rank is None else tp_rank, ctx.cp_rank if cp_rank is None else cp_rank
        layer_ids = tuple(self.layer_ids if layer_ids is None else layer_ids)
        lengths = share.lengths()
        layouts = (microbatch_layout(mb, lengths, multiple=multiple, cp_size=ctx.cp_size, cp_rank=cp_rank)
                   for mini in microbatches for mb in mini)
        local = partial(local_tokens, tp_rank=tp_rank, tp_size=ctx.tp_size, sequence_parallel=ctx.sequence_parallel)
        return replay_routes(share.routed_experts, layouts if layer_ids else (), lengths, batch_shape=(share.batch_size, share.seq_len),
                             layer_ids=layer_ids, local=local, num_moe_layers=self.num_moe_layers, topk=self.topk,
                             num_experts=self.num_experts)

    def share_peers(self) -> dict[int, tuple]:
        """(TP rank, CP rank, MoE layers) of each rank of this rank's share group (ctx.share_group), by global rank:
        one all-gather in that group, the first time."""
        if self._peers is None:
            everyone = [None] * dist.get_world_size(self.ctx.share_group)
            mine = (self.ctx.rank, self.ctx.tp_rank, self.ctx.cp_rank, tuple(self.layer_ids))
            dist.all_gather_object(everyone, mine, group=self.ctx.share_group)
            self._peers = {rank: tuple(rest) for rank, *rest in everyone}
        return self._peers

    def split_share(self, share, microbatches, multiple: int, peers: dict[int, tuple]):
        """On a share group's leader (actor.distribute's split): the share without its engine routes, and each
        peer's cut of them ({rank: {"routed_experts": RankRoutes}})."""
        if share.routed_experts is None:
            return share, {}
        return share.replace(routed_experts=None), {
            rank: {"routed_experts": self.share_cut(share, microbatches, multiple, tp_rank=tp, cp_rank=cp, layer_ids=layers)}
            for rank, (tp, cp, layers) in peers.items()}

    # -- one microbatch ---------------------------------------------------------------------------

    def begin_microbatch(
        self,
        layout: TokenLayout | Microbatch,
        lengths: torch.Tensor,
        *,
        replay: torch.Tensor | None = None,
        reference: torch.Tensor | None = None,
        record: bool = False,
    ) -> None:
        """Set this microbatch's replay indices ([B, T, L, K] routes of the batch) / RECORD, and the drift reference."""
        if not self.routers:
            return
        layout = _layout(layout)
        if any(self._counts_tokens):
            padding = host_to_device(self._local(~layout.real(lengths)), self.ctx.device)
            for queue in self._padding:
                queue.append(padding)
        replayed = None
        if replay is not None:
            if isinstance(replay, RankRoutes):
                replayed = self._rank_lookup(replay, layout, lengths)
                indices_per_layer = replayed[0]
            else:
                indices_per_layer = self._per_layer(microbatch_routes(replay, layout, self.topk))
            for router, indices in zip(self.routers, indices_per_layer):
                router.router_replay.set_target_indices(indices)
                router.router_replay.set_router_replay_action(self._actions.REPLAY_FORWARD)
        elif record:
            for router in self.routers:
                router.router_replay.set_router_replay_action(self._actions.RECORD)
        else:
            for router in self.routers:
                router.router_replay.clear_router_replay_action()
        self._reference = None
        if isinstance(reference, RankRoutes):
            _, _, counted = microbatch_positions(layout, lengths)
            # the replayed routes themselves (R2's training forward, R3's): looked up and copied once
            self._reference, found = replayed if reference is replay else self._rank_lookup(reference, layout, lengths)
            counted_local = torch.zeros(found.shape[0], max(self.num_moe_layers, 1), dtype=torch.bool)
            counted_local[:, list(self.layer_ids)] = (self._local(counted) & found)[:, None]
            self._counted = host_to_device(counted_local, self.ctx.device)
        elif reference is not None:
            _, _, counted = microbatch_positions(layout, lengths)
            raw = gathered_routes(reference, layout)
            # Positions whose reference route was not captured (-1) are not counted.
            captured = (raw >= 0).all(dim=-1)  # [N_in, W_in, L]
            self._reference = self._per_layer(_default_where_missing(raw, self.topk))
            counted_local = self._local(counted.unsqueeze(-1) & captured)  # [N_local, L]
            self._counted = host_to_device(counted_local, self.ctx.device)
        self._active = True

    def end_microbatch(self, layout: TokenLayout | Microbatch | None = None, record_into: RouteRecorder | None = None) -> None:
        """After the model forward: add the routes this rank's routers recorded to `record_into`."""
        self._active = False
        if not self.routers:
            return
        self._add_drift_counts()
        if record_into is not None and layout is not None:
            layout = _layout(layout)
            rows, positions = self._local(layout.rows), self._local(layout.positions)
            keep = (rows >= 0) & (positions >= 0) & (positions < record_into.batch_shape[1])
            recorded = [router.router_replay.get_recorded_indices() for router in self.routers]
            if any(r is None for r in recorded):
                raise RuntimeError("a router recorded no indices: is moe_router_fusion on (it bypasses RouterReplay)?")
            # [N, L_local, K] where the routers ran; the rows to keep are picked on the host once the forward is done
            record_into.add(rows[keep] * record_into.batch_shape[1] + positions[keep], torch.stack(recorded, dim=1), keep)
        for router in self.routers:
            if router.router_replay.router_replay_action == self._actions.REPLAY_FORWARD:
                # Recomputation in backward (model.recompute) pops this step's indices in order.
                router.router_replay.set_router_replay_action(self._actions.REPLAY_BACKWARD)

    def reset(self) -> None:
        """Clear actions and indices of every local router (after each forward_backward call)."""
        self._active = False
        self._reference = None
        self._flags = [None] * len(self.routers)
        for queue in self._padding:
            queue.clear()
        for router in self.routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()

    def close(self) -> None:
        """Remove hooks and drop this model's instances from megatron's global RouterReplay list."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        for hook in self._hooks:
            hook.remove()
        mine = {id(r.router_replay) for r in self.routers}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine
        ]
        self.routers = []

    # -- drift ------------------------------------------------------------------------------------

    def _own_topk(self, router, hidden: torch.Tensor) -> torch.Tensor:
        """The router's own top-k (what it would choose without replay), as moe_utils.topk_routing_with_score_function picks.

        softmax: over the logits (or the probabilities with pre-softmax); sigmoid: over
        sigmoid scores plus the expert bias; group-limited routing first keeps the
        best moe_router_group_topk of moe_router_num_groups groups (megatron's group_limited_topk).
        """
        from megatron.core.transformer.moe.moe_utils import group_limited_topk

        config = router.config
        logits = router.gating(hidden).reshape(-1, config.num_moe_experts).float()
        if router.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1) if config.moe_router_pre_softmax else logits
        else:
            scores = torch.sigmoid(logits)
        if router.expert_bias is not None:
            scores = scores + router.expert_bias
        if config.moe_router_num_groups:
            num_tokens = scores.shape[0]
            groups, group_topk = config.moe_router_num_groups, config.moe_router_group_topk
            return group_limited_topk(scores, router.topk, num_tokens, config.num_moe_experts, groups, group_topk)[1]
        return scores.topk(router.topk, dim=1).indices

    def _uncount_padding(self, index: int, router, routing_map: torch.Tensor) -> None:
        """Take the padding positions' routes out of the router's expert-bias token count (see the module docstring)."""
        if not (self._counts_tokens[index] and torch.is_grad_enabled() and self._padding[index]):
            return  # megatron counts only with gradients enabled (Router._apply_expert_bias)
        padding = self._padding[index].popleft()
        with torch.no_grad():
            padded_routes = experts_count(routing_map, padding, router.config.num_moe_experts)
            router.local_tokens_per_expert -= padded_routes.to(router.local_tokens_per_expert.dtype)

    def _make_hook(self, index: int):
        replaying = (self._actions.REPLAY_FORWARD, self._actions.REPLAY_BACKWARD)

        def hook(router, args, output):
            self._uncount_padding(index, router, output[1])
            if not self._active or self._reference is None:
                return
            with torch.no_grad():
                # output[1]: [N_local, E] bool or [N_local, K] ids (set_differs), the experts this forward used; without
                # replay the router used its own top-k
                own = self._own_topk(router, args[0]) if router.router_replay.router_replay_action in replaying else None
                self._flags[index] = (output[1].detach(), own)

        return hook

    def _add_drift_counts(self) -> None:
        """Add this forward's drift flags to `counts`: a few ops per microbatch, whatever the number of layers."""
        flags, self._flags = self._flags, [None] * len(self.routers)
        if self._counted is None or any(f is None for f in flags):
            return
        with torch.no_grad():
            counted = self._counted.index_select(1, self._layer_index).t()  # [R, N_local]
            reference = torch.stack(self._reference)  # [R, N_local, K]
            used = set_differs(torch.stack([f[0] for f in flags]), reference)
            own = used if all(f[1] is None for f in flags) else set_differs(torch.stack([f[1] for f in flags]), reference)
            sums = torch.stack([(used & counted).sum(1), (own & counted).sum(1), counted.sum(1)], dim=1)
            self.counts.index_add_(0, self._layer_index, sums.to(self.counts.dtype))

    def take_drift_metrics(self, prefix: str, *, own_prefix: str | None = None) -> dict[str, float]:
        """All-reduce (world) and reset the drift counts; per layer and overall fractions.

        ``{prefix}/layer_{l}``: tokens whose used top-k set differs from the reference;
        ``{own_prefix}/layer_{l}``: the same for the router's own top-k (equal without replay).
        Every rank must call it (one all-reduce).
        """
        counts = self.counts.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts, group=self.ctx.world_group)
        counts = counts.cpu()
        self.counts.zero_()
        out: dict[str, float] = {}
        total = counts[:, 2].sum().item()
        if total == 0:
            return out
        for column, name in ((0, prefix), (1, own_prefix)):
            if name is None:
                continue
            for layer in range(self.num_moe_layers):
                n = counts[layer, 2].item()
                out[f"{name}/layer_{layer}"] = counts[layer, column].item() / n if n else float("nan")
            out[name] = counts[:, column].sum().item() / total
        return out


__all__ = ["RankRoutes", "RouteRecorder", "RoutingControl", "experts_count", "local_tokens", "microbatch_positions",
           "microbatch_routes", "replay_routes", "set_differs"]
