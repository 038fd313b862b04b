"""vLLM worker extension: weight pushes and routed-expert capture inside the engine.

vLLM mixes this class into its Worker (`worker_extension_cls=
"megatron_rl.rollout.worker_ext.RolloutWorkerExtension"`); its methods are
called with `collective_rpc("mrl_...")` from an in-process LLM, over ZMQ from
a multiprocess one, or as `POST /collective_rpc` on a server started with
VLLM_SERVER_DEV_MODE=1. Over HTTP every argument is a string, so the methods
accept strings where they take numbers and return JSON-able values or text.

Weight pushes: the class is made of every transport's worker part
(weight_sync.transports.receivers(): `mrl_broadcast_*` and `mrl_owner_*`,
`mrl_ipc_receive`, `mrl_set_version`), each in its transport's file beside the
trainer's end, over the protocol's own calls (weight_sync.push.PushReceiver:
`mrl_begin_push`, `mrl_stage_weights`, `mrl_commit_push`, `mrl_abort_push`,
the manifest and the version), where a push streams into the model as its
buckets arrive (weight_sync.streaming_load) and a broken one goes back to the
model directory's weights.

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
import logging
import multiprocessing
from functools import partial
from typing import Any

import numpy as np
import torch

from megatron_rl.heap import frozen_until_exit, keep_frozen_until_exit
from megatron_rl.rollout import cpu_rope
from megatron_rl.rollout.engine_env import watch_owner, watching_owner
from megatron_rl.rollout.engine_options import splits_fail_seeded_prefills
from megatron_rl.rollout.routing import RequestCapture, encode_captures
from megatron_rl.weight_sync.push import PushReceiver
from megatron_rl.weight_sync.transports import receivers

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


class RolloutWorkerExtension(*receivers(), PushReceiver):
    """Methods injected into vLLM's worker (see the module docstring): every transport's worker part, the push
    protocol's calls, and routed-expert capture. State lives in `_mrl_*` instance attributes."""

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
        (chunked prefill on where a split seeded prefill fails: rollout.engine_options.splits_fail_seeded_prefills),
        'owner_watched' (this worker ends itself and its core once the trainer that started them is gone:
        rollout.engine_env.watch_owner; the engine's first call starts the watch)}."""
        watch_owner()
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
            "owner_watched": watching_owner(),
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
