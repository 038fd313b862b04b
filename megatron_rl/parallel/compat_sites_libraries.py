"""The sites in megatron-core's code paths for Transformer Engine, apex or the grouped_gemm kernels being absent.

These are about a missing library, not a missing GPU: each applies wherever the
library its ``when`` names is absent, a GPU included (where every model build
fails without the te-absent ones). grouped-mlp-bf16 alone also needs CUDA absent.

* te-absent: megatron-core 0.16.1 bugs on its own TE-absent paths (a NameError, a TypeError);
* grouped-gemm-absent: GroupedMLP on torch's grouped matmul (megatron_rl.parallel.grouped_gemm_torch);
* apex-absent: the torch norm under sequence parallelism; with TE absent too, torch's Adam reloading a checkpoint.
"""

from __future__ import annotations

from megatron_rl.parallel.patch_site import MEGATRON_CORE, TE_ABSENT, PatchSite

MISSING_LIBRARY_SITES: tuple[PatchSite, ...] = (
    # 4. te_general_gemm NameError without Transformer Engine ----------------------------------
    PatchSite(
        name="te-general-gemm",
        module=MEGATRON_CORE + "transformer.moe.moe_utils",
        target="te_general_gemm",
        lines=(1192, 1225),
        expects=("te_general_gemm is not None",),
        kind="attribute",
        when=TE_ABSENT,
        why="RouterGatingLinearFunction reads te_general_gemm, bound only when TE imports (NameError); bound to None",
    ),
    PatchSite(
        name="mla-te-stubs",
        module=MEGATRON_CORE + "transformer.multi_latent_attention",
        target="HAVE_TE",
        lines=(62, 184),
        expects=("HAVE_TE\n            and isinstance(self.linear_proj, TELinear)",),
        kind="attribute",
        when=TE_ABSENT,
        why="without Transformer Engine megatron's TE extension binds TELinear to a stub object, MLA's import "
        "of it succeeds and sets HAVE_TE, then isinstance(self.linear_proj, TELinear) raises TypeError; "
        "HAVE_TE is set to False",
    ),
    # Grouped-GEMM experts without their CUDA kernels ------------------------------------------
    PatchSite(
        name="grouped-gemm-fallback",
        module=MEGATRON_CORE + "transformer.moe.grouped_gemm_util",
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
        module=MEGATRON_CORE + "transformer.moe.experts",
        target="GroupedMLP.forward",
        lines=(225,),
        expects=('assert self.config.bf16, "Currently GroupedMLP for MoE only supports bf16."',),
        kind="method",
        when=("grouped-gemm-absent", "cuda-absent"),
        why="GroupedMLP.forward asserts bf16 because the CUDA grouped_gemm kernel is bf16-only; the CPU fallback "
        "computes in any dtype, so an fp32 model runs the forward with a shallow copy of its config whose bf16 is True "
        "(the forward reads nothing else of it that differs)",
    ),
    # 6. torch norms with sequence parallel ----------------------------------------------------
    PatchSite(
        name="norm-sequence-parallel",
        module=MEGATRON_CORE + "transformer.torch_norm",
        target="WrappedTorchNorm.__new__",
        lines=(32,),
        expects=("assert not config.sequence_parallel",),
        kind="method",
        when=("apex-absent",),
        why="the torch norm (used without apex/TE) refuses sequence_parallel, which MoE with TP>1 "
        "requires (moe_layer.py:379); the patch builds it and marks its parameters sequence_parallel "
        "so finalize_model_grads all-reduces their grads over TP, as TE's norms do",
    ),
    # torch's Adam without Transformer Engine and apex -----------------------------------------
    PatchSite(
        name="distopt-torch-adam-step",
        module=MEGATRON_CORE + "optimizer.distrib_optimizer",
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
)
"""Every site about a missing library."""
