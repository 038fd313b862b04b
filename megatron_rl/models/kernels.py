"""Which kernels the actor's model runs on this machine: routed experts, packed attention, fusions.

Chosen once at build time from what is importable, never by `if cuda:` branches in the
model code. Each choice is keyed on the piece that is actually present or missing
(CUDA, Transformer Engine, apex, the grouped_gemm package, torch's grouped matmul,
torch's varlen flash attention, a compiler for megatron's jit fusions), and
`describe` gives the one start-up line that says what is on and why anything is off.

    kernels = detect_kernels()
    choice = choose_kernels(kernels, model_cfg, use_te=..., dtype=..., data_parallel=...)
    print(choice.describe())     # e.g. "experts: torch_grouped_mm (...); MoE dispatch sorted (...); attention: varlen (...); ..."

Routed experts (model.moe_grouped_gemm; None = auto):
  * te_grouped: Transformer Engine's TEGroupedMLP (TE spec);
  * grouped_gemm: megatron's GroupedMLP on the grouped_gemm package (CUDA, bf16);
  * torch_grouped_mm: megatron's GroupedMLP on torch._grouped_mm (CUDA bf16 on compute
    capability 9.0+, the kernel transformers' experts use; on CPU when asked for);
  * per_expert_loop: GroupedMLP whose grouped GEMM is a loop of matmuls (a torch without
    _grouped_mm, asked for explicitly);
  * sequential: megatron's SequentialMLP, one GEMM per expert (auto on CPU, or false).
  auto turns grouped GEMMs on where a grouped kernel exists on the GPU (TE, grouped_gemm
  or torch's) and keeps the per-expert loop on CPU.

Packed (THD) attention of the local spec (models.attention.LocalCoreAttention):
  * varlen: torch's flash varlen kernel (torch.nn.attention.varlen.varlen_attn) over the
    whole packed microbatch in one call (CUDA, bf16/fp16, no context parallelism);
  * per_sequence: one exact scaled_dot_product_attention per sequence (CPU, fp32, CP).
  The TE spec uses TE's own attention. Padded rows use SDPA's causal path (no mask).

MoE token dispatch (model.token_dispatcher; auto = sorted where it applies):
  * sorted: models.moe's path (the router's top-k kept as [tokens, k], one stable sort, one
    gather each way, expert offsets left on the device for torch._grouped_mm: no host sync),
    for the local spec with every expert on its rank (expert parallel x expert tensor parallel
    = 1) and without Transformer Engine's fused permute;
  * alltoall / allgather: megatron's dispatchers (experts over several ranks, the TE spec).

Compiled regions (model.compile_regions, off by default until a GPU measures it): the packed
RoPE of each layer's query and key torch.compile'd with dynamic shapes (models.rope).

Fusions (TransformerConfig fields): megatron's jit-fused bias-SwiGLU / bias-GELU and
bias-dropout-add when a compiler for them exists (CUDA with triton); RoPE, router and
permute fusion with TE; persistent layer norm and gradient-accumulation fusion with apex's
kernels or TE; overlap of the DP gradient reduce with backward on GPUs with DP > 1 (the
parameter all-gather is not overlapped: the weight export reads parameters right after
the optimizer step). On CPU all are off: none of their kernels runs there.

megatron's own @jit_fuser functions (the MoE experts' activation times probabilities, the
router's expert bias, the L2 norm, the output gate, the dispatcher's preprocessing) are
torch.compile'd by megatron whatever the fusion fields say. They compile only where the
fusions do (jit_fusions); elsewhere (CPU, a GPU without triton, model.fusions=false)
use_megatron_jit(False) makes them eager. On CPU a compile needs a C++ compiler and costs
every process at its first forward (inductor's cache load and its ISA probes, each a child
interpreter): a tiny DeepSeek-V3 with grouped experts took 2.7-6.4 s for its first forward
and backward compiled, 0.03 s eager (2 cores).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types
from dataclasses import dataclass, field

import torch

from megatron_rl.config.core import ConfigError


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """What this machine has (detect_kernels; tests build it by hand to fake a platform)."""

    cuda: bool
    """A CUDA device is present."""
    capability: tuple[int, int] | None = None
    """The device's compute capability, e.g. (9, 0) for H100 / H200."""
    te: bool = False
    """Transformer Engine's PyTorch extension imports."""
    apex: bool = False
    """NVIDIA apex's fused kernels import (fused_weight_gradient_mlp_cuda, fused layer norm)."""
    grouped_gemm_package: bool = False
    """The grouped_gemm CUDA package imports."""
    torch_grouped_mm: bool = False
    """torch has torch._grouped_mm."""
    varlen_attention: bool = False
    """torch's varlen_attn can serve packed attention here: its signature takes a causal window and a scale
    (models.varlen) and, on the GPU, a one-time tiny call ran (flash varlen; CUDA only)."""
    varlen_gqa: bool = True
    """That varlen_attn takes enable_gqa (torch >= 2.13); else key/value heads are expanded for the call (exact)."""
    varlen_why: str = ""
    """Why varlen_attention is off, or how it is called: the start-up line quotes it."""
    jit_compiler: bool = False
    """megatron's jit fusions can compile here (torch.compile with triton on CUDA)."""


def _imports(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def detect_kernels(avail=None) -> Kernels:
    """Kernels of this machine and torch build; `avail` is parallel.availability's (default: detected)."""
    from megatron_rl.parallel.availability import detect

    avail = detect() if avail is None else avail
    varlen, varlen_gqa, varlen_why = _varlen_here(avail.cuda)
    return Kernels(
        cuda=avail.cuda,
        capability=torch.cuda.get_device_capability() if avail.cuda else None,
        te=avail.transformer_engine,
        apex=avail.apex and _imports("fused_weight_gradient_mlp_cuda"),
        grouped_gemm_package=avail.grouped_gemm,
        torch_grouped_mm=_grouped_mm_here(avail.cuda),
        varlen_attention=varlen,
        varlen_gqa=varlen_gqa,
        varlen_why=varlen_why,
        jit_compiler=avail.cuda and _imports("triton") and _compile_runs_here(),
    )


def _grouped_mm_here(cuda: bool) -> bool:
    """torch._grouped_mm exists and, on the GPU, ran a tiny bf16 call there (parallel.grouped_gemm_torch's probe)."""
    if not cuda:
        return hasattr(torch, "_grouped_mm")
    from megatron_rl.parallel.grouped_gemm_torch import torch_grouped_mm_runs

    return torch_grouped_mm_runs(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)


@functools.cache
def _compile_runs_here() -> bool:
    """megatron's jit fusions are torch.compile'd (megatron.core.jit): one tiny compiled call on the GPU, once."""
    try:
        fused = torch.compile(lambda x: x * torch.sigmoid(x), dynamic=False)
        return bool(torch.isfinite(fused(torch.ones(8, device="cuda", dtype=torch.bfloat16))).all())
    except Exception:  # noqa: BLE001 - no working triton / C compiler: the fusions stay off
        return False


@functools.cache
def _varlen_here(cuda: bool) -> tuple[bool, bool, str]:
    """(usable, takes enable_gqa, why) for the installed varlen_attn: its signature, then one tiny call on the GPU."""
    from megatron_rl.models.varlen import probe_varlen, varlen_binding

    binding, why = varlen_binding()
    if binding is None:
        return False, False, why
    if not cuda:
        return False, binding.enable_gqa, "no CUDA (flash varlen has no CPU kernel)"
    failed = probe_varlen(binding, torch.device("cuda", torch.cuda.current_device()))
    if failed:
        return False, binding.enable_gqa, f"torch {torch.__version__}'s varlen_attn: {failed}"
    return True, binding.enable_gqa, why


@dataclass(frozen=True, kw_only=True)
class KernelChoice:
    """The kernels the model is built with, each with the reason."""

    experts: str
    """te_grouped | grouped_gemm | torch_grouped_mm | per_expert_loop | sequential (see the module docstring)."""
    experts_why: str
    attention: str
    """te | varlen | per_sequence."""
    attention_why: str
    varlen_gqa: bool = True
    """With attention varlen: the kernel takes enable_gqa (else key/value heads are expanded for it)."""
    fusions: dict[str, bool] = field(default_factory=dict)
    """TransformerConfig fusion fields."""
    fusions_off_why: dict[str, str] = field(default_factory=dict)
    """Why each fusion that is off is off."""
    overlap_grad_reduce: bool = False
    """DDP overlaps the gradient reduce-scatter / all-reduce with backward."""
    overlap_why: str = ""
    jit_fusions: bool = False
    """megatron's @jit_fuser functions are torch.compile'd (else eager: use_megatron_jit)."""
    dispatcher: str = "alltoall"
    """MoE token dispatch: sorted (models.moe) | alltoall | allgather (megatron's)."""
    dispatcher_why: str = ""
    compiled_regions: tuple[str, ...] = ()
    """Regions torch.compile'd in each layer (model.compile_regions): "packed_rope"."""

    @property
    def moe_grouped_gemm(self) -> bool:
        return self.experts != "sequential"

    def describe(self) -> str:
        """The one start-up line: what is on and why anything is off."""
        on = sorted(k for k, v in self.fusions.items() if v)
        by_reason: dict[str, list[str]] = {}
        for name, why in self.fusions_off_why.items():
            by_reason.setdefault(why, []).append(name)
        off = "; ".join(
            f"{'all fusions' if len(names) == len(self.fusions) else ', '.join(sorted(names))} off: {why}"
            for why, names in sorted(by_reason.items())
        )
        overlap = "on" if self.overlap_grad_reduce else f"off ({self.overlap_why})"
        return (f"kernels: experts {self.experts} ({self.experts_why}); MoE dispatch {self.dispatcher} ({self.dispatcher_why}); "
                f"attention {self.attention} ({self.attention_why}); "
                f"fusions on: {', '.join(on) or 'none'}{'; ' + off if off else ''}; overlap_grad_reduce {overlap}; "
                f"megatron's jit functions {'compiled' if self.jit_fusions else 'eager'}; compiled regions: "
                f"{', '.join(self.compiled_regions) if self.compiled_regions else 'none (model.compile_regions=false)'}")


def choose_experts(kernels: Kernels, requested: bool | None, *, use_te: bool, dtype: torch.dtype) -> tuple[str, str]:
    """(provider, why) for the routed experts; ConfigError naming model.moe_grouped_gemm where it cannot run."""
    if requested is False:
        return "sequential", "model.moe_grouped_gemm=false"
    if use_te:
        return "te_grouped", "Transformer Engine's TEGroupedMLP"
    hopper_bf16 = kernels.cuda and kernels.torch_grouped_mm and dtype == torch.bfloat16 and (kernels.capability or (0, 0)) >= (9, 0)
    if kernels.cuda:
        if kernels.grouped_gemm_package and dtype == torch.bfloat16:
            return "grouped_gemm", "the grouped_gemm package"
        if hopper_bf16:
            return "torch_grouped_mm", "torch._grouped_mm, bf16 on compute capability >= 9.0"
        if requested is None:
            return "sequential", ("no grouped kernel for this GPU and dtype (Transformer Engine, grouped_gemm, or "
                                  "torch._grouped_mm in bf16 on Hopper)")
        raise ConfigError(
            f"model.moe_grouped_gemm=true with model.dtype={dtype} on a GPU of compute capability {kernels.capability} "
            "without Transformer Engine: megatron-core's GroupedMLP needs a grouped kernel, and none runs here (the "
            "grouped_gemm package in bf16, or torch._grouped_mm in bf16 on compute capability >= 9.0); install "
            "transformer-engine[pytorch] or grouped_gemm, set model.dtype=bfloat16, or set model.moe_grouped_gemm=false"
        )
    if requested is None:
        return "sequential", "CPU: one GEMM per expert"
    if kernels.torch_grouped_mm:
        return "torch_grouped_mm", "torch._grouped_mm on CPU"
    return "per_expert_loop", "this torch has no torch._grouped_mm"


def choose_dispatcher(requested: str, *, use_te: bool, experts_per_rank_split: int, permute_fusion: bool = False) -> tuple[str, str]:
    """(dispatcher, why) for model.token_dispatcher; experts_per_rank_split = expert parallel x expert tensor parallel.
    ConfigError naming the key where sorted is asked for and cannot run."""
    if requested in ("alltoall", "allgather"):
        return requested, f"model.token_dispatcher={requested}"
    refusal = None
    if use_te:
        refusal = "the Transformer Engine spec keeps megatron's dispatcher"
    elif experts_per_rank_split > 1:
        refusal = f"experts split over {experts_per_rank_split} ranks (expert parallel x expert tensor parallel) need an all-to-all"
    elif permute_fusion:
        refusal = "model.moe_permute_fusion uses megatron's dispatcher"
    if refusal is None:
        return "sorted", "one gather each way, no host sync"
    if requested == "sorted":
        raise ConfigError(f"model.token_dispatcher=sorted cannot run here ({refusal}): set model.token_dispatcher=auto")
    return "alltoall", refusal


def choose_attention(kernels: Kernels, *, use_te: bool, dtype: torch.dtype, context_parallel: int,
                     requested: str = "auto") -> tuple[str, str]:
    """(provider, why) for packed (THD) attention; requested = model.packed_attention."""
    if use_te:
        return "te", "Transformer Engine's attention"
    if requested == "per_sequence":
        return "per_sequence", "model.packed_attention=per_sequence"
    if requested == "varlen":
        available, why = choose_attention(kernels, use_te=False, dtype=dtype, context_parallel=context_parallel)
        if available != "varlen":
            raise ConfigError(f"model.packed_attention=varlen cannot run here ({why}): set model.packed_attention=auto")
        return available, why
    if not kernels.cuda:
        return "per_sequence", "CPU: exact attention per sequence"
    if context_parallel > 1:
        return "per_sequence", "context parallelism: each CP rank's chunks need a position mask"
    if not kernels.varlen_attention:
        return "per_sequence", kernels.varlen_why or "this torch has no usable torch.nn.attention.varlen"
    if dtype not in (torch.bfloat16, torch.float16):
        return "per_sequence", f"flash varlen needs bf16/fp16, the model is {dtype}"
    how = "" if kernels.varlen_gqa else "; key/value heads expanded: this torch's varlen_attn has no enable_gqa"
    return "varlen", "torch's flash varlen kernel, one call per microbatch" + how


def packed_params_device(use_te: bool, device: torch.device) -> torch.device | None:
    """Where a packed microbatch's PackedSeqParams (its cu_seqlens) go, or None to keep them on the host.

    Transformer Engine's THD attention and fused RoPE read cu_seqlens in their kernels: on the device. The local
    spec reads them on the host: megatron's RoPE for THD (`_apply_rotary_pos_emb_thd`) and LocalCoreAttention
    take their `.tolist()` in every layer, which on device tensors would synchronise the stream each time
    (LocalCoreAttention's varlen call copies them to the device once per microbatch itself)."""
    return device if use_te and device.type == "cuda" else None


def choose_fusions(kernels: Kernels, *, use_te: bool, enabled: bool = True) -> tuple[dict[str, bool], dict[str, str]]:
    """(TransformerConfig fusion fields, why each off one is off); enabled = model.fusions."""
    reasons = {
        "bias_activation_fusion": (kernels.cuda and kernels.jit_compiler, "needs CUDA and triton for megatron's jit fusions"),
        "bias_dropout_fusion": (kernels.cuda and kernels.jit_compiler, "needs CUDA and triton for megatron's jit fusions"),
        "apply_rope_fusion": (use_te, "needs Transformer Engine's fused RoPE"),
        "masked_softmax_fusion": (use_te, "the local attention runs its softmax inside SDPA / flash"),
        "moe_router_fusion": (use_te, "needs Transformer Engine's fused router"),
        "persist_layer_norm": (kernels.apex and not use_te, "needs apex's persistent layer norm (local spec)"),
        "gradient_accumulation_fusion": (use_te or kernels.apex, "needs Transformer Engine or apex's fused wgrad kernel"),
    }
    if not enabled:
        reasons = {name: (False, "model.fusions=false") for name in reasons}
    elif not kernels.cuda:  # megatron-core on CPU: none of their kernels exists
        reasons = {name: (False, "no CUDA") for name in reasons}
    fusions = {name: bool(on) for name, (on, _) in reasons.items()}
    off = {name: why for name, (on, why) in reasons.items() if not on}
    return fusions, off


def choose_overlap(kernels: Kernels, data_parallel: int) -> tuple[bool, str]:
    """(overlap the DP gradient reduce with backward, why not): on GPUs with DP > 1; CPU keeps one reduction."""
    if not kernels.cuda:
        return False, "CPU"
    if data_parallel < 2:
        return False, "one data-parallel rank"
    return True, ""


def choose_kernels(kernels: Kernels, model_cfg, *, use_te: bool, dtype: torch.dtype, context_parallel: int = 1,
                   data_parallel: int = 1, has_experts: bool = True, experts_per_rank_split: int = 1) -> KernelChoice:
    """Every choice for one model build (see the module docstring)."""
    if has_experts:
        experts, experts_why = choose_experts(kernels, model_cfg.moe_grouped_gemm, use_te=use_te, dtype=dtype)
        dispatcher, dispatcher_why = choose_dispatcher(model_cfg.token_dispatcher, use_te=use_te, permute_fusion=model_cfg.moe_permute_fusion,
                                                       experts_per_rank_split=experts_per_rank_split)
    else:
        experts, experts_why = "sequential", "dense model"
        dispatcher, dispatcher_why = "none", "dense model"
    attention, attention_why = choose_attention(kernels, use_te=use_te, dtype=dtype, context_parallel=context_parallel,
                                                requested=model_cfg.packed_attention)
    fusions, off = choose_fusions(kernels, use_te=use_te, enabled=model_cfg.fusions)
    overlap, overlap_why = choose_overlap(kernels, data_parallel)
    return KernelChoice(experts=experts, experts_why=experts_why, attention=attention, attention_why=attention_why,
                        varlen_gqa=kernels.varlen_gqa,
                        fusions=fusions, fusions_off_why=off, overlap_grad_reduce=overlap, overlap_why=overlap_why,
                        dispatcher=dispatcher, dispatcher_why=dispatcher_why,
                        compiled_regions=("packed_rope",) if model_cfg.compile_regions and attention != "te" else (),
                        jit_fusions=bool(kernels.cuda and kernels.jit_compiler and model_cfg.fusions))


_EAGER: list[tuple[object, str, object]] = []
"""What use_megatron_jit(False) replaced: (owner, attribute, the compiled or compiling value), to put back."""


def use_megatron_jit(compiled: bool) -> None:
    """megatron's @jit_fuser functions compiled (megatron's default) or eager, for every build in this process.

    megatron binds `jit_fuser` (torch.compile) into each module at import and decorates functions, methods
    and closures made in constructors with it. Eager: megatron.core.jit's decorator becomes its no-op, each
    imported megatron module's `jit_fuser` with it (constructors made later get plain closures), and every
    compiled function or method a module or its classes hold is its original again. compiled=True puts
    back what an earlier call replaced."""
    import megatron.core.jit as jit

    if compiled:
        if _EAGER:
            jit.enable_jit_fuser()
            for owner, name, value in reversed(_EAGER):
                setattr(owner, name, value)
            _EAGER.clear()
        return
    if jit.jit_fuser is jit.noop_decorator:
        return
    _EAGER.append((jit, "jit_fuser", jit.jit_fuser))
    jit.disable_jit_fuser()
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("megatron.") or module is jit:
            continue
        owners = [module, *(v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module_name)]
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if not isinstance(value, types.FunctionType):
                    continue
                original = value.__dict__.get("_torchdynamo_orig_callable")  # what torch.compile wrapped
                if name == "jit_fuser" and owner is module and value is not jit.noop_decorator:
                    original = jit.noop_decorator  # torch.compile itself
                if callable(original):
                    _EAGER.append((owner, name, value))
                    setattr(owner, name, original)


__all__ = ["KernelChoice", "Kernels", "choose_attention", "choose_dispatcher", "choose_experts", "choose_fusions", "choose_kernels", "choose_overlap",
           "detect_kernels", "use_megatron_jit"]
