"""The weight-push protocol, one implementation for every engine placement.

An engine (in-process vLLM, its own process, colocated or remote servers)
describes each of its engines as a PushTarget: how to call a worker-extension
method on it (rollout.worker_ext), how to encode a bucket for an RPC, how to
reset its prefix cache. `stream_push` drives them all through one push:

1. check the push's announced names, shapes and dtypes against the engine's
   manifest (weight_sync.stream.check_announced): a refused push moves nothing;
2. `mrl_begin_push(version)` on every engine;
3. each bucket, as the export produces it, is checked against the
   announcement and sent to every engine at once (one broadcast into all
   their workers, a memory handle, or an RPC per engine), then dropped: the pushing rank holds
   about one bucket at a time (`peak_bytes`, measured);
4. `mrl_commit_push` on every engine, then their prefix caches are reset
   (cached KV was computed with the old weights).

If anything fails after step 2 (an engine died, a bucket broke the
announcement, the export failed) the rest of the export is drained (it is a
collective the other trainer ranks are still in), every engine still
answering aborts its push, which brings it back to a complete version (the
model directory's weights, rollout.worker_ext), and PushBrokenError says so:
the caller restarts dead engines and the trainer pushes again.

The engine's end every placement shares around this protocol (the weight
version, a broken push marked, lost weights) is weight_sync.engine_side.WeightSyncedEngine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from megatron_rl.weight_sync.broadcast import BroadcastSender, all_results, call_in_threads
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.manifest import WeightManifest, WeightPushError
from megatron_rl.weight_sync.stream import AnnouncedPush, LiveBytes, PushBrokenError, WeightStream, check_announced


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
