"""Weight pushes without a funnel: every owner rank broadcasts its own buckets into every engine worker.

    export = export_owned_weights(chunks, ctx, bucket_bytes=...)          # models.export_owners
    owner_parallel_push(targets if rank == 0 else None, export, version, senders=..., group=world)

Each trainer rank that owns parameters (models.export_owners) has a group of
its own with every engine worker (`OwnerSenders`): rank 0 of it is the
sender, ranks 1..W the workers, each engine's workers in order (as in
weight_sync.broadcast; NCCL on GPUs, gloo on CPU). A worker is in one group
per sender. The bytes of a bucket leave only the rank that owns them: trainer
rank 0 carries its own share, like any other sender, and drives the engines
by RPC with metadata only.

One push, on every trainer rank (one all_reduce of a flag per round on the
trainer's group keeps them in step):
1. rank 0 checks the whole push (every owner's tensors, known from metadata)
   against the engines' manifest; a refused push moves nothing;
2. `mrl_begin_push` on every engine;
3. per round: every rank makes its bucket (TP peers hand owners their shards);
   the ranks agree that all did; rank 0 calls `mrl_owner_receive` on every
   engine with the layout of each sender's bucket, and every sender
   broadcasts its bucket in its own group at the same time: a worker receives
   from the senders of a slice of the round at once (at most MAX_PARTS: its
   buffers do not grow with the senders), then stages each bucket through the
   manifest check and the streaming loader (rollout.worker_ext);
4. the ranks agree the last round went through; rank 0 commits every engine.
A round that fails on any rank (its export raised, a broadcast or an engine
failed) stops every rank at the next agreement: rank 0 aborts the push on
every engine (each goes back to a complete version, weight_sync.push) and every
rank raises PushBrokenError, so weight_sync.push_weights makes the push again
from a fresh export. A broadcast that failed closes the groups; they are
formed again at the next push.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.weight_sync.broadcast import (
    BroadcastError, backend_device, broadcast_from_root, call_in_threads, close_group, describe_bucket, listening_socket,
    open_group, pack_bucket, resolve_backend, wait_for_engines,
)
from megatron_rl.weight_sync.delta import DeltaEncoder
from megatron_rl.weight_sync.manifest import WeightManifest
from megatron_rl.weight_sync.push import (
    any_rank, begin_push, broken_push, check_round, commit_push, refuse_or_none, restore_complete_versions,
)
from megatron_rl.weight_sync.stream import AnnouncedPush

logger = logging.getLogger(__name__)

MAX_PARTS = 4
"""Senders' buckets an engine worker takes at once: a round of more senders goes in slices of this many, so a
worker's buffers stay a few buckets whatever the number of senders (the world size)."""

RECEIVE_METHOD = "mrl_owner_receive"
JOIN_METHOD = "mrl_owner_join"


def _meta_layout(entries: list) -> dict:
    """describe_bucket of a bucket known by its entries only (meta tensors: no data)."""
    return describe_bucket([(name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
                            for name, shape, dtype in entries])


class OwnerSenders:
    """This trainer rank's own group with every engine worker (when it owns parameters), and the join of all
    senders' groups by the engines (driven from rank 0). Keep one per trainer rank across pushes."""

    def __init__(self, backend: str = "auto", host: str = "127.0.0.1", timeout_s: float = 600.0):
        self.backend = resolve_backend(backend)
        self.host = host
        self.timeout_s = float(timeout_s)
        self.device = backend_device(self.backend)
        self.group: Any = None
        self.senders: list[int] = []
        """The trainer ranks whose groups the engines joined (empty: not formed)."""
        self.sent_bytes = 0
        """Bytes this rank broadcast to the engines, over every push (packed buckets)."""
        self._buffer: torch.Tensor | None = None

    def connect(self, senders: list[int], rank: int, trainer_group: Any, targets: list | None,
                workers_per_engine: list[int] | None) -> None:
        """Form every sender's group (collective over the trainer's group; rank 0 makes the engines join)."""
        self.close()
        listener = listening_socket(self.host) if rank in senders else None
        address = None if listener is None else (self.host, int(listener.getsockname()[1]))
        addresses: list = [None] * dist.get_world_size(trainer_group)
        dist.all_gather_object(addresses, address, group=trainer_group)
        world_size = 1 + sum(workers_per_engine or [])
        sizes = [world_size]
        dist.broadcast_object_list(sizes, src=0, group=trainer_group)
        world_size = sizes[0]
        futures, names = [], []
        if targets is not None:
            groups = [{"sender": s, "host": addresses[s][0], "port": addresses[s][1]} for s in senders]
            offset, messages = 1, []
            for workers in workers_per_engine:
                messages.append(json.dumps({"groups": groups, "world_size": world_size, "rank_offset": offset,
                                            "backend": self.backend, "timeout_s": self.timeout_s}))
                offset += workers
            futures = call_in_threads([partial(t.call_each or t.call, JOIN_METHOD) for t in targets], messages,
                                      "owner-senders-join")
            names = [t.name for t in targets]
        error = None
        try:
            if listener is not None:
                (opened,) = call_in_threads([lambda _: open_group(self.host, address[1], 0, world_size, self.backend,
                                                                  self.timeout_s, listener)], [None], "owner-senders-open")
                wait_for_engines([opened, *futures], [f"trainer rank {rank}", *names], self.timeout_s,
                                 what=f"forming the weight groups of {len(senders)} senders")
                self.group = opened.result()
            elif futures:
                wait_for_engines(futures, names, self.timeout_s, what=f"forming the weight groups of {len(senders)} senders")
        except BaseException as raised:  # noqa: BLE001 - agreed with the other ranks first
            error = raised
        if any_rank(error is not None, trainer_group):
            self.close()
            raise error if error is not None else BroadcastError("forming the weight groups failed on another trainer rank")
        self.senders = list(senders)

    def send(self, bucket: list, abort_if=None) -> None:
        """Broadcast one bucket from this rank into every worker (the workers were told its layout by RPC);
        abort_if: polled meanwhile, an exception it returns is raised (weight_sync.broadcast.broadcast_from_root)."""
        layout = describe_bucket(bucket)
        if self._buffer is None or self._buffer.numel() < layout["nbytes"]:
            self._buffer = None
            self._buffer = torch.empty(int(layout["nbytes"]), dtype=torch.uint8, device=self.device)
        flat = pack_bucket(bucket, layout, self.device, out=self._buffer)
        broadcast_from_root(self.group, flat, abort_if=abort_if, timeout_s=self.timeout_s)
        self.sent_bytes += int(layout["nbytes"])

    def close(self) -> None:
        group, self.group, self.senders = self.group, None, []
        if group is not None:
            close_group(group, self.timeout_s)

    def shutdown(self) -> None:
        self.close()
        self._buffer = None


def owner_parallel_push(targets: list | None, export, version: int, *, senders: OwnerSenders, rank: int,
                        trainer_group: Any, manifest: WeightManifest | None = None,
                        workers_per_engine: list[int] | None = None, repack_moe: bool = True,
                        delta: DeltaEncoder | None = None, max_parts: int = MAX_PARTS) -> dict | None:
    """One push (see the module docstring) on every trainer rank; targets, manifest and workers_per_engine on
    rank 0 only (weight_sync.push.PushTarget). Returns {'delta': whether it went as a sparse delta, 'wire_bytes': the
    bytes this rank broadcast} and on rank 0 also {'commits', 'tensors', 'bytes'}.
    delta: this rank's DeltaEncoder (rollout.weight_delta; weight_sync.delta), kept across pushes.
    max_parts: senders' buckets a worker takes at once (a wider round goes in slices).
    Raises WeightPushError (refused, nothing moved; on rank 0) or PushBrokenError (on every rank)."""
    if refuse_or_none(targets, export, manifest, trainer_group):
        return None
    stale = senders.senders != export.senders or (senders.group is None and rank in export.senders)
    if targets is not None and not stale:  # an engine restarted since: its workers are in no group
        stale = any(joined != export.senders for target in targets for joined in _each(target, "mrl_owner_senders"))
    if any_rank(stale, trainer_group):
        senders.connect(export.senders, rank, trainer_group, targets, workers_per_engine)
    announced = AnnouncedPush(export.entries) if targets is not None else None
    use_delta = _delta_decision(targets, delta, version, trainer_group)
    sent_before = senders.sent_bytes
    failure = begin_push(targets, version)
    buckets = iter(export)
    for parts in export.rounds:
        bucket, meta = None, None
        if failure is None:
            try:
                bucket = next(buckets)
                if delta is not None and any(owner == rank for owner, _ in parts):
                    bucket, meta = delta.encode(bucket, use_delta)
            except BaseException as error:  # noqa: BLE001 - agreed below
                failure = error
        if any_rank(failure is not None, trainer_group):
            break
        try:
            wire = _wire_parts(bucket, meta, trainer_group) if delta is not None else None
        except BaseException as error:  # noqa: BLE001 - agreed at the first slice
            failure = error
        for start in range(0, len(parts), max_parts):  # slices bound a worker's buffers, whatever the senders
            if start and any_rank(failure is not None, trainer_group):
                break
            if failure is None:
                try:
                    _round(targets, parts[start : start + max_parts], bucket, rank, senders, announced, wire,
                           delta.base if use_delta else None)
                except BaseException as error:  # noqa: BLE001 - agreed at the next slice or round
                    failure = error
                    senders.close()
    result = None
    broken = any_rank(failure is not None, trainer_group)  # every rank takes part: no short circuit
    if targets is not None and not broken:
        result, failure = commit_push(targets, announced, repack_moe)
    if not any_rank(failure is not None, trainer_group):
        if delta is not None:
            delta.commit(version, use_delta)
        return {**(result or {}), "delta": use_delta, "wire_bytes": senders.sent_bytes - sent_before}
    senders.close()  # every rank: the groups are formed again at the next push
    if delta is not None:
        delta.reset()
    if failure is not None and isinstance(failure, (KeyboardInterrupt, SystemExit)):
        raise failure
    versions = restore_complete_versions(targets) if targets is not None else []
    raise broken_push("owner-parallel weight push", version, rank, failure, versions) from failure


def _delta_decision(targets: list | None, delta: DeltaEncoder | None, version: int, trainer_group: Any) -> bool:
    """Whether this push goes as a delta: rank 0 decides (the encoder wants one and every engine worker holds its
    base; otherwise a full push, logged) and tells every rank."""
    if delta is None:
        return False
    decision = [False]
    if targets is not None and delta.wants_delta():
        bases = [base for target in targets for base in _each(target, "mrl_delta_base")]
        if all(base == delta.base for base in bases):
            decision = [True]
        else:
            logger.warning("weight delta v%d against v%d refused: the engine workers hold %s (an engine restarted or a "
                           "push broke since); pushing in full", version, delta.base, bases)
    dist.broadcast_object_list(decision, src=dist.get_global_rank(trainer_group, 0), group=trainer_group)
    return bool(decision[0])


def _each(target, method: str, *args) -> list:
    return target.call_each(method, *args) if target.call_each is not None else [target.call(method, *args)]


def _wire_parts(bucket: list | None, meta: dict | None, trainer_group: Any) -> list | None:
    """Every rank's (layout, meta) of its encoded bucket this round (a delta's layout depends on the data), on the
    group's first rank, which tells the engines (None elsewhere: no rank but it holds the world's layouts)."""
    mine = None if meta is None else (describe_bucket(bucket), meta)
    first = dist.get_global_rank(trainer_group, 0)
    gathered = [None] * dist.get_world_size(trainer_group) if dist.get_rank() == first else None
    dist.gather_object(mine, gathered, dst=first, group=trainer_group)
    return gathered


def _round(targets: list | None, parts: list, bucket: list | None, rank: int, senders: OwnerSenders,
           announced: AnnouncedPush | None, wire: list | None = None, base: int | None = None) -> None:
    """One round: rank 0 tells every engine the round's layouts while every sender broadcasts its bucket
    (with a DeltaEncoder, `wire` holds each sender's encoded layout and meta, `base` the delta's base version)."""
    futures, names = [], []
    if targets is not None:
        if wire is None:
            message = {"parts": [{"sender": s, "layout": _meta_layout(entries)} for s, entries in parts]}
        else:
            message = {"parts": [{"sender": s, "layout": wire[s][0], "meta": wire[s][1], "base": base} for s, _ in parts]}
        message = json.dumps(message)
        check_round(announced, parts)
        futures = call_in_threads([partial(t.call_each or t.call, RECEIVE_METHOD) for t in targets],
                                  [message] * len(targets), "owner-receive")
        names = [t.name for t in targets]
    if any(owner == rank for owner, _ in parts):
        senders.send(bucket, abort_if=lambda: next((f.exception() for f in futures if f.done() and f.exception()), None))
    if futures:
        wait_for_engines(futures, names, senders.timeout_s, what=f"a round of {len(parts)} senders' buckets")


