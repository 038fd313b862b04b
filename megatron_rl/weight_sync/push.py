"""The push protocol, both of its ends, and the one loop that makes a broken push again.

Trainer side (rank 0's engine, every placement; weight_sync.engine_side drives it): each engine is a PushTarget
(how to call a worker-extension method on it, how to encode a bucket for an RPC, how to reset its prefix cache),
and `stream_push` drives them all through one push:

1. check the push's announced names, shapes and dtypes against the engine's
   manifest (weight_sync.stream.check_announced): a refused push moves nothing;
2. `mrl_begin_push(version)` on every engine;
3. each bucket, as the export produces it, is checked against the
   announcement and sent to every engine at once by the transport's sender
   (weight_sync.transports: one broadcast into all their workers, a memory
   handle, or an RPC per engine), then dropped: the pushing rank holds about
   one bucket at a time (`peak_bytes`, measured);
4. `mrl_commit_push` on every engine, then their prefix caches are reset
   (cached KV was computed with the old weights).

If anything fails after step 2 (an engine died, a bucket broke the
announcement, the export failed) the rest of the export is drained (it is a
collective the other trainer ranks are still in), every engine still
answering aborts its push (`mrl_abort_push`), which brings it back to a
complete version (the model directory's weights), and PushBrokenError says so.
A push where every owner rank sends its own buckets takes the same steps one
round at a time (begin_push, check_round, commit_push, broken_push).

Worker side (inside vLLM's worker, mixed into rollout.worker_ext's extension): `PushReceiver` answers the four
calls; a transport's receiver (weight_sync.transports) only brings buckets to `mrl_stage_weights`.

Every trainer rank: `agree_and_retry` is the one loop around a push: the ranks agree (one all_reduce) whether it
broke on any of them and, given a function that makes the export again, push again from a fresh export;
`push_weights` is the funnel's push into one engine through it:

    push_weights(engine if rank == 0 else None, export_hf_weights(chunks, ctx, bucket_bytes=...), version)

The export is a collective (TP gathers, EP/PP sends), so every rank iterates
it to the end; ranks without an engine just drain it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Protocol, TypeVar

import torch

from megatron_rl.parallel.devices import group_device
from megatron_rl.weight_sync.broadcast import BroadcastSender, all_results, call_in_threads
from megatron_rl.weight_sync.buckets import Bucket, bucket_from_b64, bucket_from_bytes
from megatron_rl.weight_sync.engine_reload import reload_model_directory, repack_cpu_moe_experts
from megatron_rl.weight_sync.manifest import WeightManifest, WeightPushError, manifest_from_checkpoint
from megatron_rl.weight_sync.stream import AnnouncedPush, LiveBytes, PushBrokenError, WeightStream, check_announced
from megatron_rl.weight_sync.streaming_load import StreamingLoad

logger = logging.getLogger(__name__)

Result = TypeVar("Result")


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


@dataclass
class PushTarget:
    """One engine as a push sees it."""

    name: str
    call: Callable[..., Any]
    """call(method, *args): a worker-extension method on every worker of the engine; the first worker's answer."""
    encode: Callable[[Bucket], Any]
    """A bucket as the payload of mrl_stage_weights (tensors in-process, safetensors bytes, base64 text)."""
    reset_prefix_cache: Callable[[], None]
    call_each: Callable[..., list] | None = None
    """call_each(method, *args): every worker's answer, in worker order (memory handles: a bucket's buffers are
    written again only once every worker let go of it); None: the first worker's answer stands for all."""


@dataclass
class PushResult:
    """What one push did: each engine's commit answer and what the pushing rank held."""

    commits: list[dict]
    tensors: int
    bytes: int
    peak_bytes: int
    """Most bytes of exported tensors alive at once on the pushing rank during the push (allocation accounting)."""
    buffer_bytes: int = 0
    """The broadcast packing buffer (about one bucket), or the most bytes of buckets shared by memory handle
    alive at once (weight_sync.ipc); 0 for RPC pushes."""
    versions: list[int | None] = field(default_factory=list)


def commit_engines(targets: list, repack_moe: bool) -> list:
    """Every engine commits the push and resets its prefix cache, all at once (one round trip per push, not one per
    engine); their commit results in target order, or the first engine's error, in order, once every call ended."""

    def commit(target) -> Any:
        result = target.call("mrl_commit_push", "1" if repack_moe else "0")
        target.reset_prefix_cache()
        return result

    if len(targets) == 1:  # an engine in this process is called from the thread that drives it
        return [commit(targets[0])]
    return all_results(call_in_threads([commit] * len(targets), list(targets), "engine-commit"))

def stream_push(targets: list[PushTarget], stream: WeightStream, version: int, *, manifest: WeightManifest,
                sender: Callable[[], BroadcastSender] | None, repack_moe: bool = True) -> PushResult:
    """Push `stream` into every target as `version` (see the module docstring).

    sender: returns what sends each bucket into all the targets' workers: the formed broadcast group
    (weight_sync.broadcast.BroadcastSender) or memory handles (weight_sync.ipc.IpcSender); None: RPC.
    Raises WeightPushError (nothing moved) or PushBrokenError (chained to the failure; engines restored).
    """
    buckets = iter(stream)
    try:
        check_announced(manifest, stream.entries)
    except WeightPushError:
        _drain(buckets)
        raise
    announced, live, broadcast = AnnouncedPush(stream.entries), LiveBytes(), None
    try:
        broadcast = sender() if sender is not None else None
        for target in targets:
            target.call("mrl_begin_push", version)
        names = [target.name for target in targets]
        receives = [partial(t.call_each or t.call, broadcast.receive_method) for t in targets] if broadcast is not None else []
        for bucket in buckets:
            if not bucket:
                continue
            bucket = [(name, live.track(tensor)) for name, tensor in bucket]
            announced.check_bucket(bucket)
            if broadcast is not None:
                broadcast.send(bucket, receives, names)
            else:
                for target in targets:
                    target.call("mrl_stage_weights", target.encode(bucket))
            del bucket
        if getattr(broadcast, "flush", None) is not None:  # memory handles batched: the last ones
            broadcast.flush(receives, names)
        announced.check_complete()
        commits = commit_engines(targets, repack_moe)
    except BaseException as error:
        if broadcast is not None:
            broadcast.abandon()  # memory handles: the rest of the export passes unshared
        _drain(buckets)
        versions = restore_complete_versions(targets)
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise PushBrokenError(
            f"weight push v{version} broke midway ({type(error).__name__}: {error}); engines now serve versions "
            f"{dict(zip([t.name for t in targets], versions))} (None: not answering, to be restarted)", versions
        ) from error
    return PushResult(commits=commits, tensors=len(announced.seen), bytes=announced.num_bytes, peak_bytes=live.peak,
                      buffer_bytes=0 if broadcast is None else broadcast.buffer_bytes, versions=[int(version)] * len(targets))


def restore_complete_versions(targets: list[PushTarget]) -> list[int | None]:
    """Abort the open push on every engine that answers (each reloads a complete version if it had begun
    loading); the version each now serves, None for an engine that does not answer."""
    versions: list[int | None] = []
    for target in targets:
        try:
            versions.append(int(target.call("mrl_abort_push")["version"]))
        except Exception:  # noqa: BLE001 - a dead engine is restarted by its owner, from the model directory
            versions.append(None)
    return versions


def _drain(buckets) -> None:
    for _ in buckets:
        pass


# ---- a push from every owner rank: the same steps, one round at a time -------------------------
def begin_push(targets: list | None, version: int) -> BaseException | None:
    """(rank 0) mrl_begin_push on every engine; what failed, for every rank to agree on (None elsewhere)."""
    try:
        for target in targets or []:
            target.call("mrl_begin_push", version)
    except BaseException as error:  # noqa: BLE001 - agreed by the caller
        return error
    return None


def check_round(announced: AnnouncedPush, parts: list) -> None:
    """(rank 0) The round's buckets (per sender: names, shapes, dtypes) against the push's announcement."""
    for _, entries in parts:
        announced.check_bucket([(n, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
                                for n, shape, dtype in entries])


def commit_push(targets: list, announced: AnnouncedPush, repack_moe: bool) -> tuple[dict | None, BaseException | None]:
    """(rank 0) Every tensor arrived: commit every engine and reset its prefix cache. (result, None) or (None, what
    failed, for every rank to agree on)."""
    try:
        announced.check_complete()
        commits = commit_engines(targets, repack_moe)
        return {"commits": commits, "tensors": len(announced.seen), "bytes": announced.num_bytes}, None
    except BaseException as error:  # noqa: BLE001 - rank 0 alone talks to the engines; agreed by the caller
        return None, error


def broken_push(what: str, version: int, rank: int, failure: BaseException | None, versions: list) -> PushBrokenError:
    """The error every rank raises when a push broke midway (failure: this rank's, None when another rank's)."""
    where = f"trainer rank {rank}: {type(failure).__name__}: {failure}" if failure is not None else "on another trainer rank"
    return PushBrokenError(f"{what} v{version} broke midway ({where}); engines now serve versions {versions} "
                           "(None: not answering, to be restarted)", versions)


def refuse_or_none(targets: list | None, export, manifest: WeightManifest | None, trainer_group: Any,
                   refused: WeightPushError | None = None) -> bool:
    """Collective: rank 0 checks the whole push against the engines' manifest before anything moves. Refused (there,
    or `refused` given on rank 0): every rank drains its export (a collective), rank 0 raises the WeightPushError
    and the others return True. Accepted: False."""
    if targets is not None and refused is None:
        try:
            check_announced(manifest, export.entries)
        except WeightPushError as error:
            refused = error
    if not any_rank(refused is not None, trainer_group):
        return False
    for _ in export:  # a collective: every rank runs it to the end
        pass
    if refused is not None:
        raise refused
    return True


# ---- every trainer rank: the one loop around a push ------------------------------------------------
def agree_and_retry(attempt: Callable[[], Result], version: int, *, group: Any, max_attempts: int,
                    elsewhere: Callable[[int], BaseException], on_broken: Callable[[], None] | None = None,
                    ) -> Result | None:
    """Run `attempt` (one push, every rank at once) until it does not break, at most max_attempts times.

    The ranks agree on `group` (one all_reduce per attempt, two when it broke) whether the push broke midway
    (PushBrokenError, the engines restored to a complete version) on any rank; another error is raised on its
    rank at once. A broken push calls `on_broken` on every rank and is made again (attempt makes a fresh export)
    unless it was the last attempt or it broke exactly as the one before (a weight the engine does not load);
    then the rank that saw the error raises it and the others `elsewhere(attempts made)`."""
    last_failure = None
    for attempt_number in range(1, max_attempts + 1):
        error: BaseException | None = None
        result = None
        try:
            result = attempt()
        except BaseException as raised:  # noqa: BLE001 - agreed with the other ranks below, then raised or retried
            error = raised
        broken = any_rank(isinstance(error, PushBrokenError), group)
        if error is not None and not isinstance(error, PushBrokenError):
            raise error
        if not broken:
            return result
        if on_broken is not None:
            on_broken()
        # a push that breaks exactly as the one before (a weight the engine does not load) is not made a third time
        repeated = any_rank(error is not None and str(error) == last_failure, group)
        last_failure = None if error is None else str(error)
        if attempt_number == max_attempts or repeated:
            raise error if error is not None else elsewhere(attempt_number)
        logger.warning("weight push v%d broke midway (%s); exporting again (attempt %d of %d)", version, error,
                       attempt_number + 1, max_attempts)
    return None


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

    def attempt() -> PushStats | None:
        stream = make() if make is not None else buckets
        if engine is not None:
            return engine.update_weights(stream, version)
        for _ in stream:
            pass
        return None

    def elsewhere(attempts: int) -> BaseException:
        return WeightPushError(f"weight push v{version} broke on the pushing rank after {attempts} attempt(s)")

    return agree_and_retry(attempt, version, group=group, max_attempts=max_attempts if make is not None else 1,
                           elsewhere=elsewhere)


def any_rank(flag: bool, group: Any) -> bool:
    """Whether `flag` holds on any rank of `group` (this rank's own flag without a group)."""
    if group is None or not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=group_device(group))  # NCCL takes no host tensor
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(value.item())


# ---- the worker's end (mixed into vLLM's worker by rollout.worker_ext) ----------------------------
class PushReceiver:
    """The four calls of the protocol inside vLLM's worker (its `model_runner`); state in `_mrl_*` attributes.

    1. `mrl_begin_push(version)` opens a push (weight_sync.streaming_load: ONE in-place reload on a thread of its
       own for the whole push, weight_sync.engine_reload);
    2. `mrl_stage_weights(bucket)` checks a bucket against the manifest (HF names and shapes of the checkpoint the
       engine loaded) and hands it to that reload; a transport's receiver calls it for every bucket it takes;
    3. `mrl_commit_push()` ends the reload, checks the push was complete, re-packs fused-MoE experts
       (engine_reload.repack_cpu_moe_experts) and records the version;
    4. `mrl_abort_push()`: a push broken midway leaves layers of two versions, so the worker reloads the model
       directory's weights (version 0, complete) before it answers.
    A transport's receiver that keeps state for a push (mapped buffers) ends it in `_mrl_push_ended`."""

    def _mrl_manifest(self) -> WeightManifest:
        manifest = self.__dict__.get("_mrl_manifest_cache")
        if manifest is None:
            manifest = manifest_from_checkpoint(self.model_runner.model_config.model)  # type: ignore[attr-defined]
            self.__dict__["_mrl_manifest_cache"] = manifest
        return manifest

    def _mrl_push_ended(self, broken: bool) -> None:
        """A push ended (committed, or broken: `broken`); the transports' receivers let go of what it held."""

    def mrl_weight_manifest(self) -> dict:
        """HF names, shapes and dtypes the model accepts (JSON-able)."""
        return self._mrl_manifest().to_json()

    def mrl_weight_version(self) -> int:
        return int(self.__dict__.get("_mrl_version", 0))

    def mrl_begin_push(self, version: int | str) -> None:
        self.mrl_abort_push()  # a push left open (its caller died) is ended first, restoring a complete version
        self.__dict__["_mrl_push"] = StreamingLoad(self.model_runner, self._mrl_manifest(), int(version))  # type: ignore[attr-defined]

    def mrl_abort_push(self) -> dict:
        """End an open push. If its loading had begun, go back to a complete version: the model directory's weights
        (version 0). Returns {'version': the version now served, 'restored': whether the weights were reloaded}."""
        push = self.__dict__.pop("_mrl_push", None)
        self._mrl_push_ended(push is not None)
        if push is None or not push.abort():
            return {"version": self.mrl_weight_version(), "restored": False}
        runner = self.model_runner  # type: ignore[attr-defined]
        reload_model_directory(runner)
        repack_cpu_moe_experts(runner.get_model())
        self.__dict__["_mrl_version"] = 0
        logger.warning("weight push v%d broken midway: the model directory's weights (version 0) were reloaded", push.version)
        return {"version": 0, "restored": True}

    def mrl_stage_weights(self, payload: list | bytes | str, handoff: bool = True) -> int:
        """Check one bucket and hand it to the loading (a list of (name, tensor), safetensors bytes, or base64 text);
        handoff=False: return once it is queued (weight_sync.streaming_load), not once its loading began.

        A bucket that does not fit the manifest ends the push (going back to a complete version) and raises."""
        push = self.__dict__.get("_mrl_push")
        if push is None:
            raise WeightPushError("mrl_stage_weights called without mrl_begin_push")
        if isinstance(payload, str):
            bucket = bucket_from_b64(payload)
        elif isinstance(payload, (bytes, bytearray, memoryview)):
            bucket = bucket_from_bytes(bytes(payload))
        else:
            bucket = list(payload)
        try:
            push.stage(bucket, handoff=handoff)
        except BaseException:
            self.mrl_abort_push()
            raise
        return len(bucket)

    def mrl_commit_push(self, repack_moe: bool | str = True) -> dict:
        """Finish loading the push (the reload ends once its last bucket is in), re-pack MoE experts, record the version."""
        push = self.__dict__.get("_mrl_push")
        if push is None:
            raise WeightPushError("mrl_commit_push called without mrl_begin_push")
        if isinstance(repack_moe, str):
            repack_moe = repack_moe.lower() not in ("0", "false", "no")
        try:
            push.finish()
        except BaseException:
            self.mrl_abort_push()
            raise
        self.__dict__.pop("_mrl_push", None)
        self._mrl_push_ended(False)
        runner = self.model_runner  # type: ignore[attr-defined]
        start = time.perf_counter()
        repacked = repack_cpu_moe_experts(runner.get_model()) if repack_moe else 0
        self.__dict__["_mrl_version"] = push.version
        self._mrl_committed(push.version)
        return {
            "version": push.version,
            "tensors": len(push.validator.seen),
            "bytes": push.validator.num_bytes,
            "load_s": push.load_seconds + time.perf_counter() - start,
            "repacked_moe_layers": repacked,
            "peak_staged_bytes": push.live.peak,
        }

    def _mrl_committed(self, version: int) -> None:
        """A push committed as `version`; a transport's receiver that keeps a copy of it (deltas) records it."""
