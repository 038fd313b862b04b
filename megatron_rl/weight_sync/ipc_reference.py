"""The trainer's own tensors go to the engine workers by reference: no copy on the way.

A push by memory handle (weight_sync.ipc) writes each bucket into a shared
buffer the worker maps, and the worker copies it into its parameters: two
passes over the bytes. The trainer's parameters can be mapped themselves
(`allow_by_reference`, once), and the export yields them as they are
(models.export_hf_weights(fresh=False)). Such a tensor needs no buffer: the
bucket's layout names its storage (a handle per worker, as for a buffer), its
offset, shape and strides, and the worker copies straight from the trainer's
memory into its own parameters, the one pass a plain copy makes. What is not
the trainer's own (TP shards gathered from other ranks, re-laid-out tensors)
is written into the bucket's buffer as before.

- On the host, a storage must live in shared memory to be mapped: torch moves
  it there in place (`share_host_memory`), every view of it keeps working.
- On a GPU, any block of torch's CUDA allocator has an IPC handle (what vLLM's
  own IPC weight transfer sends for unpacked weights); the storages of the
  tensors passed are noted, so that only they go by reference: a temporary of
  the export, shared and dropped, would stay allocated until the worker let go
  of it. A block whose handle torch refuses (an allocator configuration
  without IPC) sends its bucket through the buffer, and nothing more goes by
  reference (`forget_references`).

The worker keeps its mappings of the host storages a push used for the next
push (mapping a file anew faults its pages in, which took longer than the
copy); CUDA ones go when the push ends, after the worker's copies have run
(weight_sync.ipc_receive.IpcReceiver.close: an offloaded trainer must get its GPU
memory back). The trainer does not write its parameters while a push runs
(the push holds the engine, and the optimizer step comes after it), and on a
GPU their last writes have completed before a handle goes out (IpcRelay).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from megatron_rl.weight_sync.buckets import Bucket, tensor_bytes

SHM_DIR = "/dev/shm"
"""Where torch's shared host memory lives (torch_shm_manager's files)."""


class SharedMemoryFullError(RuntimeError):
    """The host's shared memory cannot hold what was to be moved there."""


@contextlib.contextmanager
def host_memory_by_name():
    """torch's file_system sharing strategy while a handle is made: host memory is named by its file, which any
    process can open (the default, a descriptor, reaches only a multiprocessing child of this process)."""
    import torch.multiprocessing as mp

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(previous)


def share_host_memory(tensors: list[torch.Tensor]) -> int:
    """Move the storages of the host tensors among `tensors` into shared memory, in place (once; each view of them
    keeps working); returns the bytes moved. Raises SharedMemoryFullError, moving nothing, when /dev/shm has less
    room than that (a container's default of 64 MB: its writes would end the process with SIGBUS)."""
    storages = {}
    for tensor in tensors:
        if tensor.device.type == "cpu" and tensor.numel():
            storage = tensor.untyped_storage()
            if not storage.is_shared():
                storages[storage.data_ptr()] = storage
    needed = sum(s.nbytes() for s in storages.values())
    if not needed:
        return 0
    stat = os.statvfs(SHM_DIR) if os.path.isdir(SHM_DIR) else None
    room = stat.f_bavail * stat.f_frsize if stat is not None else needed
    if room < needed:
        raise SharedMemoryFullError(
            f"moving {needed} bytes of weights into shared memory for a push by memory handle, but {SHM_DIR} has "
            f"{room} bytes free: give the container more (docker run --shm-size) or set rollout.weight_transport="
            "broadcast")
    with host_memory_by_name():  # file-named from the start: a handle made later (file_system) copies nothing
        for storage in storages.values():
            storage.share_memory_()
    return needed


_DEVICE_STORAGES: dict[tuple[str, int], Any] = {}
"""(device, data pointer) -> a weak reference to a device storage `allow_by_reference` noted."""


def allow_by_reference(tensors: list[torch.Tensor]) -> int:
    """Let the tensors among `tensors` go to a push's workers by reference (see the module docstring): host ones
    move into shared memory (`share_host_memory`, whose bytes moved are returned; it raises SharedMemoryFullError),
    the storages of CUDA ones are noted (nothing moves)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    moved = share_host_memory(tensors)
    for key in [key for key, noted in _DEVICE_STORAGES.items() if noted.expired()]:  # freed since (an offload)
        del _DEVICE_STORAGES[key]
    for tensor in tensors:
        if tensor.is_cuda and tensor.numel():
            storage = tensor.untyped_storage()
            _DEVICE_STORAGES[(str(tensor.device), storage.data_ptr())] = StorageWeakRef(storage)
    return moved


def forget_references() -> None:
    """No device storage goes by reference from now on (torch refused a handle of one: weight_sync.ipc)."""
    _DEVICE_STORAGES.clear()


def by_reference(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` can go to the workers of a push from `device` by reference (see the module docstring)."""
    if tensor.device != device or tensor_bytes(tensor) == 0:
        return False
    storage = tensor.untyped_storage()
    if device.type == "cpu":
        return storage.is_shared()
    noted = _DEVICE_STORAGES.get((str(tensor.device), storage.data_ptr()))
    return noted is not None and not noted.expired() and noted.cdata == storage._cdata  # the noted storage itself


def split_bucket(bucket: Bucket, device: torch.device) -> tuple[Bucket, Bucket]:
    """(what goes by reference, what is written into the bucket's buffer)."""
    referenced = [(n, t) for n, t in bucket if by_reference(t, device)]
    names = {n for n, _ in referenced}
    return referenced, [(n, t) for n, t in bucket if n not in names]


def describe_references(referenced: Bucket) -> tuple[list[dict], list[Any]]:
    """The layout entries of `referenced` ({name, dtype, shape, stride, offset in elements, source}) and the
    storages they name (each once, `source` indexes them)."""
    sources: dict[int, int] = {}
    storages, entries = [], []
    for name, tensor in referenced:
        storage = tensor.untyped_storage()
        index = sources.setdefault(storage.data_ptr(), len(storages))
        if index == len(storages):
            storages.append(storage)
        entries.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                        "stride": list(tensor.stride()), "offset": int(tensor.storage_offset()), "source": index})
    return entries, storages


def storage_view(storage: Any) -> torch.Tensor:
    """A uint8 tensor over all of `storage` (what weight_sync.ipc.export_handle takes), on its device (torch refuses
    a storage of another device than the tensor's)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def open_references(entries: list[dict], storages: list[Any]) -> Bucket:
    """Views of the trainer's tensors that `entries` describe, over the mapped `storages`."""
    bucket: Bucket = []
    for entry in entries:
        dtype = getattr(torch, entry["dtype"])
        storage = storages[int(entry["source"])]
        view = torch.empty(0, dtype=dtype, device=storage.device).set_(
            storage, int(entry["offset"]), [int(d) for d in entry["shape"]], [int(d) for d in entry["stride"]])
        bucket.append((entry["name"], view))
    return bucket
