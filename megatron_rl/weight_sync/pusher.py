"""The trainer's one call for a push: `WeightPusher.push(version)` on every trainer rank at once.

    pusher = WeightPusher(cfg.rollout, ctx, actor.model, engine_or_None, placement=placement, cluster=cfg.cluster)
    metrics = pusher.push(step + 1)     # every rank; the engines serve version step + 1 after it
    pusher.close()

Which path a push takes is decided here and nowhere else:
1. rollout.weight_senders=owners: every rank that owns weights sends its own
   buckets (models.export_owners), broadcast into the engines' workers
   (weight_sync.parallel; a sparse delta with rollout.weight_delta,
   weight_sync.delta) or by memory handle to colocated servers
   (weight_sync.owner_ipc);
2. rollout.weight_transport=vllm_*: vLLM's own weight-transfer engines
   (weight_sync.vllm_transfer), made at the first push and again after a
   broken one, the push checked against the engines' manifest before any
   tensor moves;
3. otherwise the funnel: every rank joins the export through rank 0
   (models.export_hf_weights), which streams it into the engine by rpc,
   broadcast or memory handle, as the engine's transport says
   (weight_sync.push.push_weights; colocated servers' memory handles through
   their relay, weight_sync.ipc).

Recovery is the same on every path: a push that breaks midway leaves every
engine on its previous complete version (weight_sync.protocol) and every rank
learns of it (one all_reduce); the funnel and owner pushes are made again from
a fresh export, up to rollout.max_restarts + 1 times; a broken push by vLLM's
engines drops them on every rank (made again at the next push) and raises.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlparse

from megatron_rl.actor.distribute import broadcast_object
from megatron_rl.config.core import ConfigError
from megatron_rl.config.placement import Placement, resolve_placement
from megatron_rl.config.schema import ClusterConfig, RolloutConfig
from megatron_rl.models.export import export_hf_weights, funnel_plan, plan_is_current
from megatron_rl.models.export_owners import export_owned_weights, owner_plan
from megatron_rl.weight_sync.broadcast import default_host
from megatron_rl.weight_sync.delta import DeltaEncoder
from megatron_rl.weight_sync.engine_side import WeightReceiver
from megatron_rl.weight_sync.ipc_reference import allow_by_reference
from megatron_rl.weight_sync.manifest import WeightPushError
from megatron_rl.weight_sync.owner_ipc import owner_ipc_push
from megatron_rl.weight_sync.parallel import OwnerSenders, owner_parallel_push
from megatron_rl.weight_sync.push import any_rank, push_weights
from megatron_rl.weight_sync.stream import PushBrokenError, check_announced
from megatron_rl.weight_sync.vllm_transfer import VllmTransfer, start_for_run

logger = logging.getLogger(__name__)


class WeightPusher:
    """Every trainer rank's push of the actor's weights into the rollout engines (see the module docstring)."""

    def __init__(
        self,
        rollout: RolloutConfig,
        ctx,
        model_chunks: list,
        engine: WeightReceiver | None = None,
        *,
        placement: Placement | None = None,
        cluster: ClusterConfig | None = None,
        relay: Any = None,
        owner_relay: Any = None,
        engine_urls: list[str] | None = None,
    ):
        """rollout: the run's rollout section as written (the placement resolves it where a path needs that);
        ctx: the ParallelContext (world_group: where the ranks agree on a broken push; host_group: rank 0's objects);
        model_chunks: the actor's model; engine: rank 0's engine, None on the other ranks;
        placement: the engines' placement (config.placement), None for an engine started outside the run;
        cluster: the run's cluster section (the placement rollout.weight_senders=owners checks against);
        relay, owner_relay: colocated servers' memory-handle relays (weight_sync.ipc.IpcRelay,
        weight_sync.owner_ipc.OwnerIpcRelay), None elsewhere; engine_urls: the colocated servers' addresses."""
        self.rollout, self.ctx, self.model_chunks, self.engine = rollout, ctx, model_chunks, engine
        self.placement, self.cluster = placement, cluster
        self.relay, self.owner_relay, self.engine_urls = relay, owner_relay, list(engine_urls or [])
        self.bucket_bytes = int(rollout.weight_bucket_mb * (1 << 20))  # 512 MB -> 512 x 2^20 = 536,870,912 bytes
        self._senders: OwnerSenders | None = None  # rollout.weight_senders=owners: the groups, made at the first push
        self._delta: DeltaEncoder | None = None  # rollout.weight_delta: what the engines hold, kept across pushes
        self._owner_plan = None  # rollout.weight_senders=owners: models.export_owners.owner_plan, made at the first push
        self._funnel_plan = None  # the funnel's models.export.funnel_plan, made at the first push
        self._vllm: VllmTransfer | None = None  # vLLM's trainer engines (rollout.weight_transport=vllm_*)

    def push(self, version: int) -> dict[str, float]:
        """Push the actor's weights as `version` (every rank at once; see the module docstring for the path).

        Returns this rank's metrics of the push: with rollout.weight_senders=owners the bytes it sent
        (weight_sync/sent_bytes), whether they went as a sparse delta (weight_sync/delta) and, colocated by memory
        handle, the bytes it received for its GPU's workers (weight_sync/received_bytes); else none.
        Raises WeightPushError (refused, the engines untouched) or PushBrokenError (broken on every attempt)."""
        self._share_parameters()
        if self.rollout.weight_senders == "owners":
            return self._owner_push(version)
        if self.placement is not None and self.placement.transport.startswith("vllm_"):
            self._vllm_push(version)
            return {}
        self._funnel_push(version)
        return {}

    def _stale(self, plan) -> bool:
        """No plan yet, or one whose shards changed shape or dtype on some rank (every rank calls it: a collective)."""
        return plan is None or any_rank(not plan_is_current(plan), self.ctx.world_group)

    def close(self) -> None:
        """Drop vLLM's trainer engines (the owner groups and relays end with their engines), the delta's base and
        the export plans (they hold the model's parameters)."""
        self._delta = self._owner_plan = self._funnel_plan = None
        if self._vllm is not None:
            self._vllm.shutdown()
            self._vllm = None

    # ---- the funnel: every rank joins the export, rank 0 streams it in ---------------------------
    def _funnel_push(self, version: int) -> None:
        # a transport that copies each bucket out at once (a shared or packed buffer, bytes on a wire) takes the
        # pushing rank's parameters themselves; an in-process engine gets tensors by reference: fresh copies
        fresh = self.placement is None or self.placement.kind == "in_process"
        relay = self.relay

        def export():  # colocated servers by memory handles: every rank shares each bucket with its GPU's worker
            if self._stale(self._funnel_plan):  # the holders and entries of this model and layout: once per run
                self._funnel_plan = funnel_plan(self.model_chunks, self.ctx)
            buckets = export_hf_weights(self.model_chunks, self.ctx, bucket_bytes=self.bucket_bytes, fresh=fresh,
                                        plan=self._funnel_plan)
            return relay.wrap(buckets) if relay is not None else buckets

        try:
            push_weights(self.engine, export, version, group=self.ctx.world_group,
                         max_attempts=self.rollout.max_restarts + 1)
        finally:
            if relay is not None:
                relay.close()

    def _share_parameters(self) -> None:
        """An engine process on this rank's device that takes memory handles copies straight from the parameters
        (weight_sync.ipc_reference): on the host they move into shared memory once (a no-op after that); on a GPU
        their storages are noted at every push (an offloaded actor's come back as new ones)."""
        placement = self.placement
        if (self.engine is not None and placement is not None and placement.transport == "ipc"
                and placement.kind == "engine_process"):
            device = self.ctx.device.type  # (not an offloaded actor's host copies on a GPU)
            allow_by_reference([p for chunk in self.model_chunks for p in chunk.parameters() if p.device.type == device])

    # ---- owners: every rank sends its own buckets --------------------------------------------------
    def _owner_push(self, version: int) -> dict[str, float]:
        """Every owner rank sends its own buckets (weight_sync.parallel or, colocated by memory handle,
        weight_sync.owner_ipc), made again from a fresh export when a push breaks midway (every rank learns of it)."""
        if self._senders is None:
            self._senders = self._owner_senders()
            self._delta = DeltaEncoder(self.rollout.weight_delta_full_every) if self.rollout.weight_delta else None
        ctx, relay, attempts = self.ctx, self.owner_relay, self.rollout.max_restarts + 1
        for attempt in range(1, attempts + 1):
            if self._stale(self._owner_plan):  # the owners and rounds of this model and layout: once per run
                self._owner_plan = owner_plan(self.model_chunks, ctx, bucket_bytes=self.bucket_bytes,
                                              max_senders=self.rollout.weight_senders_max)
            export = export_owned_weights(self.model_chunks, ctx, bucket_bytes=self.bucket_bytes, plan=self._owner_plan)
            try:
                if self.engine is not None:
                    sent = self.engine.owner_push(export, version, senders=self._senders, relay=relay, delta=self._delta,
                                                  group=ctx.world_group, rank=ctx.rank)
                elif relay is not None:
                    sent = owner_ipc_push(None, export, version, relay=relay, rank=ctx.rank, trainer_group=ctx.world_group)
                else:
                    sent = owner_parallel_push(None, export, version, senders=self._senders, rank=ctx.rank,
                                               trainer_group=ctx.world_group, delta=self._delta)
                return _owner_metrics(sent)
            except PushBrokenError:
                if attempt == attempts:
                    raise
                logger.warning("weight push v%d broke midway; exporting again (attempt %d of %d)", version, attempt + 1, attempts)

    def _owner_senders(self) -> OwnerSenders:
        """The owners' broadcast groups (formed at the push), once the placement is known to allow owner pushes."""
        rollout, ctx = self.rollout, self.ctx
        placement = resolve_placement(rollout, world_size=ctx.world_size, cluster=self.cluster)
        if placement.transport != "broadcast" and self.owner_relay is None:  # decided on every rank alike
            raise ConfigError(f"rollout.weight_senders=owners sends by broadcast, or by memory handle to colocated "
                              f"servers, but this placement ({placement.kind}) takes weights by {placement.transport}: "
                              "set rollout.weight_transport=broadcast (an engine process or servers) or "
                              "rollout.weight_senders=rank0")
        if self.owner_relay is not None and rollout.weight_delta:
            raise ConfigError("rollout.weight_delta=true sends by broadcast; colocated servers take weights by memory "
                              "handle here (rollout.weight_transport=ipc): set weight_transport=broadcast or "
                              "weight_delta=false")
        backend = placement.broadcast_backend
        if backend == "auto":  # servers on GPUs of their own: NCCL; an engine sharing a trainer GPU or CPU: gloo
            backend = "nccl" if placement.kind == "remote_servers" and ctx.device.type == "cuda" else "gloo"
        host = rollout.weight_broadcast_host or default_host([urlparse(u).hostname or "" for u in rollout.server_urls])
        return OwnerSenders(backend, host, rollout.request_timeout_s)

    # ---- vLLM's own weight-transfer engines --------------------------------------------------------
    def _vllm_push(self, version: int) -> None:
        """Every rank sends through vLLM's trainer engines (made at the first push, and again after a broken one:
        the engine then says its weights are lost, WeightsLostError, and the trainer pushes again)."""
        rollout, ctx = self.placement.rollout_config(self.rollout), self.ctx
        if self._vllm is None:
            urls = rollout.server_urls or self.engine_urls
            host = rollout.weight_broadcast_host or default_host([urlparse(u).hostname or "" for u in urls])
            clients = self.engine.weight_sync_clients() if self.engine is not None else None
            self._vllm = start_for_run(rollout.weight_transport, rollout, ctx, self.model_chunks,
                                       engines=self.placement.engines, clients=clients, host=host,
                                       share=lambda obj: broadcast_object(obj, ctx))
            self._check_vllm_push(version)
        error: PushBrokenError | None = None
        try:
            if self.engine is not None:
                self.engine.vllm_push(self._vllm.send, version)
            else:
                self._vllm.send(version)
        except PushBrokenError as raised:
            error = raised
        if any_rank(error is not None, ctx.world_group):  # every rank drops its engines: made again next push
            self.close()
            raise error or PushBrokenError(f"weight push v{version} by {rollout.weight_transport} broke on another "
                                           "rank", [])

    def _check_vllm_push(self, version: int) -> None:
        """Every rank: refuse a push by vLLM's engines whose tensors do not fit the engines' manifest (checked on rank
        0, which holds it), before any tensor moves: vLLM's own routes do not check names, shapes or dtypes."""
        refused: WeightPushError | None = None
        if self.engine is not None:
            try:
                check_announced(self.engine.manifest, self._vllm.entries)
            except WeightPushError as error:
                refused = error
        if any_rank(refused is not None, self.ctx.world_group):
            self.close()
            raise refused or WeightPushError(f"weight push v{version} refused by the engines' manifest (see rank 0)")


def _owner_metrics(sent: dict | None) -> dict[str, float]:
    """This rank's part of an owner push as metrics (None: a push the engines refused, on a rank without them)."""
    if sent is None:
        return {}
    metrics = {"weight_sync/sent_bytes": float(sent["wire_bytes"] if "wire_bytes" in sent else sent["sent_bytes"]),
               "weight_sync/delta": float(sent.get("delta", False))}
    if "received_bytes" in sent:  # colocated by memory handle: other owners' buckets for this rank's workers
        metrics["weight_sync/received_bytes"] = float(sent["received_bytes"])
    return metrics
