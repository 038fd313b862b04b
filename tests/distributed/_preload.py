"""Imported once by the test harness's forkserver, so that forked ranks start with these loaded.

Importing megatron-core and the modules the CPU layer patches costs ~6 s per
process; paid here once per test session instead of once per rank per launch.
Nothing here starts threads or process groups (forking must stay safe). The imported heap is frozen at the end.
"""

import gc
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch  # noqa: F401

    try:
        import megatron.core  # noqa: F401
        import megatron.core.dist_checkpointing  # noqa: F401
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401

        import megatron_rl.parallel  # noqa: F401
        from megatron_rl.parallel.cpu_compat import apply_cpu_compat

        apply_cpu_compat()  # the sites whose conditions hold (the harness hides CUDA from its ranks); idempotent
    except ImportError:  # a test without megatron still runs, just slower to start
        pass

    try:  # the weight groups' rendezvous (weight_sync.broadcast.open_group) and the engine-worker stand-in
        import vllm.distributed.utils  # noqa: F401

        import megatron_rl.rollout.worker_ext  # noqa: F401
        import tests.worker_process  # noqa: F401
    except ImportError:
        pass

# What was imported here (about 450k objects) lives as long as every rank forked from here: frozen, a rank's full
# collections (actor.close, megatron's optimizer state dict, the interpreter's own) pass it by. Unfrozen, they took
# 35-47% of a rank's time in the layout and replay tests (7.1 of 15.0 s on one rank); frozen, 0.2 s.
gc.freeze()
