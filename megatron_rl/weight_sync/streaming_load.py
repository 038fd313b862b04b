"""One weight push loaded into a vLLM worker's model as its buckets arrive.

vLLM reloads weights in place with `model_runner.reload_weights(weights_iterator=...)`
(through weight_sync.engine_reload: tied names given, unloaded layers refused): its layerwise
reload keeps each layer's parts until the layer is complete, then processes
it (fused qkv_proj / gate_up_proj / w13_weight built from all their HF parts). The push arrives as separate calls (one per bucket), so the reload
runs on a thread of its own for the whole push and takes each bucket from
the call that stages it, hand to hand: `stage` returns once the reload has
loaded the bucket's first tensor and asked for the next, so the worker holds
the bucket being loaded, the one being handed over, and the parts of the
layer vLLM is completing, and when `stage` returns every earlier bucket the
reload no longer keeps parts of is free (its memory can be written again:
weight_sync.ipc). The caller's next bucket travels while this one loads.
`live` measures what is held by allocation accounting (every staged tensor
counts until it is freed).

Ending a push: `finish()` closes the iterator, waits for the reload and
raises its error if it had one; `abort()` closes it too (vLLM then finishes
the layers it has, so the model holds two versions) and says whether loading
had begun, in which case the caller must reload a complete version.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator

import torch

from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.engine_reload import reload_in_place
from megatron_rl.weight_sync.manifest import PushValidator, WeightManifest, WeightPushError
from megatron_rl.weight_sync.stream import LiveBytes

_END = object()
"""Queue marker: no more buckets."""

_POLL_S = 0.1


class StreamingLoad:
    """A push into one worker's model (see the module docstring)."""

    def __init__(self, runner: Any, manifest: WeightManifest, version: int):
        self.runner = runner
        self.version = int(version)
        self.validator = PushValidator(manifest)
        self.live = LiveBytes()
        self.load_seconds = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._taken = threading.Condition()
        self._counts = [0, 0]  # buckets staged, buckets whose first tensor the reload is past
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ended = False

    @property
    def started(self) -> bool:
        return self._thread is not None

    def stage(self, bucket: Bucket, handoff: bool = True) -> None:
        """Check a bucket against the manifest, then hand it to the reload; returns once the reload has loaded its
        first tensor (every earlier bucket is then loaded: what the reload no longer holds of it is free), or with
        handoff=False once it is queued behind the bucket loading (its memory is nobody's to free: the caller's
        next bucket then travels while both load)."""
        self.validator.check_bucket(bucket)
        if not bucket:
            return
        if self._thread is None:
            self._start()
        self._put([(name, self.live.track(tensor)) for name, tensor in bucket])
        self._counts[0] += 1
        if handoff:
            self._wait_taken(self._counts[0])

    def finish(self) -> None:
        """The push is complete: end the reload and wait for it; raises if the push or the reload failed."""
        self.validator.check_complete()
        if self._thread is None:  # a push of no buckets is refused by check_complete unless the model has none
            return
        self._end()
        if self._error is not None:
            raise WeightPushError(f"loading weight push v{self.version} failed: {type(self._error).__name__}: {self._error}") from self._error

    def abort(self) -> bool:
        """End the push; True when loading had begun (the model now mixes versions and must be reloaded)."""
        if self._thread is None:
            return False
        self._end()
        return True

    # ---- the reload thread -------------------------------------------------------------------------
    def _start(self) -> None:
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self._thread = threading.Thread(target=self._reload, args=(device,), name="mrl-weight-load", daemon=True)
        self._thread.start()

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            for index, pair in enumerate(item):
                yield pair
                if index == 0:  # the reload loaded the first tensor and asks for the next: the caller may go on
                    with self._taken:
                        self._counts[1] += 1
                        self._taken.notify_all()
            del item, pair  # drop this bucket's references before waiting for the next

    def _reload(self, device: int | None) -> None:
        start = time.perf_counter()
        try:
            if device is not None:  # the current CUDA device is per thread
                torch.cuda.set_device(device)
            reload_in_place(self.runner, self._tensors())
        except BaseException as error:  # noqa: BLE001 - reported by finish() or stage()
            self._error = error
        finally:
            self.load_seconds = time.perf_counter() - start

    def _put(self, item: Any) -> None:
        while True:
            if self._error is not None or not self._thread.is_alive():  # type: ignore[union-attr]
                error = self._error or RuntimeError("the reload thread ended early")
                raise WeightPushError(f"loading weight push v{self.version} failed: {type(error).__name__}: {error}") from error
            try:
                self._queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue

    def _wait_taken(self, count: int) -> None:
        while True:
            with self._taken:
                if self._taken.wait_for(lambda: self._counts[1] >= count, _POLL_S):
                    return
            if self._error is not None or not self._thread.is_alive():  # type: ignore[union-attr]
                error = self._error or RuntimeError("the reload thread ended early")
                raise WeightPushError(f"loading weight push v{self.version} failed: {type(error).__name__}: {error}") from error

    def _end(self) -> None:
        if self._ended or self._thread is None:
            return
        self._ended = True
        while self._thread.is_alive():
            try:
                self._queue.put(_END, timeout=_POLL_S)
                break
            except queue.Full:
                try:  # an aborted push: drop the bucket still waiting
                    self._queue.get_nowait()
                except queue.Empty:
                    pass
        self._thread.join()
