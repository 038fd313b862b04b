"""The actor's memory handed to the host while the engine generates, and taken back before training.

    offload = ActorOffload(actor.model, actor.optimizer, mode="all")
    offload.to_host()      # after the weight push: the engine gets the device for generation
    ...                    # generate
    offload.to_device()    # before the old-policy logprobs and training

Modes (train.offload): "optimizer" moves the optimizer's state (Adam's moments,
and the fp32 main parameters when the model trains in bf16); "all" also moves
the model's parameters and gradient buffers.

How: every tensor involved lives in a storage (megatron's DDP keeps
parameters and gradients in a few contiguous buffers that the parameters and
`main_grad`s view). Each distinct storage is copied to a host buffer (pinned
with CUDA, so copies run asynchronously at full bandwidth) and then resized
to zero bytes, which frees its device memory while every tensor and view
keeps pointing at it; bringing it back resizes it and copies the bytes in.
Nothing is re-allocated for the views, so the round trip is bit-exact and
the optimizer's and DDP's references stay valid. Then the caching
allocator's free blocks go back to the device (torch.cuda.empty_cache), so
the engine can allocate them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Literal

import torch

OffloadMode = Literal["none", "optimizer", "all"]


def _distinct_storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, torch.Tensor]:
    """One tensor per distinct storage among `tensors` (views of one buffer share one), keyed by the storage's address."""
    found: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes():
            found.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    return found


def model_tensors(model_chunks: list) -> list[torch.Tensor]:
    """Parameters, their gradient views and megatron DDP's parameter and gradient buffers."""
    tensors: list[torch.Tensor] = []
    for chunk in model_chunks:
        for param in chunk.parameters():
            tensors += [param, param.grad, getattr(param, "main_grad", None)]
        for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
            tensors += [buffer.param_data, buffer.grad_data]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The inner torch optimizers' state (moments) and the parameters they update (main parameters)."""
    tensors: list[torch.Tensor] = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                tensors.append(param)
                tensors += [v for v in inner.state.get(param, {}).values() if isinstance(v, torch.Tensor)]
    return tensors


class ActorOffload:
    """Moves the actor's storages to the host and back (see the module docstring)."""

    def __init__(self, model_chunks: list, optimizer, mode: OffloadMode):
        if mode not in ("none", "optimizer", "all"):
            raise ValueError(f"train.offload={mode!r}: choose none, optimizer or all")
        self.model_chunks, self.optimizer, self.mode = model_chunks, optimizer, mode
        # id(tensor) -> (the tensor, its storage's bytes on the host); host buffers are kept between offloads
        self._host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._offloaded: list[int] = []
        self.last_offloaded_bytes = 0

    @property
    def on_host(self) -> bool:
        return bool(self._offloaded)

    def _chosen(self) -> list[torch.Tensor]:
        """One tensor per storage this mode moves (found again at each offload: Adam's state appears at its
        first step). The optimizer's main parameters may be the model's own (fp32 training): under
        "optimizer" those stay, as the model's."""
        if self.mode == "none":
            return []
        model = _distinct_storages(model_tensors(self.model_chunks))
        optim = _distinct_storages(optimizer_tensors(self.optimizer))
        if self.mode == "optimizer":
            return [t for addr, t in optim.items() if addr not in model]
        return list({**model, **optim}.values())

    def to_host(self) -> int:
        """Copy the chosen storages to host memory and free them on the device; returns the bytes moved."""
        if self.on_host or self.mode == "none":
            return 0
        pinned = torch.cuda.is_available()
        chosen = self._chosen()
        for tensor in chosen:
            storage = tensor.untyped_storage()
            entry = self._host.get(id(tensor))
            if entry is None or entry[1].numel() != storage.nbytes():
                entry = (tensor, torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned))
                self._host[id(tensor)] = entry
            entry[1].untyped_storage().copy_(storage, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()  # the copies are done before the device memory is freed
        for tensor in chosen:
            tensor.untyped_storage().resize_(0)
        self._offloaded = [id(t) for t in chosen]
        if pinned:
            torch.cuda.empty_cache()  # freed blocks back to the device, for the engine
        self.last_offloaded_bytes = sum(self._host[key][1].numel() for key in self._offloaded)
        return self.last_offloaded_bytes

    def to_device(self) -> None:
        """Give every offloaded storage its memory back and copy its bytes in (bit-exact)."""
        if not self.on_host:
            return
        pinned = torch.cuda.is_available()
        for key in self._offloaded:
            tensor, host = self._host[key]
            storage = tensor.untyped_storage()
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()
        self._offloaded = []

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The actor on the device inside the block (a checkpoint, a weight push), back where it was after."""
        was_on_host = self.on_host
        self.to_device()
        try:
            yield
        finally:
            if was_on_host:
                self.to_host()
