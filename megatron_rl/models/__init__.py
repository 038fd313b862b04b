"""Models: HF config.json -> megatron-core GPT on any TP/PP/EP/DP layout, and the HF <-> megatron weight mapping.

    from megatron_rl.models import build_model, export_hf_weights, model_shape

    shape = model_shape(load_hf_config(cfg.model.path))            # validate a layout before process groups
    ctx = init_parallel(cfg.parallel, shape=shape)
    chunks = build_model(cfg.model, ctx, wrap_ddp=True)            # loads cfg.model.path's safetensors
    for bucket in export_hf_weights(chunks, ctx, bucket_bytes=512 << 20):
        ...                                                        # HF-named tensors on rank 0

Families: one module each under families/, registered by HF model_type (families.FAMILIES).
One mapping (mapping.py, with each family's layer names) serves loading, export/weight sync and the converters.
Names are imported on first use: the config parser (hf_config) needs no torch, so
`megatron-rl plan` runs where torch is not installed; build_model imports megatron-core.
"""

from megatron_rl.extras import lazy_exports

_EXPORTS = {
    "ModelInfo": "info",
    "build_model": "build",
    "hf_to_transformer_config": "build",
    "model_info": "info",
    "resolve_dtype": "build",
    "use_transformer_engine": "build",
    "export_hf_state_dict": "export",
    "export_hf_weights": "export",
    "FAMILIES": "families",
    "Family": "families",
    "family_of": "families",
    "get_family": "families",
    "HFArch": "hf_config",
    "UnsupportedModelError": "hf_config",
    "load_hf_config": "hf_config",
    "model_shape": "hf_config",
    "padded_vocab_size": "hf_config",
    "parse_hf_config": "hf_config",
    "SafetensorsCheckpoint": "loading",
    "check_checkpoint_names": "loading",
    "load_hf_weights": "loading",
    "GlobalNamer": "mapping",
    "Shard": "mapping",
    "expected_hf_names": "mapping",
    "global_mcore_names": "mapping",
    "hf_to_mcore_names": "mapping",
    "is_expert_param": "mapping",
    "mapping_for": "mapping",
    "unwrap_model": "mapping",
    "make_tiny_model_dir": "tiny",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
