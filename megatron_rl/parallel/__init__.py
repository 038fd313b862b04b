"""Parallel context: the only place that initialises torch.distributed and megatron-core's parallel state.

    ctx = init_parallel(cfg.parallel, shape=shape, num_microbatches=n)
    ...                      # pass ctx explicitly
    destroy_parallel(ctx)

On a CPU-only torch build init_parallel applies the megatron-core CPU
compatibility layer (cpu_compat) before megatron runs anything.
"""

from megatron_rl.parallel.context import (
    ParallelContext,
    destroy_parallel,
    find_free_port,
    init_parallel,
    seed_all,
)
from megatron_rl.parallel.cpu_compat import (
    PatchSite,
    PatchTargetError,
    apply_cpu_compat,
    check_patch_targets,
    cuda_absent,
)

__all__ = [
    "ParallelContext",
    "PatchSite",
    "PatchTargetError",
    "apply_cpu_compat",
    "check_patch_targets",
    "cuda_absent",
    "destroy_parallel",
    "find_free_port",
    "init_parallel",
    "seed_all",
]
