"""Parallel context: the only place that initialises torch.distributed and megatron-core's parallel state.

    ctx = init_parallel(cfg.parallel, shape=shape, num_microbatches=n)
    ...                      # pass ctx explicitly
    destroy_parallel(ctx)

init_parallel applies the megatron-core compatibility layer (cpu_compat.apply_compat:
the sites whose conditions hold on this platform's Availability -- all of them on
a CPU build, the Transformer-Engine-absent ones on a GPU without TE) before
megatron runs anything.
"""

from megatron_rl.parallel.context import (
    ParallelContext,
    destroy_parallel,
    init_parallel,
    seed_all,
)
from megatron_rl.parallel.availability import Availability, detect
from megatron_rl.parallel.cpu_compat import (
    PatchSite,
    PatchTargetError,
    apply_compat,
    apply_cpu_compat,
    check_patch_targets,
    cuda_absent,
)

__all__ = [
    "Availability",
    "ParallelContext",
    "PatchSite",
    "PatchTargetError",
    "apply_compat",
    "apply_cpu_compat",
    "check_patch_targets",
    "cuda_absent",
    "destroy_parallel",
    "detect",
    "init_parallel",
    "seed_all",
]
