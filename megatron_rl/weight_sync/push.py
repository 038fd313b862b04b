"""Trainer -> engine weight push.

Every trainer rank calls

    push_weights(engine if rank == 0 else None, export_hf_weights(chunks, ctx, bucket_bytes=...), version)

The export is a collective (TP gathers, EP/PP sends), so every rank iterates
it to the end; ranks without an engine just drain it. The engine checks the
whole push's announced names, shapes and dtypes (weight_sync.stream) before
the first byte moves: a refused push raises WeightPushError naming the
tensor, after draining the export, and the engine keeps its weights and
version. Then buckets stream into the engine as the export produces them
(weight_sync.protocol); a push that breaks midway leaves the engine on a complete
version and, given a function that makes the export, is made again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from megatron_rl.parallel.devices import group_device
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.manifest import WeightPushError
from megatron_rl.weight_sync.stream import PushBrokenError

logger = logging.getLogger(__name__)


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


class SupportsWeightPush(Protocol):
    def update_weights(self, buckets: Iterable[Bucket], version: int) -> PushStats: ...


def push_weights(
    engine: SupportsWeightPush | None,
    buckets: Iterable[Bucket] | Callable[[], Iterable[Bucket]],
    version: int,
    *,
    group: Any = None,
    max_attempts: int = 3,
) -> PushStats | None:
    """Push `buckets` into `engine` as weight `version`; with engine=None just drain the export (other ranks).

    buckets may be a function that makes the export (every rank calls it): then a push that breaks midway
    (the engine restored itself to a complete version, PushBrokenError) is made again from a fresh export,
    up to max_attempts times or until an attempt breaks with the same error as the one before. Every rank
    must learn of the failure to join the new export, so with more than one rank pass `group` (the
    trainer's world group): the outcome is agreed there with one all_reduce per attempt (two when it broke).
    """
    make = buckets if callable(buckets) else None
    last_failure = None
    for attempt in range(1, max_attempts + 1):
        stream = make() if make is not None else buckets
        error: BaseException | None = None
        stats = None
        if engine is None:
            for _ in stream:
                pass
        else:
            try:
                stats = engine.update_weights(stream, version)
            except BaseException as raised:  # noqa: BLE001 - agreed with the other ranks below, then raised or retried
                error = raised
        broken = any_rank(error is not None and _is_broken_push(error), group)
        if error is not None and not _is_broken_push(error):
            raise error
        if not broken:
            return stats
        # a push that breaks exactly as the one before (a weight the engine does not load) is not made a third time
        repeated = any_rank(error is not None and str(error) == last_failure, group)
        last_failure = None if error is None else str(error)
        if make is None or attempt == max_attempts or repeated:
            if error is not None:
                raise error
            raise WeightPushError(f"weight push v{version} broke on the pushing rank after {attempt} attempt(s)")
        logger.warning("weight push v%d broke midway (%s); exporting again (attempt %d of %d)", version, error, attempt + 1, max_attempts)
    return None


def _is_broken_push(error: BaseException) -> bool:
    return isinstance(error, PushBrokenError)


def any_rank(flag: bool, group: Any) -> bool:
    """Whether `flag` holds on any rank of `group` (this rank's own flag without a group)."""
    if group is None or not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=group_device(group))  # NCCL takes no host tensor
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(value.item())
