"""The layout planner: check a preset against its cluster and estimate memory, without GPUs.

    megatron-rl plan --config configs/qwen3-30b-a3b-gspo-4x8h100.yaml

launch: trainer nodes and processes per node (all the launch scripts need);
model_spec: a config.json's shape and parameter counts; memory: bytes per
device; planner: the checks and the Plan; report: loading and printing.
Names are imported on first use, so the launch scripts' `--launch-env` never
loads the model code.
"""

from megatron_rl.extras import lazy_exports

_EXPORTS = {
    "LaunchShape": "launch",
    "launch_env": "launch",
    "launch_shape": "launch",
    "ModelSpec": "model_spec",
    "read_hf_config": "model_spec",
    "spec_from_hf_config": "model_spec",
    "Plan": "planner",
    "plan": "planner",
    "load_spec": "report",
    "plan_preset": "report",
    "render": "report",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
