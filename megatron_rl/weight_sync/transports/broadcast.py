"""broadcast: each bucket packed into one buffer and broadcast into every engine worker over a group of their own.

Trainer side, rollout.weight_senders=rank0: the funnel (weight_sync.pusher.FunnelPush); rank 0's engine sends each
bucket with its BroadcastSender (weight_sync.broadcast: NCCL on GPUs, gloo on the host), the group formed with every
engine's workers at the first push and again after a restart (WeightSyncedEngine._broadcaster).
rollout.weight_senders=owners: every rank that owns weights broadcasts its own buckets in a group of its own
(weight_sync.parallel.OwnerSenders, owner_parallel_push), as sparse deltas with rollout.weight_delta
(weight_sync.delta).
Worker side (`BroadcastReceiver`): `mrl_broadcast_join` once, then per bucket `mrl_broadcast_receive(layout)` takes
the broadcast and stages it (weight_sync.push.PushReceiver.mrl_stage_weights); with owners `mrl_owner_join` joins
every sender's group and `mrl_owner_receive` takes one bucket from each sender of a round at once, decoding deltas
against the copy it keeps (`mrl_delta_base`).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable
from urllib.parse import urlparse

import torch

from megatron_rl.weight_sync.broadcast import (
    BroadcastError, backend_device, broadcast_from_root, check_layout, check_not_same_gpu, close_group, default_host, open_group,
    start_broadcast, unpack_bucket, wait_work,
)
from megatron_rl.weight_sync.delta import DeltaHolder
from megatron_rl.weight_sync.parallel import OwnerSenders, owner_parallel_push
from megatron_rl.weight_sync.push import PushReceiver
from megatron_rl.weight_sync.pusher import FunnelPush, OwnerPush


class OwnerBroadcastPush(OwnerPush):
    """Every owner rank broadcasts its own buckets in its own group (weight_sync.parallel)."""

    def __init__(self, pusher: Any, placement: Any):
        super().__init__(pusher)
        rollout, ctx = pusher.rollout, pusher.ctx
        backend = placement.broadcast_backend
        if backend == "auto":  # servers on GPUs of their own: NCCL; an engine sharing a trainer GPU or CPU: gloo
            backend = "nccl" if placement.kind == "remote_servers" and ctx.device.type == "cuda" else "gloo"
        host = rollout.weight_broadcast_host or default_host([urlparse(u).hostname or "" for u in rollout.server_urls])
        self.senders = OwnerSenders(backend, host, rollout.request_timeout_s)
        """This rank's group with every engine worker (formed at the push) and the engines' joins."""

    def send(self, export: Any, version: int) -> dict | None:
        pusher = self.pusher
        rank, group = pusher.ctx.rank, pusher.ctx.world_group
        if pusher.engine is None:
            return owner_parallel_push(None, export, version, senders=self.senders, rank=rank, trainer_group=group,
                                       delta=self.delta)

        def send(targets: list, manifest: Any, workers_per_engine: Callable[[], list[int]]) -> dict | None:
            return owner_parallel_push(targets, export, int(version), senders=self.senders, rank=rank,
                                       trainer_group=group, manifest=manifest, workers_per_engine=workers_per_engine(),
                                       delta=self.delta)

        return pusher.engine.owner_push(send, version, transport="broadcast")


class BroadcastReceiver(PushReceiver):
    """The worker's end of broadcast pushes, from rank 0 and from every owner (see the module docstring)."""

    # ---- rank 0's group ----------------------------------------------------------------------------
    def mrl_broadcast_join(self, info: str | dict) -> int:
        """Join the trainer's weight-broadcast group as rank rank_offset + this worker's rank; returns that rank."""
        info = json.loads(info) if isinstance(info, str) else info
        self.mrl_broadcast_leave()
        device = backend_device(info["backend"])
        check_not_same_gpu(info.get("trainer_gpu", ""), device)
        rank = int(info["rank_offset"]) + int(self.rank)  # type: ignore[attr-defined]
        group = open_group(info["host"], info["port"], rank, info["world_size"], info["backend"], info["timeout_s"])
        self.__dict__["_mrl_broadcast"] = {"group": group, "device": device, "timeout_s": float(info["timeout_s"])}
        return rank

    def mrl_broadcast_leave(self) -> None:
        state = self.__dict__.pop("_mrl_broadcast", None)
        if state is not None:
            close_group(state["group"], state["timeout_s"])

    def mrl_broadcast_receive(self, layout: str | dict) -> int:
        """Take one packed bucket from the trainer's broadcast and stage it (see mrl_stage_weights)."""
        state = self.__dict__.get("_mrl_broadcast")
        if state is None:
            raise BroadcastError("mrl_broadcast_receive before mrl_broadcast_join: this worker is in no broadcast group")
        layout = json.loads(layout) if isinstance(layout, str) else layout
        try:
            check_layout(layout)  # before any buffer is allocated
        except BaseException:
            self.mrl_broadcast_leave()  # the trainer's broadcast of this bucket finds no receiver: the group goes
            self.mrl_abort_push()
            raise
        flat = torch.empty(int(layout["nbytes"]), dtype=torch.uint8, device=state["device"])
        try:
            broadcast_from_root(state["group"], flat, timeout_s=state["timeout_s"])
        except BaseException:
            self.mrl_broadcast_leave()
            self.mrl_abort_push()
            raise
        bucket = unpack_bucket(layout, flat)
        del flat  # the views keep it alive exactly as long as the loading holds them
        return self.mrl_stage_weights(bucket)

    # ---- every owner's group (weight_sync.parallel) ----------------------------------------------------
    def mrl_owner_join(self, info: str | dict) -> int:
        """Join every sender's group (weight_sync.parallel.OwnerSenders) as rank rank_offset + this worker's rank,
        in the order given (every worker opens them in the same order); returns that rank."""
        info = json.loads(info) if isinstance(info, str) else info
        self.mrl_owner_leave()
        rank = int(info["rank_offset"]) + int(self.rank)  # type: ignore[attr-defined]
        timeout_s, groups = float(info["timeout_s"]), {}
        try:
            for entry in info["groups"]:
                groups[int(entry["sender"])] = open_group(entry["host"], entry["port"], rank, info["world_size"],
                                                          info["backend"], timeout_s)
        except BaseException:
            for group in groups.values():
                close_group(group, timeout_s)
            raise
        self.__dict__["_mrl_owners"] = {"groups": groups, "device": backend_device(info["backend"]), "timeout_s": timeout_s}
        return rank

    def mrl_owner_senders(self) -> list[int]:
        """The trainer ranks whose groups this worker is in (weight_sync.parallel), in order."""
        state = self.__dict__.get("_mrl_owners")
        return [] if state is None else sorted(state["groups"])

    def mrl_owner_leave(self) -> None:
        state = self.__dict__.pop("_mrl_owners", None)
        if state is not None:
            for group in state["groups"].values():
                close_group(group, state["timeout_s"])

    def mrl_owner_receive(self, message: str | dict) -> int:
        """Take one bucket from each sender of a round at once ({'parts': [{'sender', 'layout'}]}), then stage each
        (see mrl_stage_weights); returns the tensors staged."""
        state = self.__dict__.get("_mrl_owners")
        if state is None:
            raise BroadcastError("mrl_owner_receive before mrl_owner_join: this worker is in no sender's group")
        parts = (json.loads(message) if isinstance(message, str) else message)["parts"]
        flats, deadline = [], time.monotonic() + state["timeout_s"]
        try:
            for part in parts:
                check_layout(part["layout"])  # before any buffer is allocated
            works = []
            for part in parts:
                flats.append(torch.empty(int(part["layout"]["nbytes"]), dtype=torch.uint8, device=state["device"]))
                works.append(start_broadcast(state["groups"][int(part["sender"])], flats[-1]))
            for part, work in zip(parts, works):
                wait_work(work, f"the bucket of trainer rank {part['sender']}", timeout_s=state["timeout_s"], deadline=deadline)
        except BaseException:
            self.mrl_owner_leave()
            self.mrl_abort_push()
            raise
        staged = 0
        for part in parts:
            bucket = unpack_bucket(part["layout"], flats.pop(0))
            if "meta" in part:  # rollout.weight_delta: kept as the next base, a delta applied to the last one
                holder = self.__dict__.setdefault("_mrl_delta", DeltaHolder())
                try:
                    bucket = holder.decode(bucket, part["meta"], part.get("base"))
                except BaseException:
                    self.mrl_abort_push()
                    raise
            staged += self.mrl_stage_weights(bucket)
        return staged

    def mrl_delta_base(self) -> int | None:
        """The version this worker holds a copy of for weight deltas (None: none, the next push must be full)."""
        holder = self.__dict__.get("_mrl_delta")
        return None if holder is None else holder.base

    def _mrl_push_ended(self, broken: bool) -> None:
        super()._mrl_push_ended(broken)
        if broken and "_mrl_delta" in self.__dict__:
            self.__dict__["_mrl_delta"].reset()  # a broken push: the next one goes in full

    def _mrl_committed(self, version: int) -> None:
        super()._mrl_committed(version)
        if "_mrl_delta" in self.__dict__:
            self.__dict__["_mrl_delta"].commit(version)


class BroadcastTransport:
    """Buckets by broadcast (see the module docstring)."""

    receiver = BroadcastReceiver

    def trainer(self, pusher: Any) -> FunnelPush:
        return FunnelPush(pusher)

    def owners(self, pusher: Any, placement: Any) -> OwnerBroadcastPush:
        return OwnerBroadcastPush(pusher, placement)

    def engine_sender(self, engine_end: Any) -> Callable[[], Any]:
        """The engine's own hook (weight_sync.engine_side.WeightSyncedEngine._broadcaster)."""
        return engine_end._broadcaster


TRANSPORT = BroadcastTransport()
