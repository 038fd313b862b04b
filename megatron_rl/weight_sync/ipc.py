"""Weight pushes by memory handles: the trainer's device -> engine workers on the same device, no copy between them.

An engine worker on a trainer rank's own device (its GPU, or the host on CPU)
needs no process group with the trainer: both can map the same memory. Per
bucket:
1. the export's tensors are written straight into a shared buffer on the
   trainer's device (the layout of weight_sync.broadcast: one uint8 buffer,
   64-byte aligned offsets), the one copy on this side; the trainer's own
   tensors (its parameters: in host shared memory, or on its GPU) need none
   and go by reference (weight_sync.ipc_reference);
2. the buffer's `reduce_tensor` handle (a CUDA IPC handle; on the host shared
   memory named by a file, torch's file_system strategy, which any process of
   the host can map) is pickled, base64;
3. the handles and the layout go over the engine's RPC channel (or a server's
   HTTP API) to `mrl_ipc_receive` (rollout.worker_ext), one call per bucket
   or, with `IpcSender.batch_buckets` (and weight_sync.owner_ipc's rounds),
   one for several; each worker maps the handle of its own device
   (`weight_sync.ipc_receive.IpcReceiver.open`) and stages views of it like any other bucket (the
   manifest check, the streaming load, abort and recovery), copying them into
   its parameters: the one copy on that side. The call runs on threads while
   the export writes the next bucket (`IpcSender`);
4. each answer lists the buckets whose memory the worker no longer holds
   (nothing but the receiver references their storage, views of views
   included); once every worker has let go of a bucket its buffer is written
   again by a later bucket, and the worker, which kept its mapping, maps
   nothing anew (a fresh shared allocation, or mapping one anew, faults its
   pages in, which took longer than the copy on the host). A CUDA buffer
   stays allocated while another process maps it (torch's IPC reference
   counts); the workers let go of CUDA mappings when the push ends.

Colocated servers (rollout.engines > 1, config.placement) have workers on
every GPU of the trainer, so every rank shares each bucket with the worker
on its own GPU (`IpcRelay`): the pushing rank broadcasts the packed bucket
to the ranks whose GPUs hold workers (the trainer's own group), each rank
exports a handle of its copy, and the handles are gathered to the pushing
rank, which sends every engine the handles of its workers' GPUs (worker j of
the engine hosted by rank h maps rank h + j's).

`BufferPool.peak_shared_bytes` measures what each rank allocated (bytes it
shares with its workers, counted once): three buffers with one bucket per
call (IpcSender), plus those holding parts of a layer vLLM's layerwise reload
is completing.

A handle is a pickle of torch's rebuild function and its arguments; the worker
(weight_sync.ipc_receive) unpickles it with an allowlist (torch's rebuild functions, tensor and storage
types, dtypes) so a handle cannot name anything else. On a GPU the handles go
out once the copy's CUDA event has passed: the worker reads on its own streams.
"""

from __future__ import annotations

import base64
import json
import logging
import uuid
from collections import Counter
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from megatron_rl.weight_sync.broadcast import (
    call_in_threads, describe_bucket, gpu_uuid, pack_bucket, wait_for_engines,
)
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.ipc_receive import IpcError
from megatron_rl.weight_sync.ipc_reference import (
    describe_references, forget_references, host_memory_by_name, split_bucket, storage_view,
)
from megatron_rl.weight_sync.stream import WeightStream, as_weight_stream

logger = logging.getLogger(__name__)


def default_device() -> torch.device:
    """Where the pushing rank shares buckets from: its current CUDA device, else host memory."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def shared_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of `nbytes` (at least 1) that another process can map: CUDA memory, or host shared memory
    named by a file (torch_shm_manager unlinks it once no process maps it)."""
    if device.type == "cuda":
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    storage = torch.UntypedStorage._new_using_filename_cpu(max(nbytes, 1))  # allocated shared: no copy to share it
    return torch.empty(0, dtype=torch.uint8).set_(storage)




def export_handle(tensor: torch.Tensor) -> str:
    """The `reduce_tensor` handle of `tensor` (CUDA IPC handle, or shared-memory file name), pickled, as base64
    text (it travels in JSON to servers)."""
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing.reductions import reduce_tensor

    with host_memory_by_name():
        pickled = bytes(ForkingPickler.dumps(reduce_tensor(tensor)))  # ForkingPickler applies torch's storage reducers
    return base64.b64encode(pickled).decode("ascii")


class BufferPool:
    """The shared buffers one rank holds for a push: one per bucket the workers still map, the released ones
    written again by later buckets."""

    def __init__(self, device: torch.device):
        self.device = device
        self._alive: dict[int, torch.Tensor] = {}  # bucket id -> its buffer
        self._free: list[torch.Tensor] = []
        self.shared_bytes = 0
        self.peak_shared_bytes = 0
        """Most bytes of shared buffers allocated at once on this rank (what it and its workers share)."""
        self.allocations = 0
        """Shared buffers allocated (each one a worker maps once: later buckets written into it find its mapping)."""

    @property
    def alive_buckets(self) -> int:
        return len(self._alive)

    def holds(self, bucket_id: int) -> bool:
        """Whether bucket `bucket_id`'s buffer is kept for the workers (not released)."""
        return bucket_id in self._alive

    def take(self, bucket_id: int, nbytes: int) -> torch.Tensor:
        """The buffer bucket `bucket_id` is packed into: a released one of at least `nbytes` (the smallest that
        fits), else a new one (the released ones, all too small, are let go: what is allocated stays what the
        workers hold plus what they let go of)."""
        fitting = [b for b in self._free if b.numel() >= nbytes]
        if fitting:
            buffer = min(fitting, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not buffer]
        else:
            self.shared_bytes -= sum(b.numel() for b in self._free)
            self._free = []
            buffer = shared_buffer(nbytes, self.device)
            self.allocations += 1
            self.shared_bytes += buffer.numel()
            self.peak_shared_bytes = max(self.peak_shared_bytes, self.shared_bytes)
        self._alive[bucket_id] = buffer
        return buffer[:nbytes]

    def release(self, bucket_id: int) -> None:
        buffer = self._alive.pop(bucket_id, None)
        if buffer is not None:
            self._free.append(buffer)

    def close(self) -> None:
        """Drop every buffer (the push ended: its workers finished or reloaded; torch keeps a CUDA block another
        process still maps until that process lets go of it)."""
        self._alive.clear()
        self._free.clear()
        self.shared_bytes = 0

    def release_all(self) -> None:
        """Every buffer is free to be written again (the push that used them ended; the next one keeps them: on the
        host a fresh shared allocation costs page faults that took longer than the copy, measured in
        bench/ipc_gpu.py)."""
        self._free += self._alive.values()
        self._alive.clear()


def share(pool: BufferPool, bucket_id: int, layout: dict, copies: int, bucket: Bucket | None = None,
          fill: Callable[[torch.Tensor], None] | None = None, sync: bool = True) -> tuple[list[str], Any]:
    """Write `bucket` (or let `fill` write the bytes) straight into the pool's shared buffer for `bucket_id`: the
    one copy of its bytes on this side. Returns `copies` handles of it, one per worker that maps it (each handle
    holds one reference to the memory, which its worker's mapping takes over: one handle opened twice would let
    the memory go while a worker still maps it), and on a GPU the event the copy completes at (the worker reads
    on its own streams: the handles go out once it has passed, `sync` synchronizes here; None on the host)."""
    flat = pool.take(bucket_id, int(layout["nbytes"]))
    if bucket is not None:
        pack_bucket(bucket, layout, pool.device, out=flat)
    if fill is not None:
        fill(flat)
    ready = None
    if flat.is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(flat.device))
        if sync:
            ready.synchronize()
    return [export_handle(flat) for _ in range(copies)], ready


@dataclass
class SharedBucket:
    """One bucket as the workers get it: the handle each worker maps, and how the bucket is laid out."""

    bucket_id: int
    layout: dict
    handles: list[list[str]]
    """handles[i][j]: what worker j of engine i maps (the copy on its trainer rank's device)."""
    gpus: list[list[str]]
    """The UUID of the GPU behind each handle ('' on the host)."""
    ready: Any = None
    """A CUDA event the bucket's bytes are written at (synchronized before its handles go out); None: written."""
    sources: list[list[list[str]]] | None = None
    """sources[i][j]: the handles worker j of engine i maps of the storages the layout's 'referenced' tensors name
    (weight_sync.ipc_reference); None: the bucket is all in its buffer."""

    @property
    def buffered(self) -> bool:
        """Whether part of the bucket is in a buffer of the pool (which its workers let go of)."""
        return bool(self.layout["tensors"])


class IpcRelay:
    """Every rank whose device holds engine workers: each bucket of the export shared on every such rank (see the
    module docstring).

    Collective over `ranks` (the pushing rank `ranks[0]` first): every one of them wraps the same export with
    `wrap` and iterates it to the end (push_weights does), then calls `close`. `engine_ranks[i][j]`: the trainer
    rank whose copy worker j of engine i maps. `group` moves the buckets (the trainer's backend: NCCL on GPU),
    `object_group` the small per-bucket header and handles (gloo). With one rank (an engine process on the
    pushing rank's device) nothing is collective: IpcSender shares each bucket as it sends it.
    """

    def __init__(self, *, rank: int, ranks: list[int], engine_ranks: list[list[int]], group: Any = None,
                 object_group: Any = None, device: torch.device | None = None):
        self.rank, self.ranks = int(rank), [int(r) for r in ranks]
        self.root = self.ranks[0]
        self.engine_ranks = [[int(r) for r in ranks] for ranks in engine_ranks]
        self.copies = sum(r == self.rank for ranks in self.engine_ranks for r in ranks)
        """Workers that map this rank's copy of each bucket (one handle each)."""
        self.group, self.object_group = group, object_group
        self.pool = BufferPool(device if device is not None else default_device())
        self.current: SharedBucket | None = None
        """The bucket just shared (the pushing rank; IpcSender sends it)."""
        self.token = uuid.uuid4().hex
        """Names this push's buckets to the workers (pushing rank)."""
        self._sharing = False
        self._next_id = 0
        self._released: list[int] = []  # let go of by every worker, to be freed on the other ranks too
        self._drop_all = False

    def wrap(self, buckets: Iterable[Bucket]) -> WeightStream:
        """The same stream, each bucket shared on every rank of the relay as it passes (collective)."""
        stream = as_weight_stream(buckets) if self.rank == self.root else None
        entries = stream.entries if stream is not None else []  # the announcement matters on the pushing rank only
        self.pool.close()  # an earlier push's buffers (its end was agreed before this push began)
        self.token, self._sharing, self._next_id, self._released, self._drop_all = uuid.uuid4().hex, False, 0, [], False
        return WeightStream(entries, self._shared(stream if stream is not None else buckets))

    def _shared(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        import torch.distributed as dist

        group = self.group if self.pool.device.type == "cuda" else self.object_group  # NCCL moves GPU bytes
        for bucket in buckets:
            header = None
            if self.rank == self.root:  # what every rank does with this bucket
                header = {"layout": describe_bucket(bucket) if bucket and self._sharing else None,
                          "released": self._released, "drop_all": self._drop_all}
                self._released = []
            holder = [header]
            dist.broadcast_object_list(holder, src=self.root, group=self.object_group)
            header = holder[0]
            self._follow(header)
            if header["layout"] is not None:
                handles, _ = share(self.pool, self._next_id, header["layout"], self.copies,
                                   bucket if self.rank == self.root else None,
                                   fill=lambda flat: dist.broadcast(flat, src=self.root, group=group))
                gathered: list[Any] = [None] * len(self.ranks)
                dist.gather_object((handles, gpu_uuid(self.pool.device)), gathered if self.rank == self.root else None,
                                   dst=self.root, group=self.object_group)
                if self.rank == self.root:
                    self.current = self._assign(self._next_id, header["layout"], dict(zip(self.ranks, gathered)))
                self._next_id += 1
            yield bucket
        self.current = None

    def share_here(self, bucket: Bucket) -> SharedBucket:
        """(one rank, nothing collective) Share `bucket` from this rank's device with every worker: the trainer's
        own tensors by reference (weight_sync.ipc_reference), the rest written into a buffer."""
        device = self.pool.device
        referenced, packed = split_bucket(bucket, device)
        references, sources = None, None
        if referenced:
            references, storages = describe_references(referenced)
            try:
                sources = [[[export_handle(storage_view(s)) for s in storages] for _ in ranks]
                           for ranks in self.engine_ranks]
            except RuntimeError as error:  # torch gives this CUDA block no IPC handle: the buffer, from now on
                logger.warning("weights by memory handle: %s; they go through shared buffers instead of by "
                               "reference from now on", error)
                forget_references()
                referenced, packed, references = [], list(bucket), None
        layout, bucket_id = describe_bucket(packed), self._next_id
        handles, ready = share(self.pool, bucket_id, layout, self.copies, packed, sync=False) if packed else (
            [""] * self.copies, None)
        if references is not None and ready is None and device.type == "cuda":
            ready = torch.cuda.Event()  # the parameters' last writes (the optimizer step) precede the worker's reads
            ready.record(torch.cuda.current_stream(device))
        self._next_id += 1
        shared = self._assign(bucket_id, layout, {self.rank: (handles, gpu_uuid(device))})
        shared.ready = ready
        if references is not None:
            layout["referenced"], shared.sources = references, sources
        return shared

    def _assign(self, bucket_id: int, layout: dict, by_rank: dict[int, tuple[list[str], str]]) -> SharedBucket:
        """Bucket `bucket_id` as its workers get it: each its own handle of the copy on its rank's device."""
        unused = {rank: list(handles) for rank, (handles, _) in by_rank.items()}
        handles = [[unused[rank].pop(0) for rank in ranks] for ranks in self.engine_ranks]
        gpus = [[by_rank[rank][1] for rank in ranks] for ranks in self.engine_ranks]
        return SharedBucket(bucket_id, layout, handles, gpus)

    def _follow(self, header: dict) -> None:
        if header["drop_all"]:
            self.pool.close()
        for bucket_id in header["released"]:
            self.pool.release(int(bucket_id))

    def start(self) -> None:
        """(pushing rank) The engines take buckets from now on (IpcSender is made once the push is checked: a
        push refused before drains the export unshared)."""
        self._sharing = True

    def message(self, shared: SharedBucket, engine: int) -> dict:
        """What engine `engine`'s workers get for a bucket: each worker's handle, in worker order."""
        message = {"sender": self.token, "bucket_id": shared.bucket_id, "layout": shared.layout,
                   "handles": shared.handles[engine], "trainer_gpus": shared.gpus[engine]}
        if shared.sources is not None:
            message["sources"] = shared.sources[engine]
        return message

    def release(self, bucket_id: int) -> None:
        """(pushing rank) Every worker let go of `bucket_id`: its buffers are written again (here now, on the
        other ranks from the next bucket on)."""
        self.pool.release(bucket_id)
        self._released.append(bucket_id)

    def stop(self) -> None:
        """(pushing rank) The push ended or broke: the rest of the export is not shared, every buffer is let go."""
        self._sharing, self._drop_all, self._released = False, True, []
        self.pool.close()

    def close(self) -> None:
        """(every rank, after the push) Drop every buffer."""
        self._sharing = False
        self.current = None
        self.pool.close()


class IpcSender:
    """Pushing-rank end: sends each bucket's handles to every engine and frees its buffers once all their workers
    have let go of it.

    Drives the push protocol like weight_sync.broadcast.BroadcastSender does (weight_sync.push.stream_push
    calls `send(bucket, receives, names)`, each receive answering with every worker's answer); one sender per
    push. Without a relay the bucket is written from this rank's device alone (one engine process); with one,
    the relay has already shared it on every rank while the export passed it (colocated servers).

    Overlap: the call that hands bucket k to the engines runs on threads of its own while the export makes
    bucket k+1 and writes it into its shared buffer (on a GPU the copy runs on the export's stream while the
    worker loads on its own; the handles of k+1 go out once its event has passed). The engines take calls in
    order: the call for k+1 starts once k's answered. A worker answers once its loading is past the first
    tensor of k (weight_sync.streaming_load), so the answer frees bucket k-1: with one bucket per call the
    buffers alive on this rank are k-1 (its release not yet known), k (being loaded) and k+1 (being written).
    """

    receive_method = "mrl_ipc_receive"

    def __init__(self, device: torch.device | None = None, timeout_s: float = 600.0, relay: IpcRelay | None = None,
                 *, workers: int = 1, batch_buckets: int = 1, pool: BufferPool | None = None):
        """workers: without a relay, how many workers the one engine process has (each maps its own handle).
        batch_buckets: buckets whose handles go to the engines in one message (one call per engine for them, not
        one per bucket; the pushing side then shares up to this many buckets more at once).
        pool: without a relay, the buffers of an earlier push to write again (its push ended: all are free), kept
        by the engine across pushes; None: new ones."""
        if batch_buckets < 1:
            raise ValueError(f"batch_buckets={batch_buckets} must be >= 1")
        self.local = relay is None
        self.relay = relay if relay is not None else IpcRelay(rank=0, ranks=[0], engine_ranks=[[0] * workers],
                                                              device=pool.device if pool is not None else device)
        if relay is None and pool is not None:
            pool.release_all()
            self.relay.pool = pool
        self.relay.start()
        self.timeout_s = float(timeout_s)
        self.batch_buckets = int(batch_buckets)
        self.messages = 0
        """Calls made to each engine so far (one per batch of buckets)."""
        self._holders: Counter[int] = Counter()  # bucket id -> engines still holding it
        self._pending: list[SharedBucket] = []  # shared, not yet sent
        self._inflight: tuple[list, list[str], str] | None = None  # the call made and not yet answered

    @property
    def pool(self) -> BufferPool:
        return self.relay.pool

    @property
    def buffer_bytes(self) -> int:
        """What the push protocol reports (PushResult.buffer_bytes): the most bytes this rank shared at once."""
        return self.pool.peak_shared_bytes

    def send(self, bucket: Bucket, receives: list[Callable[[str], Any]], names: list[str] | None = None) -> list[Any]:
        """Hand one bucket to every engine (with batch_buckets > 1, once that many are shared; `flush` sends the
        rest); returns each engine's answers (one per worker) to the earlier call this one waited for, [] when
        none was."""
        if len(receives) != len(self.relay.engine_ranks):
            raise IpcError(f"{len(receives)} engines, but the relay knows the devices of {len(self.relay.engine_ranks)}")
        self._pending.append(self._shared(bucket))
        return self._start(receives, names) if len(self._pending) >= self.batch_buckets else []

    def flush(self, receives: list[Callable[[str], Any]], names: list[str] | None = None) -> list[Any]:
        """Send the buckets shared and not yet sent, in one message per engine, and wait for every call's answer
        (weight_sync.push.stream_push calls it at the end); returns the last call's answers."""
        answers = self._start(receives, names)
        return self._finish() or answers

    def _start(self, receives: list[Callable[[str], Any]], names: list[str] | None) -> list[Any]:
        """Wait for the call in flight (its answers are returned), then call the engines with the pending buckets."""
        answers = self._finish()
        pending, self._pending = self._pending, []
        if not pending:
            return answers
        names = [f"engine {i}" for i in range(len(receives))] if names is None else list(names)
        for shared in pending:
            if shared.ready is not None:
                shared.ready.synchronize()  # its bytes are written before a worker reads them
            if shared.buffered:
                self._holders[shared.bucket_id] = len(receives)
        messages = [json.dumps(self._message(pending, i)) for i in range(len(receives))]
        nbytes = sum(int(shared.layout["nbytes"]) for shared in pending)
        futures = call_in_threads(receives, messages, "weight-ipc-receive")
        self._inflight = (futures, names, f"{len(pending)} weight bucket(s) of {nbytes} bytes by memory handle to "
                                          f"{len(receives)} engine(s)")
        self.messages += 1
        return answers

    def _finish(self) -> list[Any]:
        """Wait for the call in flight; its answers free the buckets every worker let go of."""
        if self._inflight is None:
            return []
        futures, names, what = self._inflight
        wait_for_engines(futures, names, self.timeout_s, what=what)
        self._inflight = None  # only now: when one engine failed, abandon() waits for the others' calls
        answers = [f.result() for f in futures]
        for workers in answers:
            for released in _released_by_all(workers):
                self._release(released)
        return answers

    def _message(self, pending: list[SharedBucket], engine: int) -> dict:
        if len(pending) == 1:
            return self.relay.message(pending[0], engine)
        parts = [self.relay.message(shared, engine) for shared in pending]
        return {"sender": self.relay.token, "buckets": [{k: v for k, v in part.items() if k != "sender"} for part in parts]}

    def _shared(self, bucket: Bucket) -> SharedBucket:
        if self.local:
            return self.relay.share_here(bucket)
        if self.relay.current is None:
            raise IpcError("a bucket reached the sender that the relay did not share: wrap the export with "
                           "IpcRelay.wrap on every rank of the relay")
        return self.relay.current

    def _release(self, bucket_id: int) -> None:
        self._holders[bucket_id] -= 1
        if self._holders[bucket_id] <= 0:
            del self._holders[bucket_id]
            self.relay.release(bucket_id)

    def abandon(self) -> None:
        """The push broke: the call in flight is waited for (the engines then take the abort alone), nothing more is
        shared, every buffer on this rank goes (the relay's other ranks let theirs go at its next bucket, or when
        the push ends)."""
        if self._inflight is not None:
            wait(self._inflight[0], timeout=self.timeout_s)
            self._inflight = None
        self.relay.stop()
        self._holders.clear()
        self._pending = []


def _released_by_all(workers: Any) -> list[int]:
    """Bucket ids every worker of one engine says it let go of (an answer, or a list of its workers' answers)."""
    answers = workers if isinstance(workers, list) else [workers]
    sets = [set(int(i) for i in a.get("released", [])) for a in answers if isinstance(a, dict)]
    return sorted(set.intersection(*sets)) if sets else []

