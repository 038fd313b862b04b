"""The megatron-core 0.16.1 sites the compatibility layer patches, one PatchSite each.

Data only: what each site is, where it lives, the source it relies on, why it
fails and under which condition (``when``: CUDA absent, Transformer Engine
absent, apex absent, the grouped_gemm kernels absent; see
megatron_rl.parallel.availability). megatron_rl.parallel.cpu_compat applies the
sites whose conditions hold on this platform and checks that every target still
looks like this. Most sites are about CUDA being absent; the te-absent ones
(te-general-gemm, mla-te-stubs) are needed on a GPU without Transformer Engine
too, where every model build otherwise fails.
"""

from __future__ import annotations

from dataclasses import dataclass

TESTED_MEGATRON_VERSION = "0.16.1"

_NO_CUDA = ("cuda-absent",)
_NO_TE = ("te-absent",)

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
    when: tuple[str, ...]
    """Conditions (availability.CONDITIONS) that must all hold for the patch to apply: the situation it is about."""
    why: str
    """What fails and what the patch does."""
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
        when=_NO_CUDA,
        why="reads the CUDA generator; replaced by torch.get_rng_state() (the CPU generator)",
    ),
    PatchSite(
        name="rng-set-state",
        module=_MC + "tensor_parallel.random",
        target="_set_cuda_rng_state",
        lines=(72, 84),
        expects=("_cuda_setRNGState",),
        kind="function",
        when=_NO_CUDA,
        why="writes the CUDA generator; replaced by torch.set_rng_state()",
    ),
    PatchSite(
        name="rng-tracker-add",
        module=_MC + "tensor_parallel.random",
        target="CudaRNGStatesTracker.add",
        lines=(217, 235, 237, 238),
        expects=("torch.cuda.get_rng_state()", "torch.cuda.manual_seed(seed)"),
        kind="cuda-shim",
        when=_NO_CUDA,
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
        when=_NO_CUDA,
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
        when=_NO_CUDA,
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
        when=_NO_CUDA,
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
        when=_NO_CUDA,
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
        when=_NO_CUDA,
        why="RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device()",
    ),
    PatchSite(
        name="yarn-rope-device",
        module=_MC + "models.common.embeddings.yarn_rotary_pos_embedding",
        target="",
        lines=(122, 126),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="YarnRotaryEmbedding (multi-latent attention with YaRN) moves its frequencies to torch.cuda.current_device()",
    ),
    PatchSite(
        name="rope-cp-index",
        module=_MC + "models.common.embeddings.rope_utils",
        target="get_pos_emb_on_this_cp_rank",
        lines=(62, 63, 64),
        expects=('device="cpu", pin_memory=True',),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="context parallelism without packing: get_pos_emb_on_this_cp_rank builds the CP chunk index "
        "[r, 2CP-1-r] in pinned memory, which a CPU-only build refuses; the module's shim drops pin_memory",
    ),
    PatchSite(
        name="tensor-cuda-rope",
        module=_MC + "models.common.embeddings.rope_utils",
        target="get_pos_emb_on_this_cp_rank",
        lines=(64,),
        expects=(".cuda(non_blocking=True)",),
        kind="tensor-cuda",
        when=_NO_CUDA,
        why="get_pos_emb_on_this_cp_rank moves its CP chunk index with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="router-device",
        module=_MC + "transformer.moe.router",
        target="",
        lines=(90, 92),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="TopKRouter.gating moves CPU weights to torch.cuda.current_device() every call",
    ),
    PatchSite(
        name="mappings-device",
        module=_MC + "tensor_parallel.mappings",
        target="",
        lines=(91, 141, 148, 181, 442),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="gather/reduce-scatter/all-to-all outputs are allocated on torch.cuda.current_device()",
    ),
    PatchSite(
        name="layers-device",
        module=_MC + "tensor_parallel.layers",
        target="",
        lines=(261, 552, 597, 607, 873, 899, 1197, 1218),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="sequence-parallel all-gather buffers and GPU init allocate on torch.cuda.current_device()",
    ),
    PatchSite(
        name="tp-utils-device",
        module=_MC + "tensor_parallel.utils",
        target="",
        lines=(70, 91),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="split/gather helpers allocate on torch.cuda.current_device()",
    ),
    PatchSite(
        name="p2p-device",
        module=_MC + "pipeline_parallel.p2p_communication",
        target="",
        lines=(190, 313, 321, 242, 398),
        expects=(_CUR, "torch.cuda.synchronize()"),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="pipeline receive buffers on torch.cuda.current_device(); torch.cuda.synchronize() after p2p",
    ),
    PatchSite(
        name="utils-device",
        module=_MC + "utils",
        target="",
        lines=(631, 656, 1207, 1347),
        expects=(_CUR, 'device="cuda"'),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="GlobalMemoryBuffer allocates on torch.cuda.current_device(); norm helpers use device='cuda'",
    ),
    PatchSite(
        name="grad-buffer-device",
        module=_MC + "distributed.param_and_grad_buffer",
        target="",
        lines=(417, 422, 768, 783, 800, 806),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="DDP param/grad buffers are allocated on torch.cuda.current_device()",
    ),
    PatchSite(
        name="ddp-stream",
        module=_MC + "distributed.distributed_data_parallel",
        target="",
        lines=(230, 588, 611),
        expects=("torch.cuda.synchronize()",),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="DDP creates a CUDA communication stream and synchronizes",
    ),
    PatchSite(
        name="experts-device",
        module=_MC + "transformer.moe.experts",
        target="",
        lines=(184, 192),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="GroupedMLP weights allocated on torch.cuda.current_device() (non-CPU init)",
    ),
    PatchSite(
        name="shared-experts-stream",
        module=_MC + "transformer.moe.shared_experts",
        target="",
        lines=(123, 162, 163, 277),
        expects=("torch.cuda.Stream()",),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="overlapped shared experts run on a CUDA side stream",
    ),
    PatchSite(
        name="moe-utils-stream",
        module=_MC + "transformer.moe.moe_utils",
        target="",
        lines=(998, 1098),
        expects=('device="cuda"',),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="device='cuda' tensor factories and torch.cuda.current_stream() in MoE helpers",
    ),
    PatchSite(
        name="layer-device",
        module=_MC + "transformer.transformer_layer",
        target="",
        lines=(936, 1147),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="TransformerLayer moves tensors to torch.cuda.current_device()",
    ),
    PatchSite(
        name="module-device",
        module=_MC + "transformer.module",
        target="",
        lines=(249,),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="MegatronModule buffers on torch.cuda.current_device()",
    ),
    PatchSite(
        name="gpt-device",
        module=_MC + "models.gpt.gpt_model",
        target="",
        lines=(415,),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="GPTModel allocates on torch.cuda.current_device()",
    ),
    PatchSite(
        name="ckpt-saver-device",
        module=_MC + "dist_checkpointing.strategies.state_dict_saver",
        target="",
        lines=(204, 252),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="dist_checkpointing.save all-reduces a failure flag on torch.cuda.current_device()",
    ),
    PatchSite(
        name="ckpt-sync",
        module=_MC + "dist_checkpointing.strategies.fully_parallel",
        target="",
        lines=(272, 281),
        expects=("torch.cuda.synchronize()",),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="fully parallel save/load strategies call torch.cuda.synchronize()",
    ),
    PatchSite(
        name="ckpt-fs-sync",
        module=_MC + "dist_checkpointing.strategies.filesystem_async",
        target="",
        lines=(230,),
        expects=("torch.cuda.synchronize()",),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="async filesystem writer calls torch.cuda.synchronize()",
    ),
    PatchSite(
        name="ckpt-async-device",
        module=_MC + "dist_checkpointing.strategies.async_utils",
        target="",
        lines=(165, 212, 604),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="async checkpoint queue all-reduces on torch.cuda.current_device()",
    ),
    PatchSite(
        name="rerun-device",
        module=_MC + "rerun_state_machine",
        target="",
        lines=(261, 525, 567, 957, 970),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
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
        when=_NO_CUDA,
        why="forward_backward_* count tokens in torch.zeros(..., device='cuda')",
    ),
    PatchSite(
        name="optimizer-device",
        module=_MC + "optimizer.optimizer",
        target="",
        lines=(473, 481, 485, 907, 1141),
        expects=("device='cuda'",),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="optimizer overflow/scale buffers are created with device='cuda'",
    ),
    PatchSite(
        name="clip-grads-device",
        module=_MC + "optimizer.clip_grads",
        target="",
        lines=(90, 103, 115, 174, 207),
        expects=("device='cuda'",),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="grad-norm and clipping buffers are created with device='cuda'",
    ),
    PatchSite(
        name="distopt-device",
        module=_MC + "optimizer.distrib_optimizer",
        target="",
        lines=(791, 1077),
        expects=(_CUR,),
        kind="cuda-shim",
        when=_NO_CUDA,
        why="distributed optimizer buffers on torch.cuda.current_device()",
    ),
    PatchSite(
        name="causal-mask-device",
        module=_MC + "transformer.utils",
        target="",
        lines=(35, 40),
        expects=('device="cuda"',),
        kind="cuda-shim",
        when=_NO_CUDA,
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
        when=_NO_TE,
        why="RouterGatingLinearFunction reads te_general_gemm, bound only when TE imports (NameError); bound to None",
    ),
    PatchSite(
        name="mla-te-stubs",
        module=_MC + "transformer.multi_latent_attention",
        target="HAVE_TE",
        lines=(62, 184),
        expects=("HAVE_TE\n            and isinstance(self.linear_proj, TELinear)",),
        kind="attribute",
        when=_NO_TE,
        why="without Transformer Engine megatron's TE extension binds TELinear to a stub object, MLA's import "
        "of it succeeds and sets HAVE_TE, then isinstance(self.linear_proj, TELinear) raises TypeError; "
        "HAVE_TE is set to False",
    ),
    # Grouped-GEMM experts without their CUDA kernels ------------------------------------------
    PatchSite(
        name="grouped-gemm-fallback",
        module=_MC + "transformer.moe.grouped_gemm_util",
        target="grouped_gemm",
        lines=(3, 6, 22),
        expects=("ops = grouped_gemm.ops if grouped_gemm_is_available() else None",),
        kind="attribute",
        when=("grouped-gemm-absent",),
        why="GroupedMLP (moe_grouped_gemm=True without Transformer Engine) needs the grouped_gemm CUDA package "
        "(gg.ops.gmm); when it does not import, grouped_gemm and ops are bound to megatron_rl.parallel."
        "grouped_gemm_torch: torch's grouped matmul (torch._grouped_mm) where it runs (bf16 on Hopper, CPU), else "
        "per-expert torch matmuls over the tokens_per_expert splits, through autograd. On a GPU, models.kernels "
        "builds GroupedMLP only where torch's kernel runs (else SequentialMLP, or a refusal naming the key)",
    ),
    PatchSite(
        name="grouped-mlp-bf16",
        module=_MC + "transformer.moe.experts",
        target="GroupedMLP.forward",
        lines=(225,),
        expects=('assert self.config.bf16, "Currently GroupedMLP for MoE only supports bf16."',),
        kind="method",
        when=("grouped-gemm-absent", "cuda-absent"),
        why="GroupedMLP.forward asserts bf16 because the CUDA grouped_gemm kernel is bf16-only; the CPU fallback "
        "computes in any dtype, so an fp32 model runs the forward with a shallow copy of its config whose bf16 is True "
        "(the forward reads nothing else of it that differs)",
    ),
    # 6. torch norms with sequence parallel ------------------------------------------------------
    PatchSite(
        name="norm-sequence-parallel",
        module=_MC + "transformer.torch_norm",
        target="WrappedTorchNorm.__new__",
        lines=(32,),
        expects=("assert not config.sequence_parallel",),
        kind="method",
        when=("apex-absent",),
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
        when=_NO_CUDA,
        why="(CUDA absent means the gloo backend) gloo's list all_gather rejects uneven sizes ('invalid tensor size'); emulated by "
        "padding + all_gather_into_tensor when output_split_sizes is given",
    ),
    PatchSite(
        name="uneven-reduce-scatter",
        module=_MC + "tensor_parallel.mappings",
        target="_reduce_scatter_along_first_dim",
        lines=(193,),
        expects=("torch.distributed.reduce_scatter(output, input_tensor_list",),
        kind="function",
        when=_NO_CUDA,
        why="(CUDA absent means the gloo backend) gloo has no list reduce_scatter for uneven sizes; emulated by all_reduce + slice",
    ),
    # 8./9. cuda tensor-type checks ------------------------------------------------------------
    PatchSite(
        name="clip-grads-type",
        module=_MC + "optimizer.clip_grads",
        target="clip_grad_by_total_norm_fp32",
        lines=(167,),
        expects=("param.grad.type() == 'torch.cuda.FloatTensor'",),
        kind="tensor-type",
        when=_NO_CUDA,
        why="asserts grads are torch.cuda.FloatTensor; Tensor.type() reports the cuda type name to this module",
    ),
    PatchSite(
        name="optimizer-type",
        module=_MC + "optimizer.optimizer",
        target="Float16OptimizerWithFloat16Params.__init__",
        lines=(671, 690),
        expects=("param.type() == 'torch.cuda.FloatTensor'",),
        kind="tensor-type",
        when=_NO_CUDA,
        why="accepts only cuda tensor types; Tensor.type() reports the cuda type name to this module",
    ),
    PatchSite(
        name="distopt-type",
        module=_MC + "optimizer.distrib_optimizer",
        target="DistributedOptimizer._build_model_and_main_param_groups",
        lines=(361, 420, 582),
        expects=("model_param.type() == 'torch.cuda.FloatTensor'",),
        kind="tensor-type",
        when=_NO_CUDA,
        why="accepts only cuda tensor types; Tensor.type() reports the cuda type name to this module",
    ),
    PatchSite(
        name="distopt-torch-adam-step",
        module=_MC + "optimizer.distrib_optimizer",
        target="DistributedOptimizer._set_main_param_and_optimizer_states",
        lines=(938, 2101),
        expects=("dst_tensors[key].copy_(tensors[key])",),
        kind="method",
        when=("te-absent", "apex-absent"),
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
        when=_NO_CUDA,
        why="PP>1 with tied embeddings moves the word embedding with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-optimizer",
        module=_MC + "optimizer.optimizer",
        target="MegatronOptimizer",
        lines=(375, 380),
        expects=("p.data.cuda()",),
        kind="tensor-cuda",
        when=_NO_CUDA,
        why="optimizer state reload moves tensors with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-distopt",
        module=_MC + "optimizer.distrib_optimizer",
        target="DistributedOptimizer",
        lines=(1089,),
        expects=("send_tensor.cuda()",),
        kind="tensor-cuda",
        when=_NO_CUDA,
        why="distributed optimizer state gather moves buffers with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-exchange",
        module=_MC + "dist_checkpointing.exchange_utils",
        target="",
        lines=(336, 499),
        expects=("all_loaded_tensors[shard_id].cuda()", "local_ten = all_loaded_tensors[shard_id].cuda()"),
        kind="tensor-cuda",
        when=_NO_CUDA,
        why="checkpoint load exchange moves tensors with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-utils",
        module=_MC + "utils",
        target="check_param_hashes_across_dp_replicas",
        lines=(898,),
        expects=("torch.stack(local_param_hashes).cuda()",),
        kind="tensor-cuda",
        when=_NO_CUDA,
        why="parameter-hash check moves hashes with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-data",
        module=_MC + "tensor_parallel.data",
        target="broadcast_data",
        lines=(84,),
        expects=("data[key].cuda()",),
        kind="tensor-cuda",
        when=_NO_CUDA,
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
        when=_NO_CUDA,
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
        when=_NO_CUDA,
        why="swap_model_weights over gloo creates/uses a CUDA stream",
        optional=True,
    ),
)

# Modules whose calls to Tensor.cuda() / Tensor.type() get the CPU-friendly behaviour.
