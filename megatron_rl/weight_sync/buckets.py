"""Buckets of HF-named tensors and their wire format.

A bucket is `list[(hf_name, tensor)]`, at most about `bucket_bytes` of data
(a single tensor larger than that is a bucket of its own). On the wire (an
engine in another process or behind HTTP) a bucket is the bytes of
`safetensors.torch.save`, optionally base64 text for JSON bodies.
"""

from __future__ import annotations

import base64
import json
from typing import Iterable, Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]


def tensor_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def bucketize(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group (name, tensor) pairs into buckets of at most bucket_bytes (one oversized tensor per bucket)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    bucket: Bucket = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def bucket_to_bytes(bucket: Bucket) -> bytes:
    """safetensors bytes of a bucket (tensors moved to CPU, made contiguous, un-aliased)."""
    from safetensors.torch import save

    state = {}
    storages: set[int] = set()
    for name, tensor in bucket:
        tensor = tensor.detach().to("cpu").contiguous()
        key = tensor.untyped_storage().data_ptr()
        if key in storages:  # safetensors refuses tensors sharing storage
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        state[name] = tensor
    # safetensors sorts its header; keep the sender's order (vLLM reloads layer by layer, in order)
    return save(state, metadata={"order": json.dumps([name for name, _ in bucket])})


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The __metadata__ of safetensors bytes (safetensors.torch.load drops it): 8-byte length, then JSON."""
    header_len = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + header_len]).get("__metadata__", {}) or {}


def bucket_from_bytes(data: bytes) -> Bucket:
    """Inverse of bucket_to_bytes, in the sender's order."""
    from safetensors.torch import load

    tensors = load(data)
    order = json.loads(safetensors_metadata(data).get("order", "null")) or list(tensors)
    return [(name, tensors[name]) for name in order]


def bucket_to_b64(bucket: Bucket) -> str:
    return base64.b64encode(bucket_to_bytes(bucket)).decode("ascii")


def bucket_from_b64(text: str) -> Bucket:
    return bucket_from_bytes(base64.b64decode(text))
