"""Weight pushes by memory handles: the pushing rank -> an engine on the same device, no copy between them.

An engine in its own process on the trainer's own device (its GPU, or the
host on CPU) needs no process group: both can map the same memory. Per bucket:
1. the trainer packs the bucket into one fresh buffer on its device (the
   layout of weight_sync.broadcast: one uint8 buffer, 64-byte aligned offsets);
2. it exports the buffer with torch.multiprocessing's `reduce_tensor` (a CUDA
   tensor becomes a CUDA IPC handle, a host tensor a shared-memory file
   descriptor: the same call) and pickles that small handle;
3. the handle and the layout go over the engine's RPC channel to
   `mrl_ipc_receive` (rollout.worker_ext), which maps the buffer
   (`IpcReceiver.open`), unpacks views of it and stages them like any other
   bucket: the same manifest check and streaming load (rollout.streaming_load),
   the same abort and recovery;
4. each answer lists the buckets whose memory the worker no longer holds
   (its loading is past them: their storage is freed, views of views
   included); the trainer then reuses those buffers for the next
   buckets (a fresh shared allocation costs page faults that took longer than
   the copy on the host). The exporting side must keep a CUDA buffer
   allocated while another process maps it, so a buffer is written again only
   after the worker has said it is done with it.

Buckets alive at once are bounded by the worker's loading, as for any push:
the bucket being loaded, the one queued, and those holding parts of the layer
vLLM's layerwise reload is completing. `IpcSender.peak_shared_bytes` measures
what the trainer allocated for them (the bytes both processes share, counted
once; reused buffers included); buffers go when the push ends.

A handle is a pickle of torch's rebuild function and its arguments; the worker
unpickles it with an allowlist (torch's rebuild functions, tensor and storage
types, dtypes, multiprocessing's fd carrier) so a handle cannot name anything
else. On the host the descriptor is handed over by multiprocessing's resource
sharer, which needs the engine process to be a multiprocessing child of the
trainer's (same authkey): true of vLLM's engine process, not of a server.

Before sending, the trainer synchronizes its CUDA stream: the worker reads
the buffer on streams of its own.
"""

from __future__ import annotations

import io
import pickle
import uuid
from typing import Any, Callable

import torch

from megatron_rl.weight_sync.broadcast import call_in_threads, describe_bucket, pack_bucket, unpack_bucket, wait_for_engines
from megatron_rl.weight_sync.buckets import Bucket


class IpcError(RuntimeError):
    """A bucket's memory handle could not be used by the engine worker."""


def default_device() -> torch.device:
    """Where the pushing rank shares buckets from: its current CUDA device, else host memory."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind `device` ('' for the host): the same in every process, unlike the device index."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def shared_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer of `nbytes` (at least 1) that another process can map: CUDA memory, or host shared memory."""
    if device.type == "cuda":
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))  # allocated shared: no copy by share_memory_()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def export_handle(tensor: torch.Tensor) -> bytes:
    """The pickled `reduce_tensor` handle of `tensor` (CUDA IPC handle, or shared-memory descriptor)."""
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing.reductions import reduce_tensor

    return bytes(ForkingPickler.dumps(reduce_tensor(tensor)))  # ForkingPickler applies torch's storage reducers


_HANDLE_TYPES = {
    ("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "TypedStorage"), ("torch.storage", "UntypedStorage"),
    ("torch", "TypedStorage"), ("torch", "UntypedStorage"), ("multiprocessing.resource_sharer", "DupFd"),
}


class _HandleUnpickler(pickle.Unpickler):
    """Unpickles a `reduce_tensor` handle and nothing else (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"):
            return super().find_class(module, name)
        if (module, name) in _HANDLE_TYPES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise IpcError(f"a weight handle names {module}.{name}, which is not part of a tensor handle: refused")


def import_handle(handle: bytes, trainer_gpu: str = "") -> torch.Tensor:
    """Map the tensor a handle from `export_handle` describes.

    A CUDA handle is opened on this process's current device, which must be the trainer's GPU
    (`trainer_gpu`, its UUID): device indices differ between processes, the physical GPU does not.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    rebuild, args = _HandleUnpickler(io.BytesIO(handle)).load()
    if rebuild is rebuild_cuda_tensor:
        if not torch.cuda.is_available():
            raise IpcError("a CUDA weight handle reached an engine worker without CUDA: use rollout.weight_transport=broadcast")
        device = torch.device("cuda", torch.cuda.current_device())
        if trainer_gpu and gpu_uuid(device) != trainer_gpu:
            raise IpcError(
                f"the engine worker on {device} ({gpu_uuid(device)}) is not on the trainer's GPU ({trainer_gpu}): "
                "CUDA IPC handles open only on the GPU that made them; set rollout.weight_transport=broadcast"
            )
        args = list(args)
        args[6] = device.index  # the storage's device, as this process numbers it
    return rebuild(*args)


class IpcReceiver:
    """Engine-worker end: opens each bucket's buffer and tells which buckets it has let go of.

    A bucket is let go of when its memory is: the loading may keep views of views of it (vLLM's layerwise
    reload keeps a fused layer's parts), so what is watched is the storage itself, not a tensor object.
    """

    def __init__(self) -> None:
        # (sender, bucket id) -> (its mapped storage, weakly; its CUDA device): ids count from 0 in every push
        self._open: dict[tuple[str, int], tuple[Any, torch.device | None]] = {}

    def open(self, message: dict) -> Bucket:
        """Views of the shared bucket a message from IpcSender describes."""
        from torch.multiprocessing.reductions import StorageWeakRef

        flat = import_handle(message["handle"], str(message.get("trainer_gpu", "")))
        device = flat.device if flat.is_cuda else None
        self._open[(str(message["sender"]), int(message["bucket_id"]))] = (StorageWeakRef(flat.untyped_storage()), device)
        return unpack_bucket(message["layout"], flat)

    def take_released(self, sender: str) -> list[int]:
        """Ids of `sender`'s buckets whose memory nothing here holds any more (forgetting earlier pushes' ones)."""
        released = [key for key, (storage, _) in self._open.items() if storage.expired()]
        devices = {self._open.pop(key)[1] for key in released}
        for device in devices - {None}:  # copies out of a released bucket may still be queued on a stream
            torch.cuda.synchronize(device)
        return [bucket_id for owner, bucket_id in released if owner == sender]


class IpcSender:
    """Pushing-rank end: shares each bucket and keeps it until every engine has released it.

    Drives the push protocol like weight_sync.broadcast.BroadcastSender does (rollout.push calls
    `send(bucket, receives, names)` with each engine's `receive_method` call); one sender per push.
    """

    receive_method = "mrl_ipc_receive"

    def __init__(self, device: torch.device | None = None, timeout_s: float = 600.0):
        self.device = device if device is not None else default_device()
        self.timeout_s = float(timeout_s)
        self.trainer_gpu = gpu_uuid(self.device)
        self.token = uuid.uuid4().hex  # names this push's buckets to the workers
        self._alive: dict[int, tuple[torch.Tensor, int]] = {}  # bucket id -> (its buffer, engines still holding it)
        self._free: list[torch.Tensor] = []  # released buffers, written again by later buckets
        self._next_id = 0
        self.shared_bytes = 0
        self.peak_shared_bytes = 0
        """Most bytes of shared buffers allocated at once (what the trainer and the engine share)."""

    @property
    def buffer_bytes(self) -> int:
        return self.peak_shared_bytes

    def send(self, bucket: Bucket, receives: list[Callable[[dict], Any]], names: list[str] | None = None) -> list[Any]:
        """Share one bucket with every engine; returns each engine's answer to its receive call."""
        names = [f"engine {i}" for i in range(len(receives))] if names is None else list(names)
        layout = describe_bucket(bucket)
        buffer = self._buffer(int(layout["nbytes"]))
        flat = pack_bucket(bucket, layout, self.device, out=buffer)
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()  # the worker reads on its own streams
        bucket_id, self._next_id = self._next_id, self._next_id + 1
        message = {"sender": self.token, "bucket_id": bucket_id, "layout": layout, "handle": export_handle(flat),
                   "trainer_gpu": self.trainer_gpu}
        self._alive[bucket_id] = (buffer, len(receives))
        del flat, buffer
        futures = call_in_threads(receives, [message] * len(receives), "weight-ipc-receive")
        wait_for_engines(futures, names, self.timeout_s,
                         what=f"a weight bucket of {layout['nbytes']} bytes by memory handle to {len(receives)} engine(s)")
        answers = [f.result() for f in futures]
        for answer in answers:
            for released in answer.get("released", []) if isinstance(answer, dict) else []:
                self._release(int(released))
        return answers

    @property
    def alive_buckets(self) -> int:
        return len(self._alive)

    def close(self) -> None:
        """Drop every buffer (the push ended: its workers finished or reloaded; torch keeps a CUDA block a
        consumer still maps until that consumer lets go of it)."""
        self._alive.clear()
        self._free.clear()
        self.shared_bytes = 0

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A released buffer of at least `nbytes` (the smallest that fits), else a new one (the released ones,
        all too small, are let go: what is allocated stays what the worker holds plus what it let go of)."""
        fitting = [b for b in self._free if b.numel() >= nbytes]
        if fitting:
            buffer = min(fitting, key=lambda b: b.numel())
            self._free = [b for b in self._free if b is not buffer]
            return buffer
        self.shared_bytes -= sum(b.numel() for b in self._free)  # all too small: let them go
        self._free = []
        buffer = shared_buffer(nbytes, self.device)
        self.shared_bytes += buffer.numel()
        self.peak_shared_bytes = max(self.peak_shared_bytes, self.shared_bytes)
        return buffer

    def _release(self, bucket_id: int) -> None:
        entry = self._alive.get(bucket_id)
        if entry is None:
            return
        buffer, holders = entry
        if holders > 1:
            self._alive[bucket_id] = (buffer, holders - 1)
            return
        del self._alive[bucket_id]
        self._free.append(buffer)
