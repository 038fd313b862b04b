"""Colocated pushes by memory handle without a funnel: every owner sends its own buckets to the devices of the workers.

    relay = OwnerIpcRelay(rank=..., engine_ranks=..., group=world, object_group=gloo_world)   # kept across pushes
    export = export_owned_weights(chunks, ctx, bucket_bytes=...)                             # models.export_owners
    owner_ipc_push(targets if rank == 0 else None, export, version, relay=relay, rank=rank, trainer_group=world)

Colocated servers (rollout.colocated) have engine workers on the trainer's
own devices: worker j of engine i maps the memory of trainer rank
`engine_ranks[i][j]` (weight_sync.ipc). weight_sync.ipc.IpcRelay gives each
of those ranks its copy of every bucket from the pushing rank 0, so the
whole model leaves rank 0. Here (rollout.weight_senders=owners with
weight_transport=ipc) each bucket starts on the rank that owns it
(models.export_owners) and goes from there, point to point over the
trainer's group (NCCL on GPUs, gloo on the host), to every other rank whose
device holds workers; rank 0 only sends the engines the small handle and
layout messages. Bytes a rank sources: its own share, about model / senders
(`OwnerIpcRelay.sent_bytes` counts them once, whatever the fan-out); bytes
a worker rank receives: the rest of the model (its worker needs every byte
on its own device).

One push, on every trainer rank (as weight_sync.parallel, whose checks and
recovery it shares):
1. rank 0 checks the whole push against the engines' manifest (refused:
   nothing moves) and begins the push on every engine;
2. per round: every rank makes its bucket; the round's parts (one sender's
   bucket each) go in slices of at most `max_parts`; per slice the ranks
   agree that all is well, rank 0 tells the others which buffers every
   worker let go of (written again from now on), each part lands in a
   shared buffer on every worker rank (the owner packs it there, the others
   receive it from the owner), every worker rank exports one handle per
   worker it hosts and the handles are gathered to rank 0, which sends each
   engine ONE message with the slice's buckets (`mrl_ipc_receive` with
   'buckets': one RPC per slice, not per bucket);
3. the ranks agree the last slice went through; rank 0 commits every engine.
A slice that fails on any rank stops every rank at the next agreement:
rank 0 aborts the push on every engine (each back on a complete version)
and every rank raises PushBrokenError.

Buffers alive on a worker rank: the slice's parts (at most max_parts,
whatever the number of senders) plus those its workers have not let go of
yet (their loading's queue: about two slices), never the model.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.weight_sync.broadcast import call_in_threads, gpu_uuid, pack_bucket, wait_for_engines
from megatron_rl.weight_sync.ipc import BufferPool, _released_by_all, default_device, export_handle
from megatron_rl.weight_sync.manifest import WeightManifest, WeightPushError
from megatron_rl.weight_sync.parallel import MAX_PARTS, _meta_layout
from megatron_rl.weight_sync.push import (
    any_rank, begin_push, broken_push, check_round, commit_push, refuse_or_none, restore_complete_versions,
)
from megatron_rl.weight_sync.stream import AnnouncedPush

RECEIVE_METHOD = "mrl_ipc_receive"


class OwnerIpcRelay:
    """One trainer rank's part in owner-parallel IPC pushes (see the module docstring); keep one per rank.

    engine_ranks[i][j]: the trainer rank on whose device worker j of engine i runs (config.placement.worker_ranks).
    group: moves the bytes (the trainer's world: NCCL on GPUs, gloo on the host); object_group: a gloo group over
    the same ranks for the small messages. Ranks are global ranks of `group`."""

    def __init__(self, *, rank: int, engine_ranks: list[list[int]], group: Any = None, object_group: Any = None,
                 device: torch.device | None = None, timeout_s: float = 600.0, max_parts: int = MAX_PARTS):
        self.rank = int(rank)
        self.engine_ranks = [[int(r) for r in ranks] for ranks in engine_ranks]
        self.worker_ranks = sorted({r for ranks in self.engine_ranks for r in ranks})
        self.copies = sum(r == self.rank for ranks in self.engine_ranks for r in ranks)
        """Workers that map this rank's copy of each bucket (one handle each)."""
        self.group, self.object_group = group, object_group
        self.pool = BufferPool(device if device is not None else default_device())
        self.timeout_s = float(timeout_s)
        self.max_parts = max(1, int(max_parts))
        """Buckets shared at once (one engine message): a round of more senders goes in slices of this many, so a
        worker rank holds a few slices' buffers, whatever the number of senders (the world size)."""
        self.sent_bytes = 0
        """Bytes of this rank's own buckets it sent to the worker ranks, over every push (each byte once)."""
        self.received_bytes = 0
        """Bytes of other owners' buckets this rank received for its workers, over every push."""
        self._scratch: torch.Tensor | None = None  # an owner without workers packs here

    def _buffer(self, bucket_id: int, nbytes: int) -> torch.Tensor:
        if self.copies:
            return self.pool.take(bucket_id, nbytes)
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.pool.device)
        return self._scratch[:nbytes]

    def share_round(self, parts: list, bucket: list | None, first_id: int, released: list[int]) -> dict | None:
        """Collective over the trainer's group: every part of a round on every worker rank's device, and (on rank 0)
        {'ids', 'layouts', 'handles': {rank: (handles per part, gpu)}}. released: bucket ids every worker let go of
        (rank 0's list; the others get it here)."""
        holder = [list(released)]
        dist.broadcast_object_list(holder, src=0, group=self.object_group)
        for bucket_id in holder[0]:
            self.pool.release(int(bucket_id))
        ids, layouts, flats, works = [], [], [], []
        for index, (owner, entries) in enumerate(parts):
            layout, bucket_id = _meta_layout(entries), first_id + index
            ids.append(bucket_id)
            layouts.append(layout)
            nbytes = int(layout["nbytes"])
            if owner == self.rank:
                flat = self._buffer(bucket_id, nbytes)
                pack_bucket(bucket, layout, self.pool.device, out=flat)
                if flat.is_cuda:
                    torch.cuda.current_stream(flat.device).synchronize()
                for peer in self.worker_ranks:
                    if peer != self.rank and nbytes:
                        works.append(dist.isend(flat, peer, group=self.group, tag=index))
                self.sent_bytes += nbytes
            elif self.copies:
                flat = self.pool.take(bucket_id, nbytes)
                if nbytes:
                    works.append(dist.irecv(flat, owner, group=self.group, tag=index))
                self.received_bytes += nbytes
            else:
                flat = None
            flats.append(flat)
        for work in works:
            work.wait()
        mine = None
        if self.copies:
            if self.pool.device.type == "cuda":
                torch.cuda.current_stream(self.pool.device).synchronize()  # the workers read on streams of their own
            mine = ([[export_handle(flat) for _ in range(self.copies)] for flat in flats], gpu_uuid(self.pool.device))
        gathered: list[Any] = [None] * dist.get_world_size(self.object_group)
        dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0, group=self.object_group)
        if self.rank != 0:
            return None
        return {"ids": ids, "layouts": layouts, "handles": {r: h for r, h in enumerate(gathered) if h is not None}}

    def messages(self, shared: dict, token: str) -> list[str]:
        """(rank 0) Per engine, the one message of a round: each bucket's layout and each worker's handle of the copy
        on its own device."""
        unused = {rank: [list(handles) for handles in per_part] for rank, (per_part, _) in shared["handles"].items()}
        out = []
        for ranks in self.engine_ranks:
            buckets = []
            for index, (bucket_id, layout) in enumerate(zip(shared["ids"], shared["layouts"])):
                buckets.append({"bucket_id": bucket_id, "layout": layout,
                                "handles": [unused[rank][index].pop(0) for rank in ranks],
                                "trainer_gpus": [shared["handles"][rank][1] for rank in ranks]})
            out.append(json.dumps({"sender": token, "buckets": buckets}))
        return out

    def close(self) -> None:
        """Every buffer goes (the push ended: its workers committed or went back to a complete version)."""
        self.pool.close()
        self._scratch = None


def owner_ipc_push(targets: list | None, export, version: int, *, relay: OwnerIpcRelay, rank: int,
                   trainer_group: Any, manifest: WeightManifest | None = None, repack_moe: bool = True) -> dict | None:
    """One push (see the module docstring) on every trainer rank; targets and manifest on rank 0 only
    (weight_sync.push.PushTarget, each with call_each: every worker answers). Returns {'sent_bytes', 'received_bytes'}
    of this push on every rank, on rank 0 also {'commits', 'tensors', 'bytes'}.
    Raises WeightPushError (refused, nothing moved; on rank 0) or PushBrokenError (on every rank)."""
    mismatch = None
    if targets is not None and len(targets) != len(relay.engine_ranks):
        mismatch = WeightPushError(f"{len(targets)} engines, but the relay knows the devices of {len(relay.engine_ranks)}: "
                            "the placement (config.placement.worker_ranks) and the engines disagree")
    if refuse_or_none(targets, export, manifest, trainer_group, mismatch):
        return None
    announced = AnnouncedPush(export.entries) if targets is not None else None
    token, holders, released = uuid.uuid4().hex, Counter(), []
    sent_before, received_before = relay.sent_bytes, relay.received_bytes
    failure = begin_push(targets, version)
    buckets, next_id, stopped = iter(export), 0, False
    try:
        for parts in export.rounds:
            bucket = None
            if failure is None:
                try:
                    bucket = next(buckets)
                except BaseException as error:  # noqa: BLE001 - agreed below
                    failure = error
            for start in range(0, len(parts), relay.max_parts):  # slices bound the buffers, whatever the senders
                if stopped := any_rank(failure is not None, trainer_group):
                    break
                piece = parts[start : start + relay.max_parts]
                try:
                    shared = relay.share_round(piece, bucket, next_id, released)
                    released = []
                    if targets is not None:
                        released = _send_round(targets, piece, shared, relay, token, holders, announced)
                except BaseException as error:  # noqa: BLE001 - agreed at the next slice
                    failure = error
                next_id += len(piece)
            if stopped:
                break
        result = None
        broken = any_rank(failure is not None, trainer_group)
        if targets is not None and not broken:
            result, failure = commit_push(targets, announced, repack_moe)
        if not any_rank(failure is not None, trainer_group):
            return {**(result or {}), "sent_bytes": relay.sent_bytes - sent_before,
                    "received_bytes": relay.received_bytes - received_before}
        if failure is not None and isinstance(failure, (KeyboardInterrupt, SystemExit)):
            raise failure
        versions = restore_complete_versions(targets) if targets is not None else []
        dist.barrier(group=relay.object_group)  # every engine is back on a complete version before a buffer goes
    finally:
        relay.close()
    raise broken_push("owner-parallel IPC weight push", version, rank, failure, versions) from failure


def _send_round(targets: list, parts: list, shared: dict, relay: OwnerIpcRelay, token: str, holders: Counter,
                announced: AnnouncedPush) -> list[int]:
    """(rank 0) One message per engine with the round's buckets; returns the ids every worker has let go of."""
    check_round(announced, parts)
    messages = relay.messages(shared, token)
    for bucket_id in shared["ids"]:
        holders[bucket_id] = len(targets)
    futures = call_in_threads([partial(t.call_each or t.call, RECEIVE_METHOD) for t in targets], messages,
                              "owner-ipc-receive")
    wait_for_engines(futures, [t.name for t in targets], relay.timeout_s,
                     what=f"a round of {len(parts)} buckets by memory handle to {len(targets)} engine(s)")
    released = []
    for future in futures:
        for bucket_id in _released_by_all(future.result()):
            holders[bucket_id] -= 1
            if holders[bucket_id] <= 0:
                del holders[bucket_id]
                released.append(bucket_id)
    for bucket_id in released:
        relay.pool.release(bucket_id)
    return released
