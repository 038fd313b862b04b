"""The actor's memory handed to the host while the engine generates, and taken back before training.

    offload = ActorOffload(actor.model, actor.optimizer, mode="all")
    offload.to_host(["optimizer", "grads"])   # after training: only the parameters stay for the weight push
    ...                                       # push the weights
    offload.to_host()      # the parameters too: the engine gets the device for generation
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

from megatron_rl.config.schema import OFFLOAD_PARTS

OffloadMode = Literal["none", "optimizer", "all"]
OffloadPart = Literal["optimizer", "grads", "params"]


def _distinct_storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, torch.Tensor]:
    """One tensor per distinct storage among `tensors` (views of one buffer share one), keyed by the storage's address."""
    found: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes():
            found.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    return found


def param_tensors(model_chunks: list) -> list[torch.Tensor]:
    """Parameters and megatron DDP's parameter buffers (which the parameters view, with the distributed optimizer)."""
    tensors = [param for chunk in model_chunks for param in chunk.parameters()]
    tensors += [buffer.param_data for buffer in _ddp_buffers(model_chunks)]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def grad_tensors(model_chunks: list) -> list[torch.Tensor]:
    """Gradient views of the parameters and megatron DDP's gradient buffers."""
    tensors = [g for chunk in model_chunks for p in chunk.parameters() for g in (p.grad, getattr(p, "main_grad", None))]
    tensors += [buffer.grad_data for buffer in _ddp_buffers(model_chunks)]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def model_tensors(model_chunks: list) -> list[torch.Tensor]:
    """Parameters, their gradient views and megatron DDP's parameter and gradient buffers."""
    return param_tensors(model_chunks) + grad_tensors(model_chunks)


def _ddp_buffers(model_chunks: list) -> list:
    def listed(chunk, name: str) -> list:  # DDP's lists (a plain module's `buffers` is nn.Module's method)
        value = getattr(chunk, name, [])
        return value if isinstance(value, list) else []

    return [b for chunk in model_chunks for b in [*listed(chunk, "buffers"), *listed(chunk, "expert_parallel_buffers")]]


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


def free_device_memory(model_chunks: list, optimizer) -> None:
    """Free every storage of the chunks (parameters, gradients, DDP buffers, module buffers) and of the optimizer's
    state in place (``resize_(0)``), and drop what ties them to megatron's DDP: its accumulator hooks and the
    config's bound functions. Actor.close() calls it; the chunks and optimizer are unusable after."""
    tensors = model_tensors(model_chunks) + (optimizer_tensors(optimizer) if optimizer is not None else [])
    tensors += [b for chunk in model_chunks for b in torch.nn.Module.buffers(chunk)]  # (DDP shadows .buffers)
    for tensor in _distinct_storages(tensors).values():
        tensor.untyped_storage().resize_(0)
    for chunk in model_chunks:
        _drop_accumulator_hooks(getattr(chunk, "grad_accs", []))
        config = getattr(chunk, "config", None)
        for name in ("no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func", "grad_scale_func"):
            if config is not None and hasattr(config, name):
                setattr(config, name, None)


def _drop_accumulator_hooks(grad_accs: list) -> None:
    """Clear the hooks megatron's DDP put on autograd's gradient accumulators, then drop the accumulators.

    Each hook's closure holds its parameter and the DDP module, and autograd keeps an accumulator
    alive from C++ after a backward, where Python's collector cannot see the cycle. torch keeps a
    node's Python hooks in one dict, which a RemovableHandle of any hook on that node refers to.
    """
    for accumulator in grad_accs:
        handle = accumulator.register_hook(lambda *_: None)
        hooks = handle.hooks_dict_ref()
        if hooks is not None:
            hooks.clear()
    grad_accs.clear()


class ActorOffload:
    """Moves the actor's storages to the host and back (see the module docstring).

    The storages fall in three parts, each moved on its own: "optimizer" (state
    and main parameters that are not the model's), "grads" (gradient buffers
    and views) and "params" (the model's parameters and parameter buffers).
    A storage shared by two parts belongs to the first of params, grads,
    optimizer. The trainer moves the optimizer and gradients out before the
    weight push and the parameters after it, so that the push runs with only
    the parameters resident (train.offload=all).
    """

    def __init__(self, model_chunks: list, optimizer, mode: OffloadMode):
        if mode not in ("none", "optimizer", "all"):
            raise ValueError(f"train.offload={mode!r}: choose none, optimizer or all")
        self.model_chunks, self.optimizer, self.mode = model_chunks, optimizer, mode
        self.parts: tuple[OffloadPart, ...] = OFFLOAD_PARTS[mode]  # type: ignore[assignment]
        """The parts this mode moves."""
        # id(tensor) -> (the tensor, its storage's bytes on the host); host buffers are kept between offloads
        self._host: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._offloaded: dict[OffloadPart, list[int]] = {}

    def _storages(self) -> dict[OffloadPart, list[torch.Tensor]]:
        """One tensor per device storage of each part (found again at each offload: Adam's state appears at its
        first step). The optimizer's main parameters may be the model's own (fp32 training): they are params."""
        found_params = _distinct_storages(param_tensors(self.model_chunks))
        found_grads = {a: t for a, t in _distinct_storages(grad_tensors(self.model_chunks)).items() if a not in found_params}
        found_optim = {
            a: t for a, t in _distinct_storages(optimizer_tensors(self.optimizer)).items()
            if a not in found_params and a not in found_grads
        }
        return {"params": list(found_params.values()), "grads": list(found_grads.values()),
                "optimizer": list(found_optim.values())}

    def to_host(self, parts: Iterable[OffloadPart] | None = None) -> int:
        """Copy the storages of `parts` (default: every part of the mode) to host memory and free them on the
        device; returns the bytes this call moved. Parts outside the mode, or already on the host, are skipped."""
        wanted = [p for p in (self.parts if parts is None else parts) if p in self.parts and p not in self._offloaded]
        if not wanted:
            return 0
        pinned = torch.cuda.is_available()
        storages = self._storages()
        chosen = {part: storages[part] for part in wanted}
        for tensor in (t for tensors in chosen.values() for t in tensors):
            storage = tensor.untyped_storage()
            entry = self._host.get(id(tensor))
            if entry is None or entry[1].numel() != storage.nbytes():
                entry = (tensor, torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned))
                self._host[id(tensor)] = entry
            entry[1].untyped_storage().copy_(storage, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()  # the copies are done before the device memory is freed
        moved = 0
        for part, tensors in chosen.items():
            for tensor in tensors:
                moved += tensor.untyped_storage().nbytes()
                tensor.untyped_storage().resize_(0)
            self._offloaded[part] = [id(t) for t in tensors]
        if pinned:
            torch.cuda.empty_cache()  # freed blocks back to the device, for the engine
        return moved

    def to_device(self, parts: Iterable[OffloadPart] | None = None) -> None:
        """Give the offloaded storages of `parts` (default: all) their memory back and copy their bytes in (bit-exact)."""
        wanted = [p for p in (tuple(self._offloaded) if parts is None else parts) if p in self._offloaded]
        if not wanted:
            return
        pinned = torch.cuda.is_available()
        for part in wanted:
            for key in self._offloaded.pop(part):
                tensor, host = self._host[key]
                storage = tensor.untyped_storage()
                storage.resize_(host.numel())
                storage.copy_(host.untyped_storage(), non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()

    @contextmanager
    def on_device(self, parts: Iterable[OffloadPart] | None = None) -> Iterator[None]:
        """`parts` (default: all) on the device inside the block (a checkpoint, a weight push), back where they were after."""
        was_on_host = [p for p in (tuple(self._offloaded) if parts is None else parts) if p in self._offloaded]
        self.to_device(was_on_host)
        try:
            yield
        finally:
            self.to_host(was_on_host)
