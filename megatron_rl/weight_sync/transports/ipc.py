"""ipc: buckets by memory handle into engine workers on the trainer's own devices (CUDA IPC on a GPU, shared memory
on the host); no bytes on a wire.

Trainer side, rollout.weight_senders=rank0: the funnel (weight_sync.pusher.FunnelPush); rank 0's engine shares each
bucket with its IpcSender (weight_sync.ipc: an engine process, from rank 0's device; the trainer's own parameters by
reference where they allow it, weight_sync.ipc_reference), or with colocated servers every rank shares each bucket
with the workers on its GPU through the relay (weight_sync.ipc.IpcRelay).
rollout.weight_senders=owners (colocated servers): every owner sends its buckets to the ranks whose GPUs hold
workers, which share them (weight_sync.owner_ipc).
Worker side (`HandleReceiver`): `mrl_ipc_receive(message)` maps the buckets shared with this worker's device
(weight_sync.ipc_receive), stages views of them (weight_sync.push.PushReceiver.mrl_stage_weights) and answers which
buckets it has let go of; the buffers it still maps go when the push ends.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from megatron_rl.config.core import ConfigError
from megatron_rl.weight_sync.ipc_receive import IpcReceiver
from megatron_rl.weight_sync.ipc_reference import allow_by_reference
from megatron_rl.weight_sync.owner_ipc import owner_ipc_push
from megatron_rl.weight_sync.push import PushReceiver
from megatron_rl.weight_sync.pusher import FunnelPush, OwnerPush


class IpcFunnelPush(FunnelPush):
    """The funnel by memory handle: an engine process on rank 0's device copies straight from the parameters."""

    def push(self, version: int) -> dict[str, float]:
        pusher = self.pusher
        if pusher.engine is not None and pusher.placement.kind == "engine_process":
            # on the host the parameters move into shared memory once (a no-op after that); on a GPU their storages
            # are noted at every push (an offloaded actor's come back as new ones; not its host copies on a GPU)
            device = pusher.ctx.device.type
            allow_by_reference([p for chunk in pusher.model_chunks for p in chunk.parameters() if p.device.type == device])
        return super().push(version)


class OwnerIpcPush(OwnerPush):
    """Every owner rank's buckets to the ranks whose GPUs hold workers, shared there (weight_sync.owner_ipc)."""

    def send(self, export: Any, version: int) -> dict | None:
        pusher = self.pusher
        relay, rank, group = pusher.owner_relay, pusher.ctx.rank, pusher.ctx.world_group
        if pusher.engine is None:
            return owner_ipc_push(None, export, version, relay=relay, rank=rank, trainer_group=group)

        def send(targets: list, manifest: Any, workers_per_engine: Callable[[], list[int]]) -> dict | None:
            return owner_ipc_push(targets, export, int(version), relay=relay, rank=rank, trainer_group=group,
                                  manifest=manifest)

        return pusher.engine.owner_push(send, version, transport="ipc")


class HandleReceiver(PushReceiver):
    """The worker's end of pushes by memory handle (see the module docstring)."""

    def mrl_ipc_receive(self, message: str | dict) -> dict:
        """Map the buckets the trainer shared (the handle of this worker's device) and stage each (see
        mrl_stage_weights): one bucket ({'sender', 'bucket_id', 'layout', 'handles', 'trainer_gpus'}) or several
        in one message ({'sender', 'buckets': [...]}, weight_sync.owner_ipc: one call per round).

        Returns {'staged': their tensor count, 'released': ids of the buckets whose memory this worker no longer
        holds, 'mapped': how many of the buffers it had to map anew (the others it still mapped: the trainer wrote
        a released buffer again)}; the trainer writes a bucket's buffer again only after every worker said so."""
        message = json.loads(message) if isinstance(message, str) else message
        receiver = self.__dict__.setdefault("_mrl_ipc", IpcReceiver())
        sender, mapped_before = str(message["sender"]), receiver.mapped
        staged = 0
        for entry in message.get("buckets", [message]):
            try:
                bucket = receiver.open({**entry, "sender": sender}, int(getattr(self, "rank", 0)))
            except BaseException:
                self.mrl_abort_push()
                raise
            # a bucket all by reference (weight_sync.ipc_reference) holds no buffer to give back: queued, not handed
            staged += self.mrl_stage_weights(bucket, handoff=any(entry["handles"]))
            del bucket  # the loading holds the views it still needs
        return {"staged": staged, "released": receiver.take_released(sender), "mapped": receiver.mapped - mapped_before}

    def _mrl_push_ended(self, broken: bool) -> None:
        """A push ended: the trainer's buffers this worker still maps are let go of."""
        super()._mrl_push_ended(broken)
        receiver = self.__dict__.get("_mrl_ipc")
        if receiver is not None:
            receiver.close()


class IpcTransport:
    """Buckets by memory handle (see the module docstring)."""

    receiver = HandleReceiver

    def trainer(self, pusher: Any) -> IpcFunnelPush:
        return IpcFunnelPush(pusher)

    def owners(self, pusher: Any, placement: Any) -> OwnerIpcPush | None:
        """Owners by memory handle go to colocated servers only (their relay); elsewhere none."""
        if pusher.owner_relay is None:
            return None
        if pusher.rollout.weight_delta:
            raise ConfigError("rollout.weight_delta=true sends by broadcast; colocated servers take weights by memory "
                              "handle here (rollout.weight_transport=ipc): set weight_transport=broadcast or "
                              "weight_delta=false")
        return OwnerIpcPush(pusher)

    def engine_sender(self, engine_end: Any) -> Callable[[], Any]:
        """The engine's own hook (weight_sync.engine_side.WeightSyncedEngine._ipc_sender)."""
        return engine_end._ipc_sender


TRANSPORT = IpcTransport()
