"""Trainer -> engine weight push.

Every trainer rank calls

    push_weights(engine if rank == 0 else None, export_hf_weights(chunks, ctx, bucket_bytes=...), version)

The export is a collective (TP gathers, EP/PP sends), so every rank iterates
it to the end; ranks without an engine just drain it. The engine side checks
every bucket against the engine's manifest while the export runs and loads
nothing until the whole push has passed (see weight_sync.manifest): a refused
push raises WeightPushError naming the tensor, after draining the export, and
the engine keeps serving its previous weights and version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.manifest import PushValidator, WeightManifest, WeightPushError


@dataclass
class PushStats:
    """What one push moved and how long it took."""

    version: int
    tensors: int
    bytes: int
    seconds: float
    """Wall time from the first bucket to the engine serving the new weights."""
    load_seconds: float = 0.0
    """Time the engine spent loading (reload + re-pack), inside `seconds`."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class SupportsWeightPush(Protocol):
    def update_weights(self, buckets: Iterable[Bucket], version: int) -> PushStats: ...


def push_weights(engine: SupportsWeightPush | None, buckets: Iterable[Bucket], version: int) -> PushStats | None:
    """Push `buckets` into `engine` as weight `version`; with engine=None just drain the export (other ranks)."""
    if engine is None:
        for _ in buckets:
            pass
        return None
    return engine.update_weights(buckets, version)


def collect_push(
    buckets: Iterable[Bucket], manifest: WeightManifest, encode: Callable[[Bucket], Any]
) -> tuple[list[Any], PushValidator]:
    """Check every bucket against the manifest and encode it for the engine.

    Iterates `buckets` to the end even after a bad tensor (the export is a
    collective other ranks are still in), then raises the first error.
    Returns the encoded payloads and the validator (tensor and byte counts).
    """
    validator = PushValidator(manifest)
    payloads: list[Any] = []
    error: WeightPushError | None = None
    for bucket in buckets:
        bucket = list(bucket)
        if error is not None or not bucket:
            continue
        try:
            validator.check_bucket(bucket)
        except WeightPushError as e:
            error = e
            payloads.clear()
            continue
        payloads.append(encode(bucket))
    if error is None:
        try:
            validator.check_complete()
        except WeightPushError as e:
            error = e
    if error is not None:
        raise error
    return payloads, validator


def to_host(bucket: Bucket) -> Bucket:
    """The bucket with tensors on CPU (kept for re-pushing after an engine restart)."""
    return [(name, t.detach() if t.device.type == "cpu" else t.detach().to("cpu")) for name, t in bucket]


def keep_alive_bytes(payloads: list[Any]) -> int:
    total = 0
    for p in payloads:
        if isinstance(p, (bytes, bytearray, str)):
            total += len(p)
        else:
            total += sum(int(t.numel()) * t.element_size() for _, t in p if isinstance(t, torch.Tensor))
    return total
