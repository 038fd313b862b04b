"""The sites where megatron-core needs collectives gloo lacks: list all_gather / reduce_scatter of uneven sizes.

Without CUDA the backend is gloo, so these apply when CUDA is absent (group 7.
of megatron_rl.parallel.cpu_compat: the alltoall dispatcher with expert
tensor parallelism > 1 gathers and scatters uneven splits). Each function is
wrapped so that uneven sizes go through even collectives instead.
"""

from __future__ import annotations

from megatron_rl.parallel.patch_site import CUDA_ABSENT, MEGATRON_CORE, PatchSite

GLOO_COLLECTIVE_SITES: tuple[PatchSite, ...] = (
    # 7. uneven list all_gather/reduce_scatter on gloo -----------------------------------------
    PatchSite(
        name="uneven-all-gather",
        module=MEGATRON_CORE + "tensor_parallel.mappings",
        target="_gather_along_first_dim",
        lines=(150,),
        expects=("torch.distributed.all_gather(output_tensor_list",),
        kind="function",
        when=CUDA_ABSENT,
        why="(CUDA absent means the gloo backend) gloo's list all_gather rejects uneven sizes ('invalid tensor size'); emulated by "
        "padding + all_gather_into_tensor when output_split_sizes is given",
    ),
    PatchSite(
        name="uneven-reduce-scatter",
        module=MEGATRON_CORE + "tensor_parallel.mappings",
        target="_reduce_scatter_along_first_dim",
        lines=(193,),
        expects=("torch.distributed.reduce_scatter(output, input_tensor_list",),
        kind="function",
        when=CUDA_ABSENT,
        why="(CUDA absent means the gloo backend) gloo has no list reduce_scatter for uneven sizes; emulated by all_reduce + slice",
    ),
)
"""Every uneven-collective site."""
