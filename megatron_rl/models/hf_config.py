"""Read a Hugging Face `config.json` into the numbers megatron-core needs.

`parse_hf_config` finds the config's family in the registry
(megatron_rl.models.families, by HF model_type) and lets the family turn the raw
dict into an `HFArch`: one validated record per model with the same fields for
every family, so code outside the families never looks at family-specific keys.
Everything megatron cannot reproduce exactly (a sliding window, biases on the
output projection, an activation other than SiLU, ...) is refused by the family
with the offending key and value, before any process group or model exists.

HFArch and the helpers the families parse with live one layer below, in
models/arch.py (the families import them from there). This module and the
registry import neither torch nor megatron-core: the planner uses them on
machines without either.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from megatron_rl.config.core import read_json_file
from megatron_rl.config.layout import ModelShape
from megatron_rl.models.arch import HFArch, UnsupportedModelError, fail
from megatron_rl.models.families import family_of


def load_hf_config(model_dir: str | os.PathLike) -> dict:
    """config.json of an HF model directory as a dict, with errors that name the path and the fix."""
    path = Path(model_dir)
    if not str(model_dir):
        raise UnsupportedModelError("model.path is empty: set model.path=<directory with config.json and *.safetensors>")
    if not path.exists():
        raise UnsupportedModelError(
            f"model.path={str(path)!r} does not exist: set model.path to a Hugging Face model directory (config.json, "
            "*.safetensors, tokenizer), e.g. one downloaded with `huggingface-cli download <repo> --local-dir <dir>` or "
            "converted from a megatron checkpoint with tools/convert_mcore_to_hf.py; with a tiny preset, "
            "model.make_tiny=true builds a tiny random model there"
        )
    if path.is_file():
        if path.name != "config.json":
            raise UnsupportedModelError(f"model path {str(path)!r} is a file: point model.path at the directory holding config.json")
        path = path.parent
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UnsupportedModelError(f"{str(path)!r} has no config.json: it is not a Hugging Face model directory")
    data = read_json_file(config_file, UnsupportedModelError, "re-download or re-export the model")
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{str(config_file)!r} holds a {type(data).__name__}, not a JSON object")
    return data


def parse_hf_config(hf_config: dict, source: str = "config.json") -> HFArch:
    """Validate an HF config dict and return its family-independent description."""
    if not isinstance(hf_config, dict):
        raise UnsupportedModelError(f"{source}: expected a JSON object, got {type(hf_config).__name__}")
    return family_of(hf_config, source).parse(hf_config, source)


def refuse_quantized(hf_config: dict, source: str) -> None:
    """Weights stored quantized (e.g. DeepSeek-V3's published fp8 blocks) cannot be loaded: the error says so.

    The shape is still planned from such a config.json; only reading its weights is refused.
    """
    quantization = hf_config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise fail(source, f"quantization_config (quant_method={method!r}) is set: megatron_rl loads bf16/fp16/fp32 weights; dequantize the checkpoint to bf16 first")


def model_shape(hf_config: dict) -> ModelShape:
    """The numbers a parallel layout must divide (for megatron_rl.config.check_layout)."""
    arch = parse_hf_config(hf_config)
    return ModelShape(**{field.name: getattr(arch, field.name) for field in dataclasses.fields(ModelShape)})  # named alike


def padded_vocab_size(vocab_size: int, tensor_parallel: int, divisible_by: int = 128) -> int:
    """megatron's vocabulary padding: the next multiple of divisible_by x TP (e.g. 151,936 -> 152,064 at TP 4)."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


__all__ = [  # HFArch and UnsupportedModelError live in models.arch (below the families); named here for callers
    "HFArch", "UnsupportedModelError", "load_hf_config", "model_shape", "padded_vocab_size",
    "parse_hf_config", "refuse_quantized",
]
