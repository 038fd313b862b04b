"""Write an HF checkpoint as sharded safetensors, one tensor at a time.

safetensors' own `save_file` needs every tensor of a file in memory at once (and
serialises a second copy). Here the whole output is planned first, from names,
dtypes and shapes only, so each file's header can be written before its data;
tensors then stream to disk in plan order and are dropped. Peak memory is the
caller's bucket, whatever the shard size.

    files = plan_shards(specs, max_shard_bytes=parse_size("5GB"))
    with ShardedSafetensorsWriter(out_dir, files) as writer:
        for name, tensor in tensors_in_plan_order:
            writer.write(name, tensor)
        writer.finish()                      # model.safetensors.index.json when > 1 file

File format (https://github.com/huggingface/safetensors#format): 8-byte
little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {"format": "pt"}} padded with
spaces to a multiple of 8, then the tensors' bytes back to back.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from megatron_rl.config.core import ConfigError

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """'5GB' -> 5,000,000,000 bytes; '512MiB' -> 536,870,912 (transformers' max_shard_size convention)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise ConfigError(f"size {text!r} is not understood: write a number with an optional unit, e.g. 5GB, 500MB, 512MiB")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    if value <= 0:
        raise ConfigError(f"size {text!r} must be > 0 bytes")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one output tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = math.prod(self.shape)
        return numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ShardFile:
    """One output file and the tensors it holds, in write order."""

    name: str
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[ShardFile]:
    """Cut `specs`, in order, into files of at most max_shard_bytes (a larger tensor gets a file of its own).

    Names follow transformers: model.safetensors for one file, else
    model-00001-of-0000N.safetensors.
    """
    seen: set[str] = set()
    groups: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r} is planned twice")
        if spec.dtype not in DTYPE_CODES:
            raise ConfigError(f"tensor {spec.name!r} has dtype {spec.dtype}, which safetensors cannot store")
        seen.add(spec.name)
        if not groups or (groups[-1] and size + spec.nbytes > max_shard_bytes):
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    if not groups:
        raise ValueError("nothing to write: no tensors planned")
    if len(groups) == 1:
        return [ShardFile(SINGLE_NAME, tuple(groups[0]))]
    n = len(groups)
    return [ShardFile(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)]


def header_bytes(tensors: Sequence[TensorSpec]) -> bytes:
    """The length prefix and JSON header of a file holding `tensors` back to back."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in tensors:
        header[spec.name] = {"dtype": DTYPE_CODES[spec.dtype], "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of `tensor`, without a copy when it is contiguous on the CPU."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class ShardedSafetensorsWriter:
    """Writes the planned files under `out_dir`; tensors must arrive in plan order (checked)."""

    def __init__(self, out_dir: str | os.PathLike, files: Sequence[ShardFile]) -> None:
        self.out_dir = Path(out_dir)
        self.files = list(files)
        self._order = [(f, spec) for f in self.files for spec in f.tensors]
        self._next = 0
        self._handle = None

    def __enter__(self) -> "ShardedSafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise RuntimeError(f"tensor {name!r} arrived after the last planned tensor")
        shard, spec = self._order[self._next]
        if name != spec.name:
            raise RuntimeError(f"tensor {name!r} arrived where the plan expects {spec.name!r} (internal ordering bug)")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise RuntimeError(
                f"tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the plan says {spec.dtype} {spec.shape}"
            )
        if spec is shard.tensors[0]:
            self._open(shard)
        if spec.nbytes:
            self._handle.write(_tensor_bytes(tensor))
        self._next += 1
        if spec is shard.tensors[-1]:
            self._close_file()

    def _open(self, shard: ShardFile) -> None:
        self._handle = open(self.out_dir / shard.name, "wb")
        self._handle.write(header_bytes(shard.tensors))

    def _close_file(self) -> None:
        handle, self._handle = self._handle, None
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()

    def finish(self) -> None:
        """Check every planned tensor arrived; write the index when there are several files."""
        if self._next != len(self._order):
            missing = [spec.name for _, spec in self._order[self._next : self._next + 4]]
            raise RuntimeError(f"{len(self._order) - self._next} planned tensors were never written (e.g. {missing})")
        if len(self.files) > 1:
            index = {
                "metadata": {"total_size": sum(f.nbytes for f in self.files)},
                "weight_map": {spec.name: f.name for f in self.files for spec in f.tensors},
            }
            (self.out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
