"""The engine worker's end of a push by memory handle (weight_sync.ipc is the pushing side).

Each bucket's message names a `reduce_tensor` handle per worker (a CUDA IPC
handle, or host shared memory named by its file) and, for tensors the trainer
sends by reference, the handles of their storages (weight_sync.ipc_reference).
`IpcReceiver.open` maps the handle of its worker's device (checked to be the GPU
that shared it, by UUID) and returns views of the bucket; `take_released` tells
the pushing side which buckets' memory the worker no longer holds, and `close`
ends a push. A handle is unpickled with an allowlist (torch's rebuild functions,
tensor and storage types, dtypes), so it cannot name anything else.
"""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any

import torch

from megatron_rl.weight_sync.broadcast import gpu_uuid, unpack_bucket
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.ipc_reference import open_references


class IpcError(RuntimeError):
    """A bucket's memory handle could not be used by the engine worker."""


_HANDLE_TYPES = {
    ("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "TypedStorage"), ("torch.storage", "UntypedStorage"),
    ("torch", "TypedStorage"), ("torch", "UntypedStorage"),
}


class _HandleUnpickler(pickle.Unpickler):
    """Unpickles a `reduce_tensor` handle and nothing else (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"):
            return super().find_class(module, name)
        if (module, name) in _HANDLE_TYPES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise IpcError(f"a weight handle names {module}.{name}, which is not part of a tensor handle: refused")


def import_handle(handle: str | bytes, trainer_gpu: str = "") -> torch.Tensor:
    """Map the tensor a handle from `export_handle` describes (base64 text, or its pickled bytes).

    A CUDA handle is opened on this process's current device, which must be the GPU that shared it
    (`trainer_gpu`, its UUID): device indices differ between processes, the physical GPU does not.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    pickled = base64.b64decode(handle) if isinstance(handle, str) else bytes(handle)
    rebuild, args = _HandleUnpickler(io.BytesIO(pickled)).load()
    if rebuild is rebuild_cuda_tensor:
        if not torch.cuda.is_available():
            raise IpcError("a CUDA weight handle reached an engine worker without CUDA: use rollout.weight_transport=broadcast")
        device = torch.device("cuda", torch.cuda.current_device())
        if trainer_gpu and gpu_uuid(device) != trainer_gpu:
            raise IpcError(
                f"the engine worker on {device} ({gpu_uuid(device)}) is not on the GPU that shared its weights "
                f"({trainer_gpu}): CUDA IPC handles open only on the GPU that made them (worker j of an engine maps "
                "the buffer of the trainer rank on its GPU); set rollout.weight_transport=broadcast"
            )
        args = list(args)
        args[6] = device.index  # the storage's device, as this process numbers it
    return rebuild(*args)


class IpcReceiver:
    """Engine-worker end: opens each bucket's buffer and tells which buckets it has let go of.

    A bucket is let go of when nothing but this receiver holds its memory: the loading may keep views of views
    of it (vLLM's layerwise reload keeps a fused layer's parts), so what is counted is the storage's references
    (its use count), not a tensor object.

    The mapping of a let-go buffer is kept (at most `keep_mapped` of them): the pushing side writes its released
    buffers again, and their next handle then finds the mapping in torch's cache of shared storages
    (torch.multiprocessing.reductions.shared_cache) instead of opening the memory again (cudaIpcOpenMemHandle on
    a GPU; on the host, mapping the file anew and faulting its pages in, which took longer than the copy). CUDA
    mappings go when the push ends (`close`: a mapped block stays allocated on the trainer's GPU); host ones are
    kept for the next push too, whose buffers the engine keeps (weight_sync.ipc.BufferPool.release_all).
    """

    keep_mapped = 8

    def __init__(self) -> None:
        # (sender, bucket id) -> (its mapped storage, its CUDA device): ids count from 0 in every push
        self._open: dict[tuple[str, int], tuple[Any, torch.device | None]] = {}
        self._idle: list[Any] = []  # mappings of let-go buffers, oldest first
        self._sources: dict[int, Any] = {}  # the trainer's storages taken by reference (weight_sync.ipc_reference)
        self._used: set[int] = set()  # of those, the ones this push named
        self.mapped = 0
        """Buffers mapped anew (not found among the mappings kept) since the receiver was made."""

    def open(self, message: dict, worker_rank: int = 0) -> Bucket:
        """Views of the shared bucket a message from IpcSender describes: the handle of worker `worker_rank` of its
        engine (of the copy on its device)."""
        handles, gpus = list(message["handles"]), list(message.get("trainer_gpus") or [""] * len(message["handles"]))
        if worker_rank >= len(handles):
            raise IpcError(f"a weight bucket carries {len(handles)} handles, none for engine worker {worker_rank}: "
                           "the trainer counts fewer workers than the engine has")
        bucket = self._buffered(message, handles[worker_rank], str(gpus[worker_rank])) if handles[worker_rank] else []
        if message["layout"].get("referenced"):
            storages = [self._source(handle, str(gpus[worker_rank])) for handle in message["sources"][worker_rank]]
            bucket += open_references(message["layout"]["referenced"], storages)
        return bucket

    def _buffered(self, message: dict, handle: str, trainer_gpu: str) -> Bucket:
        """Views of the bucket's buffer."""
        flat = import_handle(handle, trainer_gpu)
        storage = flat.untyped_storage()
        held = [s for s in self._idle if s.data_ptr() == storage.data_ptr()]
        if not held and all(s.data_ptr() != storage.data_ptr() for s, _ in self._open.values()):
            self.mapped += 1
        self._idle = [s for s in self._idle if s.data_ptr() != storage.data_ptr()]  # in use again
        device = flat.device if flat.is_cuda else None
        self._open[(str(message["sender"]), int(message["bucket_id"]))] = (storage, device)
        return unpack_bucket(message["layout"], flat)

    def _source(self, handle: str, trainer_gpu: str = "") -> Any:
        """A storage of the trainer's taken by reference, mapped (or found among those kept)."""
        storage = import_handle(handle, trainer_gpu).untyped_storage()
        key = storage.data_ptr()
        if key not in self._sources:
            self.mapped += 1
            self._sources[key] = storage
        self._used.add(key)
        return storage

    def take_released(self, sender: str) -> list[int]:
        """Ids of `sender`'s buckets whose memory only this receiver holds now (forgetting earlier pushes' ones)."""
        released = [key for key, (storage, _) in self._open.items() if _use_count(storage) <= 1]
        devices = set()
        for key in released:
            storage, device = self._open.pop(key)
            devices.add(device)
            self._idle.append(storage)
        del self._idle[: max(0, len(self._idle) - self.keep_mapped)]
        for device in devices - {None}:  # copies out of a released bucket may still be queued on a stream
            torch.cuda.synchronize(device)
        return [bucket_id for owner, bucket_id in released if owner == sender]

    def close(self) -> None:
        """The push ended: every CUDA mapping goes (a CUDA block stays allocated on the trainer's GPU while a worker
        maps it), once the copies out of the trainer's own storages have run (it writes them again after the push);
        the last `keep_mapped` host mappings stay for the next push, which writes the same buffers, and so do the
        trainer's host storages this push named (not those of earlier pushes only)."""
        host = [storage for storage, device in self._open.values() if device is None]
        self._open.clear()
        self._idle = [s for s in self._idle + host if s.device.type == "cpu"][-self.keep_mapped :]
        for device in {storage.device for storage in self._sources.values() if storage.device.type == "cuda"}:
            torch.cuda.synchronize(device)
        self._sources = {key: storage for key, storage in self._sources.items()
                         if storage.device.type == "cpu" and (key in self._used or not self._used)}
        self._used = set()


def _use_count(storage: Any) -> int:
    """References to `storage`'s memory: tensors, views of views and storage objects (this one included)."""
    return int(torch._C._storage_Use_Count(storage._cdata))
