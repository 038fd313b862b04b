"""Sparse-delta weight pushes (rollout.weight_delta): only the values that changed since the last push travel.

Small-learning-rate steps change a minority of a tensor's values once it is
rounded to the wire dtype (bf16 on GPUs). Each sender keeps what the engines
hold of its tensors from the last push (`DeltaEncoder.held`, wire dtype, in host
memory: pinned beside a GPU, so that it takes no device memory between pushes and
each tensor's comparison copies it back without staging) and
sends, per tensor, the flat positions whose bits changed and their new values;
where that is not smaller than the tensor (positions cost 4 or 8 bytes each),
the tensor goes dense. Every tensor carries a checksum of its new bytes; the
worker applies the delta to its own copy of the last push (`DeltaHolder`), and
refuses the push unless the result's checksum matches: the engine's copy
equals the trainer's bit for bit, or the push breaks (and is made again in full).

A delta needs both sides on the same base version: a full push every
`full_every` versions, after any broken push, and whenever an engine does not
hold the base (restarted: it serves its model directory and has no copy);
the sender learns that before the push (`mrl_delta_base`) and says so in the log.

Wire form of a bucket: dense tensors as they are; a sparse tensor as two,
`<name>#idx` (int32 or int64 positions) and `<name>#val` (values); `meta`
(JSON, sent with the layout) has per HF name its kind, shape, dtype and checksum.
"""

from __future__ import annotations

import hashlib
import logging

import torch

from megatron_rl.weight_sync.buckets import Bucket, tensor_bytes
from megatron_rl.weight_sync.manifest import WeightPushError

logger = logging.getLogger(__name__)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_checksum(tensor: torch.Tensor) -> str:
    """blake2b (16 bytes) of the tensor's bytes, in hex: equal checksums mean equal bits."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values in host memory (a copy): pinned when it is on a GPU (a later copy back is asynchronous)."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as integers of its element size (a bitwise comparison: NaN == NaN, -0 != +0)."""
    return tensor.reshape(-1).view(_INT_OF_SIZE[tensor.element_size()])


class DeltaEncoder:
    """A sender's side: what the engines hold of its tensors, and each bucket encoded against it."""

    def __init__(self, full_every: int):
        if full_every < 1:
            raise ValueError(f"rollout.weight_delta_full_every={full_every}: must be >= 1 (1 = every push in full)")
        self.full_every = int(full_every)
        self.held: dict[str, torch.Tensor] = {}
        self.base: int | None = None
        """The version `held` is (None: nothing held, the next push is full)."""
        self.since_full = 0
        self._pending: dict[str, torch.Tensor] = {}

    def wants_delta(self) -> bool:
        return self.base is not None and self.since_full + 1 < self.full_every

    def encode(self, bucket: Bucket, delta: bool) -> tuple[Bucket, dict]:
        """(wire bucket, meta) for one bucket; every tensor is kept as the next base (once committed)."""
        wire: Bucket = []
        meta: dict[str, dict] = {}
        for name, tensor in bucket:
            kept = host_copy(tensor)  # the next base, and what the checksum reads (one copy off the device)
            entry = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                     "checksum": tensor_checksum(kept), "kind": "dense"}
            old = self.held.get(name) if delta else None
            if old is not None and old.shape == tensor.shape and old.dtype == tensor.dtype:
                old = old.to(tensor.device, non_blocking=True)  # compared where the tensor is
                changed = torch.nonzero(_bits(old) != _bits(tensor)).reshape(-1)
                index = changed.to(torch.int32 if tensor.numel() < 2**31 else torch.int64)
                values = tensor.reshape(-1)[changed]
                if tensor_bytes(index) + tensor_bytes(values) < tensor_bytes(tensor):
                    entry["kind"] = "sparse"
                    wire += [(f"{name}#idx", index), (f"{name}#val", values)]
            if entry["kind"] == "dense":
                wire.append((name, tensor))
            meta[name] = entry
            self._pending[name] = kept
        return wire, meta

    def commit(self, version: int, delta: bool) -> None:
        """The push went through: what it sent is what the engines hold now."""
        self.held.update(self._pending)
        self._pending = {}
        self.base = int(version)
        self.since_full = self.since_full + 1 if delta else 0

    def reset(self) -> None:
        """The push broke (or an engine restarted): nothing is known to be held; the next push is full."""
        self.held, self._pending, self.base, self.since_full = {}, {}, None, 0


class DeltaHolder:
    """A worker's side: its copy of the last push's tensors (wire dtype, host memory) and their version."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}
        self.base: int | None = None
        self._pending: dict[str, torch.Tensor] = {}

    def decode(self, wire: Bucket, meta: dict, base: int | None) -> Bucket:
        """The bucket's full tensors from its wire form, each checked against its checksum."""
        if base is not None and base != self.base:
            raise WeightPushError(
                f"weight delta against version {base} refused: this worker holds "
                f"{'no copy' if self.base is None else f'version {self.base}'} (restarted or broken since): push in full"
            )
        tensors = dict(wire)
        out: Bucket = []
        for name, entry in meta.items():
            if entry["kind"] == "dense":
                tensor = tensors[name]
            else:
                old = self.held.get(name)
                if old is None:
                    raise WeightPushError(f"weight delta for {name!r} refused: this worker holds no copy of it")
                values = tensors[f"{name}#val"]
                tensor = old.to(values.device, copy=True)  # where the pushed values are (the engine's device)
                tensor.reshape(-1)[tensors[f"{name}#idx"].long()] = values
            kept = host_copy(tensor)  # the next base (host memory), and what the checksum reads
            if tensor_checksum(kept) != entry["checksum"]:
                raise WeightPushError(f"weight push broken: {name!r} ({entry['kind']}) does not match the trainer's "
                                      "checksum after applying it")
            self._pending[name] = kept
            out.append((name, tensor))
        return out

    def commit(self, version: int) -> None:
        if self._pending:
            self.held.update(self._pending)
            self.base = int(version)
        self._pending = {}

    def reset(self) -> None:
        self.held, self._pending, self.base = {}, {}, None
