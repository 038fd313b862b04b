"""The trainer's one call for a push: `WeightPusher.push(version)` on every trainer rank at once.

    pusher = WeightPusher(cfg.rollout, ctx, actor.model, engine_or_None, placement=placement, cluster=cfg.cluster)
    metrics = pusher.push(step + 1)     # every rank; the engines serve version step + 1 after it
    pusher.close()

The placement's transport (config.placement) is looked up in weight_sync.transports, whose file for it holds both
ends of the push; at the first push it gives this run's trainer side:
- rollout.weight_senders=rank0 (the funnel, `FunnelPush`, for rpc, broadcast and ipc): every rank joins the export
  through rank 0 (models.export_hf_weights), which streams it into the engine by its transport
  (weight_sync.push.push_weights); vLLM's own engines (vllm_*) instead, every rank sending its own slice;
- rollout.weight_senders=owners (`OwnerPush`, broadcast or ipc): every rank that owns weights sends its own
  buckets (models.export_owners).
Without a placement (an engine started outside the run) the push goes through the funnel in whatever way the
engine takes weights.

Recovery is the same on every path (weight_sync.push.agree_and_retry): a push that breaks midway leaves every engine
on its previous complete version and every rank learns of it (one all_reduce); the funnel and owner pushes are made
again from a fresh export, up to rollout.max_restarts + 1 times; a broken push by vLLM's engines drops them on every
rank (made again at the next push) and raises.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.config.core import ConfigError
from megatron_rl.config.placement import Placement, resolve_placement
from megatron_rl.config.schema import ClusterConfig, RolloutConfig
from megatron_rl.models.export import export_hf_weights, funnel_plan, plan_is_current
from megatron_rl.models.export_owners import export_owned_weights, owner_plan
from megatron_rl.weight_sync.delta import DeltaEncoder
from megatron_rl.weight_sync.engine_side import WeightReceiver
from megatron_rl.weight_sync.push import agree_and_retry, any_rank, push_weights
from megatron_rl.weight_sync.stream import PushBrokenError
from megatron_rl.weight_sync.transports import TrainerSide, transport_for


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
        self.max_attempts = rollout.max_restarts + 1
        self._side: TrainerSide | None = None  # the transport's trainer side, made at the first push

    def push(self, version: int) -> dict[str, float]:
        """Push the actor's weights as `version` (every rank at once; see the module docstring for the path).

        Returns this rank's metrics of the push: with rollout.weight_senders=owners the bytes it sent
        (weight_sync/sent_bytes), whether they went as a sparse delta (weight_sync/delta) and, colocated by memory
        handle, the bytes it received for its GPU's workers (weight_sync/received_bytes); else none.
        Raises WeightPushError (refused, the engines untouched) or PushBrokenError (broken on every attempt)."""
        if self._side is None:
            self._side = self._trainer_side()
        return self._side.push(version)

    def _trainer_side(self) -> TrainerSide:
        """The trainer side of the placement's transport (see the module docstring); ConfigError where the placement
        does not offer rollout.weight_senders=owners (decided on every rank alike)."""
        if self.rollout.weight_senders != "owners":
            return transport_for(self.placement.transport if self.placement is not None else "rpc").trainer(self)
        placement = resolve_placement(self.rollout, world_size=self.ctx.world_size, cluster=self.cluster)
        side = transport_for("ipc" if self.owner_relay is not None else placement.transport).owners(self, placement)
        if side is None:
            raise ConfigError(f"rollout.weight_senders=owners sends by broadcast, or by memory handle to colocated "
                              f"servers, but this placement ({placement.kind}) takes weights by {placement.transport}: "
                              "set rollout.weight_transport=broadcast (an engine process or servers) or "
                              "rollout.weight_senders=rank0")
        return side

    def stale(self, plan) -> bool:
        """No plan yet, or one whose shards changed shape or dtype on some rank (every rank calls it: a collective)."""
        return plan is None or any_rank(not plan_is_current(plan), self.ctx.world_group)

    def close(self) -> None:
        """Drop what the pushes keep: vLLM's trainer engines, the delta's base and the export plans (they hold the
        model's parameters); the owner groups and relays end with their engines."""
        if self._side is not None:
            self._side.close()


class FunnelPush:
    """The funnel (rollout.weight_senders=rank0): every rank joins the export, rank 0 streams it into its engine."""

    def __init__(self, pusher: WeightPusher):
        self.pusher = pusher
        self._plan = None  # models.export.funnel_plan, made at the first push

    def push(self, version: int) -> dict[str, float]:
        pusher = self.pusher
        # a transport that copies each bucket out at once (a shared or packed buffer, bytes on a wire) takes the
        # pushing rank's parameters themselves; an in-process engine gets tensors by reference: fresh copies
        fresh = pusher.placement is None or pusher.placement.kind == "in_process"
        relay = pusher.relay

        def export():  # colocated servers by memory handles: every rank shares each bucket with its GPU's worker
            if pusher.stale(self._plan):  # the holders and entries of this model and layout: once per run
                self._plan = funnel_plan(pusher.model_chunks, pusher.ctx)
            buckets = export_hf_weights(pusher.model_chunks, pusher.ctx, bucket_bytes=pusher.bucket_bytes,
                                        fresh=fresh, plan=self._plan)
            return relay.wrap(buckets) if relay is not None else buckets

        try:
            push_weights(pusher.engine, export, version, group=pusher.ctx.world_group, max_attempts=pusher.max_attempts)
        finally:
            if relay is not None:
                relay.close()
        return {}

    def close(self) -> None:
        self._plan = None


class OwnerPush:
    """rollout.weight_senders=owners: every owner rank sends its own buckets (`send`, the transport's), made again
    from a fresh export when a push breaks midway (every rank learns of it)."""

    def __init__(self, pusher: WeightPusher):
        self.pusher = pusher
        self.delta = DeltaEncoder(pusher.rollout.weight_delta_full_every) if pusher.rollout.weight_delta else None
        """rollout.weight_delta: what the engines hold, kept across pushes."""
        self._plan = None  # models.export_owners.owner_plan, made at the first push

    def send(self, export: Any, version: int) -> dict | None:
        """One push of `export` (models.export_owners.OwnedExport) on every rank; what this rank sent."""
        raise NotImplementedError

    def push(self, version: int) -> dict[str, float]:
        pusher = self.pusher
        rollout, ctx = pusher.rollout, pusher.ctx

        def attempt() -> dict | None:
            if pusher.stale(self._plan):  # the owners and rounds of this model and layout: once per run
                self._plan = owner_plan(pusher.model_chunks, ctx, bucket_bytes=pusher.bucket_bytes,
                                        max_senders=rollout.weight_senders_max)
            return self.send(export_owned_weights(pusher.model_chunks, ctx, bucket_bytes=pusher.bucket_bytes,
                                                  plan=self._plan), version)

        def elsewhere(attempts: int) -> BaseException:
            return PushBrokenError(f"owner weight push v{version} broke on another rank after {attempts} attempt(s)", [])

        return _owner_metrics(agree_and_retry(attempt, version, group=ctx.world_group,
                                              max_attempts=pusher.max_attempts, elsewhere=elsewhere))

    def close(self) -> None:
        self.delta = self._plan = None


def _owner_metrics(sent: dict | None) -> dict[str, float]:
    """This rank's part of an owner push as metrics (None: a push the engines refused, on a rank without them)."""
    if sent is None:
        return {}
    metrics = {"weight_sync/sent_bytes": float(sent["wire_bytes"] if "wire_bytes" in sent else sent["sent_bytes"]),
               "weight_sync/delta": float(sent.get("delta", False))}
    if "received_bytes" in sent:  # colocated by memory handle: other owners' buckets for this rank's workers
        metrics["weight_sync/received_bytes"] = float(sent["received_bytes"])
    return metrics
