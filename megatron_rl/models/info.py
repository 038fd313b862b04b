"""What export, loading and weight sync need to know about a built model: ModelInfo, attached to each chunk.

    chunks = build_model(cfg.model, ctx)       # models.build attaches `.hf_info` to every chunk
    info = model_info(chunks)                   # through DDP / Float16Module wrappers

Below build.py and loading.py, which both use it (build_model loads the HF
weights through loading.load_hf_weights, which checks them against the info).
"""

from __future__ import annotations

import dataclasses

from megatron_rl.models.arch import HFArch


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What export and loading need to know about a built model, attached to each chunk as `.hf_info`."""

    arch: HFArch
    """The validated HF description."""
    hf_config: dict
    """config.json as read."""
    padded_vocab_size: int
    """Rows of megatron's embedding/output layer (vocab padded to a multiple of 128 x TP)."""
    use_te: bool
    """Built with the Transformer Engine spec."""


def model_info(chunks: list) -> ModelInfo:
    """The ModelInfo build_model attached to a model (through DDP wrappers)."""
    for chunk in chunks:
        module = chunk
        while module is not None:
            info = getattr(module, "hf_info", None)
            if info is not None:
                return info
            module = getattr(module, "module", None)
    raise ValueError("model chunks carry no hf_info: build them with megatron_rl.models.build_model")
