"""The sites where megatron-core calls ``Tensor.cuda()`` or checks ``Tensor.type()`` for a cuda type name.

Each applies when CUDA is absent. megatron_rl.parallel.cpu_compat wraps
``Tensor.cuda`` and ``Tensor.type`` once for the whole process, but only callers
inside the modules these sites name see the CPU behaviour: ``tensor-cuda``
sites get a no-op ``.cuda()``, ``tensor-type`` sites a ``.type()`` that reports
``torch.cuda.*Tensor`` (groups 8. and 9. of megatron_rl.parallel.cpu_compat);
every other caller gets torch's own method.
"""

from __future__ import annotations

from megatron_rl.parallel.patch_site import CUDA_ABSENT, MEGATRON_CORE, PatchSite

TENSOR_METHOD_SITES: tuple[PatchSite, ...] = (
    # 8./9. cuda tensor-type checks ------------------------------------------------------------
    PatchSite(
        name="clip-grads-type",
        module=MEGATRON_CORE + "optimizer.clip_grads",
        target="clip_grad_by_total_norm_fp32",
        lines=(167,),
        expects=("param.grad.type() == 'torch.cuda.FloatTensor'",),
        kind="tensor-type",
        when=CUDA_ABSENT,
        why="asserts grads are torch.cuda.FloatTensor; Tensor.type() reports the cuda type name to this module",
    ),
    PatchSite(
        name="optimizer-type",
        module=MEGATRON_CORE + "optimizer.optimizer",
        target="Float16OptimizerWithFloat16Params.__init__",
        lines=(671, 690),
        expects=("param.type() == 'torch.cuda.FloatTensor'",),
        kind="tensor-type",
        when=CUDA_ABSENT,
        why="accepts only cuda tensor types; Tensor.type() reports the cuda type name to this module",
    ),
    PatchSite(
        name="distopt-type",
        module=MEGATRON_CORE + "optimizer.distrib_optimizer",
        target="DistributedOptimizer._build_model_and_main_param_groups",
        lines=(361, 420, 582),
        expects=("model_param.type() == 'torch.cuda.FloatTensor'",),
        kind="tensor-type",
        when=CUDA_ABSENT,
        why="accepts only cuda tensor types; Tensor.type() reports the cuda type name to this module",
    ),
    # Tensor.cuda() ----------------------------------------------------------------------------
    PatchSite(
        name="tensor-cuda-rope",
        module=MEGATRON_CORE + "models.common.embeddings.rope_utils",
        target="get_pos_emb_on_this_cp_rank",
        lines=(64,),
        expects=(".cuda(non_blocking=True)",),
        kind="tensor-cuda",
        when=CUDA_ABSENT,
        why="get_pos_emb_on_this_cp_rank moves its CP chunk index with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-language-module",
        module=MEGATRON_CORE + "models.common.language_module.language_module",
        target="LanguageModule.setup_embeddings_and_output_layer",
        lines=(244,),
        expects=("weight.data = weight.data.cuda()",),
        kind="tensor-cuda",
        when=CUDA_ABSENT,
        why="PP>1 with tied embeddings moves the word embedding with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-optimizer",
        module=MEGATRON_CORE + "optimizer.optimizer",
        target="MegatronOptimizer",
        lines=(375, 380),
        expects=("p.data.cuda()",),
        kind="tensor-cuda",
        when=CUDA_ABSENT,
        why="optimizer state reload moves tensors with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-distopt",
        module=MEGATRON_CORE + "optimizer.distrib_optimizer",
        target="DistributedOptimizer",
        lines=(1089,),
        expects=("send_tensor.cuda()",),
        kind="tensor-cuda",
        when=CUDA_ABSENT,
        why="distributed optimizer state gather moves buffers with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-exchange",
        module=MEGATRON_CORE + "dist_checkpointing.exchange_utils",
        target="",
        lines=(336, 499),
        expects=("all_loaded_tensors[shard_id].cuda()", "local_ten = all_loaded_tensors[shard_id].cuda()"),
        kind="tensor-cuda",
        when=CUDA_ABSENT,
        why="checkpoint load exchange moves tensors with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-utils",
        module=MEGATRON_CORE + "utils",
        target="check_param_hashes_across_dp_replicas",
        lines=(898,),
        expects=("torch.stack(local_param_hashes).cuda()",),
        kind="tensor-cuda",
        when=CUDA_ABSENT,
        why="parameter-hash check moves hashes with .cuda(); a no-op for this module",
    ),
    PatchSite(
        name="tensor-cuda-data",
        module=MEGATRON_CORE + "tensor_parallel.data",
        target="broadcast_data",
        lines=(84,),
        expects=("data[key].cuda()",),
        kind="tensor-cuda",
        when=CUDA_ABSENT,
        why="broadcast_data moves the batch with .cuda(); a no-op for this module",
    ),
)
"""Every Tensor.cuda() / Tensor.type() site; cpu_compat derives the modules that see the CPU behaviour from them."""
