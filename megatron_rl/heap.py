"""Keeping Python's cyclic garbage collector off a process's long-lived heap.

A training or evaluation process holds hundreds of thousands of objects made by importing torch, megatron-core,
transformers and vLLM. They live until the process ends, yet every full collection scans them all, and a run makes
many (the interpreter's own while those packages import, and explicit ones: megatron's optimizer state dict, vLLM's
loader and start-up, Actor.close): 5.4 s of a 17 s one-process run of the tiny preset went to full collections.

* `import_long_lived` imports a process's long-lived packages with the collector paused, then freezes the heap
  (gc.freeze), so that later collections scan only what the run makes. trainer.run calls it where the run is its
  process's command, after its bad-input checks and once library warnings go to the run's log; done before vLLM
  starts, it makes vLLM's start-up collections cheap too (vLLM freezes the heap itself once its engine is up,
  vllm.utils.gc_utils.freeze_gc_heap).
* `process_ends_after_close` (the CLI's train and eval commands) says the process ends after its run's closes:
  `collect_after_close` then skips their collections, which the exit makes pointless; cli.finished freezes the
  heap again at the command's end.
* vLLM's engine shutdown (EngineCore.shutdown, Worker.shutdown) unfreezes the heap and collects it in full, so that
  an engine deleted in a process that goes on can be freed. Where the process ends next, the heap stays frozen
  through it: `heap_kept_frozen` around an in-process engine's last shutdown, `keep_frozen_until_exit` in vLLM's own
  engine-core and worker processes on the CPU, which end after their shutdown.
"""

from __future__ import annotations

import gc
import importlib
from contextlib import contextmanager
from typing import Iterator

TRAINER_PACKAGES = (
    "torch",
    "transformers",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.dist_checkpointing",
    "megatron.core.pipeline_parallel",
)
"""What every rank of `megatron-rl train` imports (rank 0 adds vLLM when it hosts an engine: rollout.vllm_engine).
trainer.run imports them first where the run is its process's command, once the run's warnings go to its log."""


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside (explicit gc.collect calls still run); the collector's state after as before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def import_long_lived(*modules: str) -> None:
    """Import `modules` with the collector paused, then freeze every object alive now.

    For a process's start-up, where what is alive (modules, their classes and functions, the model and engine
    built so far) lives until the process ends or its owner's close frees its storage. A module that does not
    import is left to the place that imports it to report (its extra, its version): this only loads early.
    Garbage made before is collected first rather than frozen (cheap where the heap was frozen before)."""
    gc.collect()
    with collector_paused():
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError:
                break
        gc.freeze()  # before the collector resumes: else its first young collection scans every imported object


def process_ends_after_close() -> None:
    """Say that this process ends once its run's objects are closed (the CLI's train and eval commands)."""
    global _ENDS_AFTER_CLOSE
    _ENDS_AFTER_CLOSE = True


def ends_after_close() -> bool:
    """Whether process_ends_after_close was said in this process."""
    return _ENDS_AFTER_CLOSE


@contextmanager
def heap_kept_frozen() -> Iterator[None]:
    """Inside, gc.unfreeze() leaves the heap frozen where this process ends after its closes (process_ends_after_close);
    elsewhere nothing changes (an engine closed in a process that goes on must be collectable)."""
    if not _ENDS_AFTER_CLOSE:
        yield
        return
    unfreeze = gc.unfreeze
    gc.unfreeze = _stay_frozen
    try:
        yield
    finally:
        gc.unfreeze = unfreeze


def keep_frozen_until_exit() -> None:
    """gc.unfreeze() leaves the heap frozen from now to the process's end: for a process that ends after its shutdown."""
    gc.unfreeze = _stay_frozen


def frozen_until_exit() -> bool:
    """Whether gc.unfreeze() is held off in this process now (keep_frozen_until_exit, or inside heap_kept_frozen)."""
    return gc.unfreeze is _stay_frozen


def _stay_frozen() -> None:
    """gc.unfreeze while the heap is kept frozen: nothing to do, the process ends next."""


def collect_after_close() -> None:
    """gc.collect(): free the Python objects a close dropped (their storage is freed by the close itself).

    Skipped where the process ends after its closes (process_ends_after_close): the exit frees everything, and a
    full collection there would scan the whole heap that vLLM's shutdown unfroze."""
    if not _ENDS_AFTER_CLOSE:
        gc.collect()


_ENDS_AFTER_CLOSE = False
