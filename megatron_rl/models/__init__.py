"""Models: HF config.json -> megatron-core GPT on any TP/PP/EP/DP layout, and the HF <-> megatron weight mapping.

    from megatron_rl.models import build_model, export_hf_weights, model_shape

    shape = model_shape(load_hf_config(cfg.model.path))            # validate a layout before process groups
    ctx = init_parallel(cfg.parallel, shape=shape)
    chunks = build_model(cfg.model, ctx, wrap_ddp=True)            # loads cfg.model.path's safetensors
    for bucket in export_hf_weights(chunks, ctx, bucket_bytes=512 << 20):
        ...                                                        # HF-named tensors on rank 0

Families: llama, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral (hf_config.FAMILIES).
One mapping (mapping.py) serves loading, export/weight sync and the converters.
Importing this package does not import megatron-core (build_model does).
"""

from megatron_rl.models.build import (
    ModelInfo,
    build_model,
    hf_to_transformer_config,
    model_info,
    resolve_dtype,
    use_transformer_engine,
)
from megatron_rl.models.export import export_hf_state_dict, export_hf_weights
from megatron_rl.models.hf_config import (
    FAMILIES,
    HFArch,
    UnsupportedModelError,
    detect_family,
    load_hf_config,
    model_shape,
    padded_vocab_size,
    parse_hf_config,
)
from megatron_rl.models.loading import SafetensorsCheckpoint, check_checkpoint_names, load_hf_weights
from megatron_rl.models.mapping import (
    GlobalNamer,
    Shard,
    expected_hf_names,
    global_mcore_names,
    hf_to_mcore_names,
    is_expert_param,
    mapping_for,
    unwrap_model,
)
from megatron_rl.models.tiny import make_tiny_model_dir

__all__ = [
    "FAMILIES",
    "GlobalNamer",
    "HFArch",
    "ModelInfo",
    "SafetensorsCheckpoint",
    "Shard",
    "UnsupportedModelError",
    "build_model",
    "check_checkpoint_names",
    "detect_family",
    "expected_hf_names",
    "export_hf_state_dict",
    "export_hf_weights",
    "global_mcore_names",
    "hf_to_mcore_names",
    "hf_to_transformer_config",
    "is_expert_param",
    "load_hf_config",
    "load_hf_weights",
    "make_tiny_model_dir",
    "mapping_for",
    "model_info",
    "model_shape",
    "padded_vocab_size",
    "parse_hf_config",
    "resolve_dtype",
    "unwrap_model",
    "use_transformer_engine",
]
