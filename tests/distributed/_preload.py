"""Imported once by the test harness's forkserver, so that forked ranks start with these loaded.

Importing megatron-core and the modules the CPU layer patches costs ~6 s per
process; paid here once per test session instead of once per rank per launch.
Nothing here starts threads or process groups (forking must stay safe).
"""

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
