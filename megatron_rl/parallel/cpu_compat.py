"""Make megatron-core 0.16.1 run on a CPU-only torch build (gloo backend).

megatron-core hard-codes CUDA in a few dozen places: the RNG tracker uses the
CUDA generator, buffers are allocated on ``torch.cuda.current_device()``, the
alltoall dispatcher creates CUDA streams, optimizers check
``param.type() == 'torch.cuda.FloatTensor'``, and so on. Every site that fails
on a CPU build is listed in ``shared/notes/megatron-core-on-cpu.md``; each gets
one patch below, described by a :class:`PatchSite` that names the megatron-core
module, the object, the 0.16.1 line numbers and the source expression the patch
relies on.

Patch kinds, narrowest first:

* ``function``/``method``: one megatron function or method replaced or wrapped.
* ``cuda-shim``: the module's global name ``torch`` is rebound to a copy of the
  torch module whose ``torch.cuda`` is a CPU stand-in (``current_device()`` ->
  ``cpu``, ``synchronize()`` -> no-op, ``Stream``/``Event`` -> no-op objects,
  RNG calls -> the CPU generator) and whose tensor factories map ``device="cuda"``
  to the CPU. Only code *in that module* sees it: no global mode, no cost for
  anything else (a ``TorchFunctionMode`` doing the same doubles forward time).
* ``tensor-cuda``/``tensor-type``: ``Tensor.cuda``/``Tensor.type`` wrapped so
  that only *callers inside the listed megatron modules* see CPU-friendly
  behaviour (``.cuda()`` is a no-op, ``.type()`` reports
  ``torch.cuda.*Tensor``); any other caller gets torch's own method. (On a
  CPU-only build ``.cuda()`` can only raise, so nothing that worked changes.)

:func:`apply_cpu_compat` applies everything once (idempotent) and only when
CUDA is absent. :func:`check_patch_targets` verifies that every target still
exists and still contains the expression its patch relies on, raising
:class:`PatchTargetError` naming the site otherwise (run by
tests/unit/test_cpu_compat.py, so a megatron-core upgrade that moves a site
fails loudly instead of silently running unpatched code).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

TESTED_MEGATRON_VERSION = "0.16.1"
_PATCH_MARK = "__megatron_rl_cpu_compat__"


class PatchTargetError(RuntimeError):
    """A megatron-core object that the CPU compatibility layer patches is missing or changed."""


@dataclass(frozen=True, kw_only=True)
class PatchSite:
    """One megatron-core location the CPU layer patches."""

    name: str
    """Short identifier of the patch."""
    module: str
    """Dotted megatron-core module."""
    target: str
    """Attribute path inside the module ('' = the module itself, for cuda-shim patches)."""
    lines: tuple[int, ...]
    """Line numbers of the failing code in megatron-core 0.16.1 (documentation)."""
    expects: tuple[str, ...]
    """Source fragments the patch relies on; the check fails when one is gone."""
    kind: str
    """function | method | attribute (replaced/bound in place) | cuda-shim (module-local torch.cuda
    stand-in) | tensor-cuda / tensor-type (Tensor.cuda()/Tensor.type() as seen by this module)."""
    why: str
    """What fails on CPU and what the patch does."""
    optional: bool = False
    """The module may be absent or fail to import (inference/resharding extras): skip, don't fail."""

    def describe(self) -> str:
        where = f"{self.module}:{self.target}" if self.target else self.module
        lines = ",".join(map(str, self.lines))
        return f"[{self.name}] {where} (megatron-core {TESTED_MEGATRON_VERSION} line {lines})"


_MC = "megatron.core."
_CUR = "torch.cuda.current_device()"

SITES: tuple[PatchSite, ...] = (
    # 1. RNG tracker --------------------------------------------------------------------------
    PatchSite(
        name="rng-get-state",
        module=_MC + "tensor_parallel.random",
        target="_get_cuda_rng_state",
        lines=(41, 55),
        expects=("torch.cuda.random.get_rng_state",),
        kind="function",
        why="reads the CUDA generator; replaced by torch.get_rng_state() (the CPU generator)",
    ),
    PatchSite(
        name="rng-set-state",
        module=_MC + "tensor_parallel.random",
        target="_set_cuda_rng_state",
        lines=(72, 84),
        expects=("_cuda_setRNGState",),
        kind="function",
        why="writes the CUDA generator; replaced by torch.set_rng_state()",
    ),
    PatchSite(
        name="rng-tracker-add",
        module=_MC + "tensor_parallel.random",
        target="CudaRNGStatesTracker.add",
        lines=(217, 235, 237, 238),
        expects=("torch.cuda.get_rng_state()", "torch.cuda.manual_seed(seed)"),
        kind="cuda-shim",
        why="seeds a named state through the CUDA generator; through the random module's cuda shim "
        "torch.cuda.get_rng_state/manual_seed are the CPU generator's, so the method runs unchanged",
    ),
    PatchSite(
        name="rng-tracker-fork",
        module=_MC + "tensor_parallel.random",
        target="CudaRNGStatesTracker.fork",
        lines=(242, 250, 264),
        expects=("_get_cuda_rng_state(", "CPU RNG state changed within GPU RNG context"),
        kind="method",
        why="swaps the CUDA generator state and warns whenever the CPU state changed inside; "
        "replaced by a swap of the CPU generator state (no warning: that *is* the generator now)",
    ),
    PatchSite(
        name="rng-manual-seed",
        module=_MC + "tensor_parallel.random",
        target="",
        lines=(422,),
        expects=("torch.cuda.manual_seed(data_parallel_seed)",),
        kind="cuda-shim",
        why="model_parallel_cuda_manual_seed seeds the default CUDA generator; the shim seeds the CPU one",
    ),
    # 2. alltoall token dispatcher ---------------------------------------------------------------
    PatchSite(
        name="dispatcher-streams",
        module=_MC + "transformer.moe.token_dispatcher",
        target="",
        lines=(445, 871, 873, 874, 895, 898),
        expects=("torch.cuda.Stream()", "torch.cuda.current_stream()", "torch.cuda.stream("),
        kind="cuda-shim",
        why="MoEAlltoAllTokenDispatcher creates a CUDA side stream and syncs on it; the shim's "
        "Stream/current_stream/stream/record_event are no-ops on one shared CPU stream",
    ),
    PatchSite(
        name="dispatcher-dtoh",
        module=_MC + "transformer.moe.token_dispatcher",
        target="maybe_move_tensor_to_cpu",
        lines=(876, 879, 882, 885),
        expects=("tensor.is_cuda", "as_numpy"),
        kind="function",
        why="moe_utils.maybe_move_tensor_to_cpu converts the split sizes to numpy only for CUDA tensors; "
        "on CPU they stayed tensors. The dispatcher's binding is replaced by one that always converts",
    ),
    # 3. hard-coded torch.cuda.current_device()/synchronize()/Stream ---------------------------
    PatchSite(
        name="rope-device",
        module=_MC + "models.common.embeddings.rotary_pos_embedding",
        target="",
        lines=(162,),
        expects=(_CUR,),
        kind="cuda-shim",
        why="RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device()",
    ),
    PatchSite(
        name="router-device",
        module=_MC + "transformer.moe.router",
        target="",
        lines=(90, 92),
        expects=(_CUR,),
        kind="cuda-shim",
        why="TopKRouter.gating moves CPU weights to torch.cuda.current_device() every call",
    ),
    PatchSite(
        name="mappings-device",
        module=_MC + "tensor_parallel.mappings",
        target="",
        lines=(91, 141, 148, 181, 442),
        expects=(_CUR,),
        kind="cuda-shim",
        why="gather/reduce-scatter/all-to-all outputs are allocated on torch.cuda.current_device()",
    ),
    PatchSite(
        name="layers-device",
        module=_MC + "tensor_parallel.layers",
        target="",
        lines=(261, 552, 597, 607, 873, 899, 1197, 1218),
        expects=(_CUR,),
        kind="cuda-shim",
        why="sequence-parallel all-gather buffers and GPU init allocate on torch.cuda.current_device()",
    ),
    PatchSite(
        name="tp-utils-device",
        module=_MC + "tensor_parallel.utils",
        target="",
        lines=(70, 91),
        expects=(_CUR,),
        kind="cuda-shim",
        why="split/gather helpers allocate on torch.cuda.current_device()",
    ),
    PatchSite(
        name="p2p-device",
        module=_MC + "pipeline_parallel.p2p_communication",
        target="",
        lines=(190, 313, 321, 242, 398),
        expects=(_CUR, "torch.cuda.synchronize()"),
        kind="cuda-shim",
        why="pipeline receive buffers on torch.cuda.current_device(); torch.cuda.synchronize() after p2p",
    ),
    PatchSite(
        name="utils-device",
        module=_MC + "utils",
        target="",
        lines=(631, 656, 1207, 1347),
        expects=(_CUR, 'device="cuda"'),
        kind="cuda-shim",
        why="GlobalMemoryBuffer allocates on torch.cuda.current_device(); norm helpers use device='cuda'",
    ),
    PatchSite(
        name="grad-buffer-device",
        module=_MC + "distributed.param_and_grad_buffer",
        target="",
        lines=(417, 422, 768, 783, 800, 806),
        expects=(_CUR,),
        kind="cuda-shim",
        why="DDP param/grad buffers are allocated on torch.cuda.current_device()",
    ),
    PatchSite(
        name="ddp-stream",
        module=_MC + "distributed.distributed_data_parallel",
        target="",
        lines=(230, 588, 611),
        expects=("torch.cuda.synchronize()",),
        kind="cuda-shim",
        why="DDP creates a CUDA communication stream and synchronizes",
    ),
    PatchSite(
        name="experts-device",
        module=_MC + "transformer.moe.experts",
        target="",
        lines=(184, 192),
        expects=(_CUR,),
        kind="cuda-shim",
        why="GroupedMLP weights allocated on torch.cuda.current_device() (non-CPU init)",
    ),
    PatchSite(
        name="shared-experts-stream",
        module=_MC + "transformer.moe.shared_experts",
        target="",
        lines=(123, 162, 163, 277),
        expects=("torch.cuda.Stream()",),
        kind="cuda-shim",
        why="overlapped shared experts run on a CUDA side stream",
    ),
    PatchSite(
        name="moe-utils-stream",
        module=_MC + "transformer.moe.moe_utils",
        target="",
        lines=(998, 1098),
        expects=('device="cuda"',),
        kind="cuda-shim",
        why="device='cuda' tensor factories and torch.cuda.current_stream() in MoE helpers",
    ),
    PatchSite(
        name="layer-device",
        module=_MC + "transformer.transformer_layer",
        target="",
        lines=(936, 1147),
        expects=(_CUR,),
        kind="cuda-shim",
        why="TransformerLayer moves tensors to torch.cuda.current_device()",
    ),
    PatchSite(
        name="module-device",
        module=_MC + "transformer.module",
        target="",
        lines=(249,),
        expects=(_CUR,),
        kind="cuda-shim",
        why="MegatronModule buffers on torch.cuda.current_device()",
    ),
    PatchSite(
        name="gpt-device",
        module=_MC + "models.gpt.gpt_model",
        target="",
        lines=(415,),
        expects=(_CUR,),
        kind="cuda-shim",
        why="GPTModel allocates on torch.cuda.current_device()",
    ),
    PatchSite(
        name="ckpt-saver-device",
        module=_MC + "dist_checkpointing.strategies.state_dict_saver",
        target="",
        lines=(204, 252),
        expects=(_CUR,),
        kind="cuda-shim",
        why="dist_checkpointing.save all-reduces a failure flag on torch.cuda.current_device()",
    ),
    PatchSite(
        name="ckpt-sync",
        module=_MC + "dist_checkpointing.strategies.fully_parallel",
        target="",
        lines=(272, 281),
        expects=("torch.cuda.synchronize()",),
        kind="cuda-shim",
        why="fully parallel save/load strategies call torch.cuda.synchronize()",
    ),
    PatchSite(
        name="ckpt-fs-sync",
        module=_MC + "dist_checkpointing.strategies.filesystem_async",
        target="",
        lines=(230,),
        expects=("torch.cuda.synchronize()",),
        kind="cuda-shim",
        why="async filesystem writer calls torch.cuda.synchronize()",
    ),
    PatchSite(
        name="ckpt-async-device",
        module=_MC + "dist_checkpointing.strategies.async_utils",
        target="",
        lines=(165, 212, 604),
        expects=(_CUR,),
        kind="cuda-shim",
        why="async checkpoint queue all-reduces on torch.cuda.current_device()",
    ),
    PatchSite(
        name="rerun-device",
        module=_MC + "rerun_state_machine",
        target="",
        lines=(261, 525, 567, 957, 970),
        expects=(_CUR,),
        kind="cuda-shim",
        why="rerun state machine uses the CUDA device and RNG state",
    ),
    # 5. literal device="cuda" ------------------------------------------------------------------
    PatchSite(
        name="schedules-device",
        module=_MC + "pipeline_parallel.schedules",
        target="",
        lines=(596, 983, 2138),
        expects=('device="cuda"',),
        kind="cuda-shim",
        why="forward_backward_* count tokens in torch.zeros(..., device='cuda')",
    ),
    PatchSite(
        name="optimizer-device",
        module=_MC + "optimizer.optimizer",
        target="",
        lines=(473, 481, 485, 907, 1141),
        expects=("device='cuda'",),
        kind="cuda-shim",
        why="optimizer overflow/scale buffers are created with device='cuda'",
    ),
    PatchSite(
        name="clip-grads-device",
        module=_MC + "optimizer.clip_grads",
        target="",
        lines=(90, 103, 115, 174, 207),
        expects=("device='cuda'",),
        kind="cuda-shim",
        why="grad-norm and clipping buffers are created with device='cuda'",
    ),
    PatchSite(
        name="distopt-device",
        module=_MC + "optimizer.distrib_optimizer",
        target="",
        lines=(791, 1077),
        expects=(_CUR,),
        kind="cuda-shim",
        why="distributed optimizer buffers on torch.cuda.current_device()",
    ),
    PatchSite(
        name="causal-mask-device",
        module=_MC + "transformer.utils",
        target="",
        lines=(35, 40),
        expects=('device="cuda"',),
        kind="cuda-shim",
        why="get_default_causal_mask builds the mask with device='cuda'",
    ),
    # 4. te_general_gemm NameError without Transformer Engine ------------------------------------
    PatchSite(
        name="te-general-gemm",
        module=_MC + "transformer.moe.moe_utils",
        target="te_general_gemm",
        lines=(1192, 1225),
        expects=("te_general_gemm is not None",),
        kind="attribute",
        why="RouterGatingLinearFunction reads te_general_gemm, bound only when TE imports (NameError); bound to None",
    ),
    # 6. torch norms with sequence parallel ------------------------------------------------------
    PatchSite(
        name="norm-sequence-parallel",
        module=_MC + "transformer.torch_norm",
        target="WrappedTorchNorm.__new__",
        lines=(32,),
        expects=("assert not config.sequence_parallel",),
        kind="method",
        why="the torch norm (used without apex/TE) refuses sequence_parallel, which MoE with TP>1 "
        "requires (moe_layer.py:379); the patch builds it and marks its parameters sequence_parallel "
        "so finalize_model_grads all-reduces their grads over TP, as TE's norms do",
    ),
    # 7. uneven list all_gather/reduce_scatter on gloo -------------------------------------------
    PatchSite(
        name="uneven-all-gather",
        module=_MC + "tensor_parallel.mappings",
        target="_gather_along_first_dim",
        lines=(150,),
        expects=("torch.distributed.all_gather(output_tensor_list",),
        kind="function",
        why="gloo's list all_gather rejects uneven sizes ('invalid tensor size'); emulated by "
        "padding + all_gather_into_tensor when output_split_sizes is given",
    ),
    PatchSite(
        name="uneven-reduce-scatter",
        module=_MC + "tensor_parallel.mappings",
        target="_reduce_scatter_along_first_dim",
        lines=(193,),
        expects=("torch.distributed.reduce_scatter(output, input_tensor_list",),
        kind="function",
        why="gloo has no list reduce_scatter for uneven sizes; emulated by all_reduce + slice",
    ),
    # 8./9. cuda tensor-type checks ------------------------------------------------------------
    PatchSite(
        name="clip-grads-type",
        module=_MC + "optimizer.clip_grads",
        target="clip_grad_by_total_norm_fp32",
        lines=(167,),
        expects=("param.grad.type() == 'torch.cuda.FloatTensor'",),
        kind="tensor-type",
        why="asserts grads are torch.cuda.FloatTensor; Tensor.type() reports the cuda type name to this module",
    ),
    PatchSite(
        name="optimizer-type",
        module=_MC + "optimizer.optimizer",
        target="Float16OptimizerWithFloat16Params.__init__",
        lines=(671, 690),
        expects=("param.type() == 'torch.cuda.FloatTensor'",),
        kind="tensor-type",
        why="accepts only cuda tensor types; Tensor.type() reports the cuda type name to this module",
    ),
    PatchSite(
        name="distopt-type",
        module=_MC + "optimizer.distrib_optimizer",
        target="DistributedOptimizer._build_model_and_main_param_groups",
        lines=(361, 420, 582),
        expects=("model_param.type() == 'torch.cuda.FloatTensor'",),
        kind="tensor-type",
        why="accepts only cuda tensor types; Tensor.type() reports the cuda type name to this module",
    ),
    PatchSite(
        name="distopt-torch-adam-step",
        module=_MC + "optimizer.distrib_optimizer",
        target="DistributedOptimizer._set_main_param_and_optimizer_states",
        lines=(938, 2101),
        expects=("dst_tensors[key].copy_(tensors[key])",),
        kind="method",
        why=(
            "without TE/apex the inner optimizer is torch's Adam, whose per-parameter state holds 'step'; "
            "loading a fully_reshardable checkpoint skips 'step' in the source (it is restored from the "
            "param groups) but copies every destination key, so it raises KeyError('step'); the patch "
            "leaves 'step' as load_state_dict already set it"
        ),
    ),
    # Tensor.cuda() ----------------------------------------------------------------------------
    PatchSite(
        name="tensor-cuda-language-module",
        module=_MC + "models.common.language_module.language_module",
        target="LanguageModule.setup_embeddings_and_output_layer",
        lines=(244,),
        expects=("weight.data = weight.data.cuda()",),
        kind="tensor-cuda",
        why="PP>1 with tied embeddings moves the word embedding with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-optimizer",
        module=_MC + "optimizer.optimizer",
        target="MegatronOptimizer",
        lines=(375, 380),
        expects=("p.data.cuda()",),
        kind="tensor-cuda",
        why="optimizer state reload moves tensors with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-distopt",
        module=_MC + "optimizer.distrib_optimizer",
        target="DistributedOptimizer",
        lines=(1089,),
        expects=("send_tensor.cuda()",),
        kind="tensor-cuda",
        why="distributed optimizer state gather moves buffers with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-exchange",
        module=_MC + "dist_checkpointing.exchange_utils",
        target="",
        lines=(336, 499),
        expects=("all_loaded_tensors[shard_id].cuda()", "local_ten = all_loaded_tensors[shard_id].cuda()"),
        kind="tensor-cuda",
        why="checkpoint load exchange moves tensors with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-utils",
        module=_MC + "utils",
        target="check_param_hashes_across_dp_replicas",
        lines=(898,),
        expects=("torch.stack(local_param_hashes).cuda()",),
        kind="tensor-cuda",
        why="parameter-hash check moves hashes with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-data",
        module=_MC + "tensor_parallel.data",
        target="broadcast_data",
        lines=(84,),
        expects=("data[key].cuda()",),
        kind="tensor-cuda",
        why="broadcast_data moves the batch with .cuda(); a no-op for this module",
    ),
    # 10./11. inference and resharding (optional modules) -------------------------------------
    PatchSite(
        name="static-inference-events",
        module=_MC + "inference.text_generation_controllers.text_generation_controller",
        target="",
        lines=(75, 100, 1163, 1337),
        expects=("torch.cuda.Event(",),
        kind="cuda-shim",
        why="legacy static inference times steps with torch.cuda.Event; the shim's Event uses perf_counter",
        optional=True,
    ),
    PatchSite(
        name="gloo-copy-stream",
        module=_MC + "resharding.copy_services.gloo_copy_service",
        target="",
        lines=(46, 146),
        expects=("torch.cuda.Stream()",),
        kind="cuda-shim",
        why="swap_model_weights over gloo creates/uses a CUDA stream",
        optional=True,
    ),
)

# Modules whose calls to Tensor.cuda() / Tensor.type() get the CPU-friendly behaviour.
_TENSOR_CUDA_MODULES = frozenset(s.module for s in SITES if s.kind == "tensor-cuda")
_TENSOR_TYPE_MODULES = frozenset(s.module for s in SITES if s.kind == "tensor-type")


# ---------------------------------------------------------------------------------------------
# The torch.cuda stand-in seen by shimmed modules.


class _CpuStream:
    """A no-op stand-in for torch.cuda.Stream: every call runs on the CPU in program order."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> "_CpuEvent":
        ev = event if event is not None else _CpuEvent()
        ev.record()
        return ev

    def __enter__(self) -> "_CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_CPU_STREAM = _CpuStream()


class _CpuEvent:
    """A stand-in for torch.cuda.Event timing with time.perf_counter."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return ((end._t or 0.0) - (self._t or 0.0)) * 1000.0


class _NoNvtx:
    @staticmethod
    def range_push(*a: Any, **k: Any) -> None:
        pass

    @staticmethod
    def range_pop(*a: Any, **k: Any) -> None:
        pass

    @staticmethod
    @contextlib.contextmanager
    def range(*a: Any, **k: Any):
        yield


class _CudaShim(types.ModuleType):
    """``torch.cuda`` as seen by a shimmed megatron module on a CPU-only build."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.__dict__.update(
            current_device=lambda: torch.device("cpu"),
            synchronize=lambda device=None: None,
            set_device=lambda device: None,
            Stream=lambda *a, **k: _CPU_STREAM,
            current_stream=lambda device=None: _CPU_STREAM,
            default_stream=lambda device=None: _CPU_STREAM,
            stream=lambda s=None: contextlib.nullcontext(),
            Event=_CpuEvent,
            nvtx=_NoNvtx,
            get_rng_state=lambda device="cuda": torch.get_rng_state(),
            set_rng_state=lambda state, device="cuda": torch.set_rng_state(state),
            manual_seed=lambda seed: torch.manual_seed(seed),
            manual_seed_all=lambda seed: torch.manual_seed(seed),
            empty_cache=lambda: None,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "eye", "linspace",
)  # fmt: skip


def _cpu_device(device: Any) -> Any:
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a CUDA ordinal
    return device


def _factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


def _make_torch_shim() -> types.ModuleType:
    shim = types.ModuleType("torch")
    shim.__dict__.update(torch.__dict__)
    shim.__dict__["cuda"] = _CudaShim()
    for name in _FACTORIES:
        shim.__dict__[name] = _factory(getattr(torch, name))
    shim.__dict__["__getattr__"] = lambda name: getattr(torch, name)  # lazily-loaded torch attributes
    shim.__dict__[_PATCH_MARK] = True
    return shim


# ---------------------------------------------------------------------------------------------
# Replacements.


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    if isinstance(new_state, torch.Generator):
        new_state = new_state.get_state()
    torch.set_rng_state(new_state)


@contextlib.contextmanager
def _cpu_tracker_fork(self: Any, name: str = "model-parallel-rng"):
    """CudaRNGStatesTracker.fork on the CPU generator (same bookkeeping as 0.16.1 random.py:242)."""
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    orig_state = torch.get_rng_state()
    orig_name = self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(f"current state name {self._current_state_name} is not the same as the desired state name {name}.")
        self.states_[name] = torch.get_rng_state()
        if orig_name != "default-rng":
            orig_state = self.states_[orig_name]
        torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


def _cpu_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """moe_utils.maybe_move_tensor_to_cpu, also converting CPU tensors to numpy when asked."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            return tensor.numpy()
    return tensor


def _wrap_norm_new(orig_new: Callable) -> Callable:
    def __new__(cls: Any, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        if sequence_parallel:
            config = copy.copy(config)  # shallow: no __post_init__ re-validation
            config.sequence_parallel = False
        norm = orig_new(cls, config, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", sequence_parallel)
        return norm

    return __new__


def _wrap_gather(orig: Callable) -> Callable:
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group is None or group.size() == 1:
            return orig(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        longest = max(sizes)
        inp = input_.contiguous()
        if inp.shape[0] < longest:
            pad = inp.new_zeros((longest - inp.shape[0],) + tuple(inp.shape[1:]))
            inp = torch.cat([inp, pad], dim=0)
        gathered = inp.new_empty((longest * len(sizes),) + tuple(inp.shape[1:]))
        torch.distributed.all_gather_into_tensor(gathered, inp, group=group)
        return torch.cat([gathered[i * longest : i * longest + s] for i, s in enumerate(sizes)], dim=0)

    return _gather_along_first_dim


def _wrap_reduce_scatter(orig: Callable) -> Callable:
    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group is None or group.size() == 1:
            return orig(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(s) for s in input_split_sizes]
        rank = group.rank()
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[:rank])
        return total[start : start + sizes[rank]].clone()

    return _reduce_scatter_along_first_dim


_ORIG_TENSOR_CUDA = torch.Tensor.cuda
_ORIG_TENSOR_TYPE = torch.Tensor.type


def _caller_in(modules: frozenset[str]) -> bool:
    """Whether the caller of the Tensor method (two frames up) is one of ``modules``."""
    return sys._getframe(2).f_globals.get("__name__") in modules


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Tensor.cuda: a no-op when called from a listed megatron module on a CPU-only build."""
    if _caller_in(_TENSOR_CUDA_MODULES):
        return self
    return _ORIG_TENSOR_CUDA(self, *args, **kwargs)


def _tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Tensor.type: reports 'torch.cuda.FloatTensor' etc. for CPU tensors to listed megatron modules."""
    result = _ORIG_TENSOR_TYPE(self, *args, **kwargs)
    if not args and not kwargs and isinstance(result, str) and result.startswith("torch.") and not self.is_cuda:
        if _caller_in(_TENSOR_TYPE_MODULES):
            return "torch.cuda." + result[len("torch.") :]
    return result


setattr(_tensor_cuda, _PATCH_MARK, True)
setattr(_tensor_type, _PATCH_MARK, True)

# ---------------------------------------------------------------------------------------------
# Resolution, checking and application.

_LOCK = threading.Lock()
_APPLIED = False
_ORIGINALS: dict[tuple[str, str], Any] = {}


def _import(site: PatchSite) -> types.ModuleType | None:
    try:
        return importlib.import_module(site.module)
    except Exception as exc:  # noqa: BLE001 - optional extras fail in many ways
        if site.optional:
            return None
        raise PatchTargetError(f"{site.describe()}: cannot import {site.module}: {exc!r}") from exc


def _resolve(module: types.ModuleType, target: str) -> tuple[Any, str, Any]:
    """Return (owner, attribute name, current value) for a dotted target."""
    owner: Any = module
    parts = target.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    if parts[-1] not in vars(owner) and not hasattr(owner, parts[-1]):
        raise AttributeError(parts[-1])
    return owner, parts[-1], getattr(owner, parts[-1])


def _source_of(site: PatchSite, module: types.ModuleType) -> str:
    original = _ORIGINALS.get((site.module, site.target))
    if site.kind == "cuda-shim" or site.kind == "attribute" or not site.target:
        return inspect.getsource(module)
    obj = original if original is not None else _resolve(module, site.target)[2]
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    try:
        return inspect.getsource(obj)
    except (TypeError, OSError):
        return inspect.getsource(module)


def check_patch_targets(sites: tuple[PatchSite, ...] | list[PatchSite] | None = None) -> list[str]:
    """Verify every patched megatron-core target exists and still looks as the patch expects.

    Raises PatchTargetError naming the site (module:object, 0.16.1 line) when an
    upgrade removed, renamed or rewrote it. Returns the descriptions of the
    sites checked (optional modules that are absent are skipped). Works whether
    or not the patches are applied: applied patches are checked against the
    originals they replaced.
    """
    checked = []
    for site in SITES if sites is None else sites:
        module = _import(site)
        if module is None:
            continue
        if site.target and site.kind != "attribute":
            try:
                _resolve(module, site.target)
            except AttributeError as exc:
                raise PatchTargetError(
                    f"{site.describe()}: {site.target!r} no longer exists in {site.module} "
                    f"(megatron-core {_megatron_version()}); the CPU patch '{site.name}' must be updated"
                ) from exc
        if site.kind == "cuda-shim" and "torch" not in vars(module):
            raise PatchTargetError(f"{site.describe()}: module no longer binds the global name 'torch'")
        source = _source_of(site, module)
        for fragment in site.expects:
            if fragment not in source:
                raise PatchTargetError(
                    f"{site.describe()}: expected source {fragment!r} not found in "
                    f"{site.module}{':' + site.target if site.target else ''} "
                    f"(megatron-core {_megatron_version()}); the site moved or changed: review patch '{site.name}'"
                )
        checked.append(site.describe())
    return checked


def _megatron_version() -> str:
    try:
        from megatron.core.package_info import __version__

        return __version__
    except Exception:  # noqa: BLE001
        return "unknown"


def cuda_absent() -> bool:
    """True when this process must run megatron-core on the CPU."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    return _APPLIED


def _replace(site: PatchSite, owner: Any, attr: str, new: Any) -> None:
    """setattr(owner, attr, new), remembering the original for check_patch_targets."""
    _ORIGINALS.setdefault((site.module, site.target), getattr(owner, attr, None))
    try:
        setattr(new, _PATCH_MARK, True)
    except (AttributeError, TypeError):
        pass
    setattr(owner, attr, new)


def apply_cpu_compat(force: bool = False) -> bool:
    """Apply every CPU patch once. No-op (returns False) when CUDA is present, unless force=True.

    Checks all targets first (check_patch_targets), so a moved site fails here,
    before anything is half-patched.
    """
    global _APPLIED
    if not force and not cuda_absent():
        return False
    with _LOCK:
        if _APPLIED:
            return True
        check_patch_targets()
        shim = _make_torch_shim()
        shimmed: set[str] = set()
        for site in SITES:
            module = _import(site)
            if module is None:
                continue
            if site.kind == "cuda-shim":
                if site.module not in shimmed:
                    _ORIGINALS.setdefault((site.module, ""), module.torch)
                    module.torch = shim
                    shimmed.add(site.module)
            elif site.name in _REPLACERS:
                _REPLACERS[site.name](site, module)
        if not getattr(torch.Tensor.cuda, _PATCH_MARK, False):
            torch.Tensor.cuda = _tensor_cuda
        if not getattr(torch.Tensor.type, _PATCH_MARK, False):
            torch.Tensor.type = _tensor_type
        _APPLIED = True
        return True


def _patch_attr(site: PatchSite, module: types.ModuleType, new_from_old: Callable[[Any], Any]) -> None:
    owner, attr, old = _resolve(module, site.target)
    if getattr(old, _PATCH_MARK, False):
        return
    if isinstance(owner, type):
        old = vars(owner).get(attr, old)
        if isinstance(old, staticmethod):
            old = old.__func__
    _replace(site, owner, attr, new_from_old(old))


def _set_none_if_missing(site: PatchSite, module: types.ModuleType) -> None:
    if site.target not in vars(module):
        _ORIGINALS.setdefault((site.module, site.target), None)
        setattr(module, site.target, None)


def _norm_patch(site: PatchSite, module: types.ModuleType) -> None:
    cls = module.WrappedTorchNorm
    old = vars(cls)["__new__"]
    old = old.__func__ if isinstance(old, staticmethod) else old
    if getattr(old, _PATCH_MARK, False):
        return
    _ORIGINALS.setdefault((site.module, site.target), old)
    new = _wrap_norm_new(old)
    setattr(new, _PATCH_MARK, True)
    cls.__new__ = new


def _keep_adam_step(old: Callable) -> Callable:
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return old(self, model_param, tensors)

    return set_main_param_and_optimizer_states


_REPLACERS: dict[str, Callable[[PatchSite, types.ModuleType], None]] = {
    "rng-get-state": lambda s, m: _patch_attr(s, m, lambda old: _cpu_get_rng_state),
    "rng-set-state": lambda s, m: _patch_attr(s, m, lambda old: _cpu_set_rng_state),
    # tracker.add works unchanged through the random module's cuda shim (rng-manual-seed):
    # torch.cuda.get_rng_state/manual_seed there are the CPU generator's.
    "rng-tracker-fork": lambda s, m: _patch_attr(s, m, lambda old: _cpu_tracker_fork),
    "dispatcher-dtoh": lambda s, m: _patch_attr(s, m, lambda old: _cpu_move_tensor_to_cpu),
    "te-general-gemm": _set_none_if_missing,
    "norm-sequence-parallel": _norm_patch,
    "uneven-all-gather": lambda s, m: _patch_attr(s, m, _wrap_gather),
    "uneven-reduce-scatter": lambda s, m: _patch_attr(s, m, _wrap_reduce_scatter),
    "distopt-torch-adam-step": lambda s, m: _patch_attr(s, m, _keep_adam_step),
}


def patched_sites() -> list[str]:
    """Descriptions of the sites patched in this process (empty when not applied)."""
    if not _APPLIED:
        return []
    return [s.describe() for s in SITES if s.module in sys.modules]
