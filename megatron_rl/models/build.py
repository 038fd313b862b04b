"""HF config.json -> megatron-core TransformerConfig -> GPTModel chunks for this rank.

    ctx = init_parallel(cfg.parallel, shape=model_shape(hf_config))
    chunks = build_model(cfg.model, ctx)                    # weights loaded from cfg.model.path
    chunks = build_model(cfg.model, ctx, wrap_ddp=True)     # for training

What is chosen here, once, instead of `if cuda:` branches elsewhere:
  * layer spec: Transformer Engine when model.transformer_impl allows it and TE
    imports, else megatron's local spec (torch RMSNorm, SequentialMLP experts);
  * dtype: model.dtype, auto = bfloat16 on GPU, float32 on CPU;
  * kernels (models.kernels): routed experts (model.moe_grouped_gemm, auto = grouped
    GEMMs where a grouped kernel runs on the GPU: TEGroupedMLP, or megatron's GroupedMLP
    on grouped_gemm or torch._grouped_mm; SequentialMLP on CPU), packed attention
    (flash varlen on GPU) and each fusion whose kernel imports;
  * the settings megatron-core needs on a CPU build (the patched sites are in
    megatron_rl.parallel.cpu_compat): fp32, no dropout, no linear biases except
    q/k/v (with biases SequentialMLP fails on an in-place write to a view),
    use_cpu_initialization, no fusions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Any

import torch

from megatron_rl.config.core import ConfigError
from megatron_rl.config.schema import ModelConfig, ParallelConfig
from megatron_rl.models.hf_config import HFArch, load_hf_config, padded_vocab_size, parse_hf_config
from megatron_rl.models.info import ModelInfo, model_info  # noqa: F401  (model_info: named here for callers)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(model_cfg: ModelConfig) -> torch.dtype:
    """model.dtype as a torch dtype; auto = bfloat16 on GPU, float32 on CPU."""
    if model_cfg.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    dtype = _DTYPES[model_cfg.dtype]
    if dtype != torch.float32 and not torch.cuda.is_available():
        raise ConfigError(f"model.dtype={model_cfg.dtype} on a CPU-only machine: megatron-core on CPU needs model.dtype=float32 (or auto)")
    return dtype


def te_available() -> bool:
    """Transformer Engine's PyTorch extension imports (it needs CUDA)."""
    from megatron_rl.parallel.availability import detect

    return detect().transformer_engine


def spec_choice(model_cfg: ModelConfig, avail=None) -> tuple[bool, str]:
    """(use the TE layer spec, one line saying which spec and why) for model.transformer_impl on `avail`.

    avail: a megatron_rl.parallel.availability.Availability (default: this process's).
    """
    from megatron_rl.parallel.availability import detect

    avail = detect() if avail is None else avail
    impl = f"model.transformer_impl={model_cfg.transformer_impl}"
    if model_cfg.transformer_impl == "local":
        return False, f"layer spec: local ({impl}; {avail.describe()})"
    if model_cfg.transformer_impl == "transformer_engine" and not avail.transformer_engine:
        why = "it needs CUDA" if not avail.cuda else "the transformer-engine[pytorch] wheel does not import"
        raise ConfigError(
            f"model.transformer_impl=transformer_engine but Transformer Engine is not usable here ({why}): "
            "install transformer-engine[pytorch] or use model.transformer_impl=auto or local"
        )
    if avail.transformer_engine:
        return True, f"layer spec: transformer_engine ({impl}, Transformer Engine imports; {avail.describe()})"
    if not avail.cuda:
        return False, f"layer spec: local ({impl}, no CUDA: megatron's local spec on the CPU; {avail.describe()})"
    why = "CUDA present but Transformer Engine does not import"
    return False, f"layer spec: local ({impl}, {why}: megatron's local spec with the TE-absent bindings; {avail.describe()})"


def use_transformer_engine(model_cfg: ModelConfig) -> bool:
    """Whether to build with the TE layer spec (model.transformer_impl, auto = when importable)."""
    return spec_choice(model_cfg)[0]


_ANNOUNCED: set[str] = set()


def announce_spec(model_cfg: ModelConfig) -> str:
    """Print, once per process (rank 0 of a distributed job), which layer spec is built and why; return the line."""
    return announce(spec_choice(model_cfg)[1])


def announce(line: str) -> str:
    """Print a start-up line once per process, on rank 0 of a distributed job; return it."""
    rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    if line not in _ANNOUNCED and rank == 0:
        print(f"megatron_rl: {line}", file=sys.stderr, flush=True)
    _ANNOUNCED.add(line)
    return line


def expert_settings(model_cfg: ModelConfig, choice) -> dict[str, bool]:
    """moe_grouped_gemm / moe_permute_fusion from the kernel choice, refused (naming the key) where they cannot run."""
    if model_cfg.moe_permute_fusion and not te_available():
        raise ConfigError(
            "model.moe_permute_fusion=true needs Transformer Engine's fused permute, which does not import here "
            "(it needs CUDA and the transformer-engine[pytorch] wheel): set model.moe_permute_fusion=false"
        )
    return dict(moe_grouped_gemm=choice.moe_grouped_gemm, moe_permute_fusion=model_cfg.moe_permute_fusion)


RECOMPUTE_MODULES: dict[str, list[str]] = {
    "selective": ["core_attn"],
    "moe": ["core_attn", "moe", "mlp"],
}
"""megatron-core's recompute_modules of each selective model.recompute choice (see ModelConfig.recompute). Not
"layernorm" nor "moe_act": megatron-core 0.16.1 runs them through CheckpointWithoutOutput, which reads Transformer
Engine's FP8GlobalStateManager whatever the precision (a NameError without TE)."""


def recompute_settings(model_cfg: ModelConfig) -> dict[str, Any]:
    """TransformerConfig recompute fields for model.recompute."""
    model_cfg.validate()
    if model_cfg.recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if model_cfg.recompute in RECOMPUTE_MODULES:
        return dict(recompute_granularity="selective", recompute_modules=list(RECOMPUTE_MODULES[model_cfg.recompute]))
    if model_cfg.recompute != "none":
        raise ConfigError(f"model.recompute={model_cfg.recompute!r}: choose none, selective, moe or full")
    return {}


def kernel_choice(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, arch: HFArch, *, dtype: torch.dtype, kernels=None,
                  data_parallel: int = 1):
    """The kernels this build uses (models.kernels; `kernels` fakes the machine in tests)."""
    from megatron_rl.models.kernels import choose_kernels, detect_kernels

    return choose_kernels(
        kernels or detect_kernels(), model_cfg, use_te=use_transformer_engine(model_cfg), dtype=dtype,
        context_parallel=parallel_cfg.context_parallel, has_experts=bool(arch.num_experts), data_parallel=data_parallel,
        experts_per_rank_split=parallel_cfg.expert_parallel * (parallel_cfg.expert_tensor_parallel or 1),
    )


def hf_to_transformer_config(
    hf_config: dict,
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    dtype: torch.dtype,
    kernels=None,
    choice=None,
    **overrides: Any,
):
    """megatron-core TransformerConfig for an HF config, a ModelConfig and a parallel layout.

    kernels: a models.kernels.Kernels describing the machine (default: detected); its
    KernelChoice sets the experts, the fusions and (on the local spec) packed attention.
    choice: that KernelChoice, when the caller has made it already (build_model).

    `overrides` replace TransformerConfig fields (e.g. calculate_per_token_loss=True,
    variable_seq_lengths=True); an unknown field is an error.
    """
    from megatron.core.transformer.enums import AttnBackend

    from megatron_rl.models.families import get_family

    arch = parse_hf_config(hf_config)
    family = get_family(arch.family)
    tp, ep = parallel_cfg.tensor_parallel, parallel_cfg.expert_parallel
    sequence_parallel = parallel_cfg.use_sequence_parallel()
    if arch.num_experts and tp > 1 and not sequence_parallel:
        raise ConfigError(
            f"parallel.sequence_parallel=false with tensor_parallel={tp} on an MoE model: megatron-core's MoE layer "
            "needs sequence parallelism when TP > 1; set parallel.sequence_parallel=true (or leave it unset)"
        )
    use_te = use_transformer_engine(model_cfg)
    if choice is None:
        choice = kernel_choice(model_cfg, parallel_cfg, arch, dtype=dtype, kernels=kernels)
    moe: dict[str, Any] = {}
    if arch.num_experts:
        moe = dict(
            # the sorted path replaces megatron's dispatcher after the layer builds one (models.moe)
            moe_token_dispatcher_type="alltoall" if choice.dispatcher == "sorted" else choice.dispatcher,
            moe_router_load_balancing_type=model_cfg.moe_load_balancing_type if model_cfg.moe_aux_loss_coeff else "none",
            moe_aux_loss_coeff=model_cfg.moe_aux_loss_coeff,
            moe_z_loss_coeff=model_cfg.moe_z_loss_coeff or None,
            **expert_settings(model_cfg, choice),
            moe_router_fusion=choice.fusions["moe_router_fusion"],
        )
    fusions = {k: v for k, v in choice.fusions.items() if k != "moe_router_fusion"}
    recompute = recompute_settings(model_cfg)
    fields = dict(
        **family.transformer_fields(arch),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(hf_config.get("initializer_range", 0.02)),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_cfg.pipeline_parallel,
        context_parallel_size=parallel_cfg.context_parallel,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=parallel_cfg.expert_tensor_parallel,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        attention_backend=AttnBackend.auto if use_te else AttnBackend.local,
        **fusions,
        cross_entropy_loss_fusion=False,  # the actor computes vocab-parallel logprobs itself
        **moe,
        **recompute,
    )
    config_class = family.config_class()
    valid = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ConfigError(f"unknown TransformerConfig field(s) {unknown} in overrides")
    fields.update(overrides)
    return config_class(**fields)


TE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@contextlib.contextmanager
def _te_attention_environment(use_te: bool):
    """megatron's GPTModel writes its attention backend into the process environment for Transformer Engine
    (NVTE_FLASH_ATTN, ...: all 0 for the local spec) and asserts at the next build that they agree with it.
    Without TE they mean nothing: the local build leaves the environment as it found it, so that a later
    build in the process (megatron's default backend, a TE model) is not refused."""
    saved = {name: os.environ.get(name) for name in TE_ATTENTION_ENV}
    try:
        yield
    finally:
        if not use_te:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def build_model(
    model_cfg: ModelConfig,
    ctx,
    *,
    hf_config: dict | None = None,
    wrap_ddp: bool = False,
    load_weights: bool | None = None,
    use_distributed_optimizer: bool = False,
    ddp_config=None,
    config_overrides: dict | None = None,
) -> list:
    """megatron GPTModel chunks for this rank (one per virtual stage; megatron_rl uses one).

    hf_config: config.json as a dict (default: read from model_cfg.path).
    load_weights: load the safetensors in model_cfg.path (default: model_cfg.load_weights
        when model_cfg.path is set). Otherwise weights are drawn from model_cfg.init_seed;
        such a random init is the same across TP and DP but not across PP/EP layouts (every
        stage / EP rank draws from the same seed): for layout-independent starting weights,
        write the model as an HF directory once (models.tiny) and load it.
    wrap_ddp: wrap each chunk in megatron.core.distributed.DistributedDataParallel and set
        the config's no_sync / finalize_model_grads hooks, as megatron's training loop expects.
    use_distributed_optimizer: lay DDP's buffers out for megatron's distributed optimizer
        (ignored when ddp_config is given).
    ddp_config: a DistributedDataParallelConfig (default: fp32 grad reduction, no overlap).
    config_overrides: TransformerConfig fields to replace (e.g. calculate_per_token_loss=True).

    With a half-precision dtype each chunk is wrapped in megatron's Float16Module (fp32
    logits out of the last stage). Each chunk carries `.hf_info` (ModelInfo).
    """
    from megatron_rl.models.kernels import use_megatron_jit
    from megatron_rl.models.loading import load_hf_weights
    from megatron_rl.parallel import apply_compat

    apply_compat()  # idempotent; init_parallel applied it already unless the caller set up megatron itself
    announce_spec(model_cfg)
    if hf_config is None:
        hf_config = load_hf_config(model_cfg.path)
    arch = parse_hf_config(hf_config, source=f"{model_cfg.path or '<hf_config>'}/config.json")
    dtype = resolve_dtype(model_cfg)
    choice = kernel_choice(model_cfg, ctx.config, arch, dtype=dtype, data_parallel=ctx.dp_size)
    use_megatron_jit(choice.jit_fusions)
    config = hf_to_transformer_config(hf_config, model_cfg, ctx.config, dtype=dtype, choice=choice, **(config_overrides or {}))
    use_te = use_transformer_engine(model_cfg)
    announce(choice.describe())
    info = ModelInfo(arch=arch, hf_config=hf_config, padded_vocab_size=padded_vocab_size(arch.vocab_size, ctx.tp_size), use_te=use_te)
    model = _build_gpt_model(model_cfg, ctx, config, info, choice)
    if load_weights is None:
        load_weights = bool(model_cfg.load_weights and model_cfg.path)
    if load_weights:
        load_hf_weights([model], model_cfg.path, ctx)
    chunks = [model] if dtype == torch.float32 else [_half_precision_chunk(model, config, info)]
    if wrap_ddp:
        if ddp_config is None:
            from megatron.core.distributed import DistributedDataParallelConfig

            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
            )
        chunks = _wrap_ddp(chunks, config, ddp_config)
    return chunks


def _build_gpt_model(model_cfg: ModelConfig, ctx, config, info: ModelInfo, choice):
    """This rank's GPTModel from model_cfg.init_seed, with the chosen attention and MoE dispatch, on ctx.device."""
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.models.families import get_family
    from megatron_rl.parallel import seed_all

    arch = info.arch
    family = get_family(arch.family)
    seed_all(model_cfg.init_seed)  # same draws on every rank: CPU init makes TP shards of one full tensor
    with _te_attention_environment(info.use_te):
        model = GPTModel(
            config=config,
            transformer_layer_spec=_layer_spec(family, config, info.use_te, choice),
            vocab_size=info.padded_vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=ctx.is_pipeline_first_stage(),
            post_process=ctx.is_pipeline_last_stage(),
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            **family.gpt_model_kwargs(arch),
        )
    model.hf_info = info
    _set_packed_attention(model, choice.attention, varlen_gqa=choice.varlen_gqa, compiled_rope="packed_rope" in choice.compiled_regions)
    if choice.dispatcher == "sorted":
        from megatron_rl.models.moe import use_sorted_dispatch

        use_sorted_dispatch(model)
    if ctx.device.type == "cuda":
        model.cuda(ctx.device)
    return model


def _half_precision_chunk(model, config, info: ModelInfo):
    """As megatron's training loop does: half-precision inputs in, fp32 logits out of the last stage (Float16Module)."""
    from megatron.core.transformer.module import Float16Module

    chunk = Float16Module(config, model)
    chunk.hf_info = info
    for module in model.modules():  # megatron turns a router's expert bias back to fp32 at its first forward:
        keep_fp32 = getattr(module, "_maintain_float32_expert_bias", None)  # from the start here, so that every
        if keep_fp32 is not None:  # export of the model (a weight push) sees the same dtype
            keep_fp32()
    return chunk


def _layer_spec(family, config, use_te: bool, choice):
    """The family's decoder block spec, its MoE layers on the sorted path where chosen (models.moe)."""
    spec = family.layer_spec(config, use_te)
    if choice.dispatcher != "sorted":
        return spec
    from megatron_rl.models.moe import sorted_dispatch_refusal, with_sorted_moe

    refusal = sorted_dispatch_refusal(config)
    if refusal:
        raise ConfigError(f"the sorted MoE dispatch cannot serve this model ({refusal}): set model.token_dispatcher=alltoall")
    return with_sorted_moe(spec)


def _set_packed_attention(model, kernel: str, *, varlen_gqa: bool = True, compiled_rope: bool = False) -> None:
    """Every LocalCoreAttention of the model runs packed microbatches with `kernel` (models.kernels), the varlen
    kernel called as the installed torch's signature allows (models.varlen); every PackedSelfAttention rotates with
    the compiled RoPE where asked (model.compile_regions)."""
    from megatron_rl.models.attention import LocalCoreAttention, PackedSelfAttention
    from megatron_rl.models.varlen import VarlenBinding

    for module in model.modules():
        if isinstance(module, PackedSelfAttention):
            module.compiled_rope = compiled_rope
        if isinstance(module, LocalCoreAttention):
            module.packed_kernel = kernel
            module.varlen_binding = VarlenBinding(enable_gqa=varlen_gqa)


def _wrap_ddp(chunks: list, config, ddp_config) -> list:
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads

    wrapped = []
    for i, chunk in enumerate(chunks):
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        ddp.hf_info = chunk.hf_info
        wrapped.append(ddp)
    config.no_sync_func = wrapped[0].no_sync if len(wrapped) == 1 else [m.no_sync for m in wrapped]
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped
