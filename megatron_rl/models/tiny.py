"""Tiny random Hugging Face model directories, built locally (no model hub).

Tests and the CPU demo need real models in real formats: a `config.json`,
`model.safetensors` written by transformers, and a tokenizer that both
transformers and vLLM load. This module makes them from a config and a seed:

    make_tiny_model_dir("outputs/tiny-moe", family="qwen3_moe")

The tokenizer is a sentencepiece model trained here on a small synthetic
corpus, wrapped as an HF `LlamaTokenizer` directory (with transformers 5.x,
`LlamaTokenizer(vocab_file=...)` silently encodes everything to an empty list;
a directory with `tokenizer.model` + `tokenizer_config.json` loaded through
AutoTokenizer encodes exactly as sentencepiece does).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any

# Sizes: vLLM's CPU attention needs head_dim >= 32 (16 is rejected).
_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "dtype": "float32",
}


def _tiny_configs() -> dict[str, dict[str, Any]]:
    from megatron_rl.models.families import FAMILIES as REGISTERED

    return {
        name: {"architectures": [family.architectures[0]], "model_type": name, **family.tiny_config}
        for name, family in REGISTERED.items()
    }


FAMILIES: dict[str, dict[str, Any]] = _tiny_configs()
"""Family (HF model_type) -> config.json keys of its tiny model beyond the common sizes (from each family's tiny_config)."""

SPECIAL_TOKENS = {"unk": 0, "bos": 1, "eos": 2, "pad": 3}


def synthetic_corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Lines of digits, letters, arithmetic and words: what the demo's tasks are made of."""
    rng = random.Random(seed)
    words = ["sort", "reverse", "copy", "the", "letters", "digits", "answer", "sum", "of", "is", "count", "add"]
    lines = []
    for _ in range(num_lines):
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))))
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"{a} + {b} = {a + b}")
        elif kind == 2:
            lines.append(" ".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 10))))
        else:
            lines.append("".join(rng.choice(string.digits) for _ in range(rng.randint(2, 12))))
    # Every printable ASCII character appears, so no ASCII text maps to <unk>
    # (HF's converted fast tokenizer and sentencepiece treat <unk> differently).
    lines += [" ".join(string.punctuation), " ".join(string.ascii_uppercase)] * 20
    return lines


def build_sentencepiece_model(out_file: str | os.PathLike, vocab_size: int = 256, seed: int = 0) -> Path:
    """Train a BPE sentencepiece model on the synthetic corpus (unseen characters map to <unk>)."""
    import sentencepiece as spm

    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(synthetic_corpus(seed=seed)) + "\n")
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(Path(tmp) / "sp"),
            vocab_size=vocab_size,
            model_type="bpe",
            character_coverage=1.0,
            byte_fallback=False,
            split_digits=True,
            unk_id=SPECIAL_TOKENS["unk"],
            bos_id=SPECIAL_TOKENS["bos"],
            eos_id=SPECIAL_TOKENS["eos"],
            pad_id=SPECIAL_TOKENS["pad"],
            hard_vocab_limit=False,  # the corpus is small: take as many pieces as it yields
            num_threads=1,
            minloglevel=2,
        )
        shutil.copyfile(Path(tmp) / "sp.model", out_file)
    return out_file


def write_hf_tokenizer_dir(sp_model: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Wrap a sentencepiece model as an HF tokenizer directory that transformers and vLLM load."""
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(sp_model, Path(tmp) / "tokenizer.model")
        (Path(tmp) / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "LlamaTokenizer",
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "unk_token": "<unk>",
                    "pad_token": "<pad>",
                    "add_bos_token": False,
                    "add_eos_token": False,
                    "legacy": False,
                    "model_max_length": _COMMON["max_position_embeddings"],
                }
            )
        )
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        tokenizer.save_pretrained(out_dir)
    shutil.copyfile(sp_model, out_dir / "tokenizer.model")
    return out_dir


def tiny_hf_config(family: str = "qwen3_moe", vocab_size: int = 256, **overrides: Any) -> dict[str, Any]:
    """The config.json contents of a tiny model of `family`, with `overrides` applied."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; valid: {sorted(FAMILIES)}")
    config = {**_COMMON, **FAMILIES[family], "vocab_size": vocab_size}
    config.update(bos_token_id=SPECIAL_TOKENS["bos"], eos_token_id=SPECIAL_TOKENS["eos"], pad_token_id=SPECIAL_TOKENS["pad"])
    config.update(overrides)
    return config


def make_tiny_model_dir(
    out_dir: str | os.PathLike,
    family: str = "qwen3_moe",
    *,
    seed: int = 0,
    vocab_size: int = 256,
    init_std: float = 0.02,
    with_tokenizer: bool = True,
    max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write config.json, model.safetensors (random, fp32) and a tokenizer to `out_dir`.

    max_shard_size (e.g. "100KB") writes several safetensors shards plus
    model.safetensors.index.json, as large checkpoints come.

    Written to a temporary sibling and renamed, so an interrupted build never
    leaves a half-written model directory behind.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        if with_tokenizer:
            # The model's vocabulary is exactly the tokenizer's, so every id it can sample decodes.
            import sentencepiece as spm

            sp_model = build_sentencepiece_model(tmp_dir / "sp.model", vocab_size=vocab_size, seed=seed)
            vocab_size = spm.SentencePieceProcessor(model_file=str(sp_model)).get_piece_size()
            write_hf_tokenizer_dir(sp_model, tmp_dir)
            sp_model.unlink()
        config_dict = tiny_hf_config(family, vocab_size, initializer_range=init_std, **config_overrides)
        config = AutoConfig.for_model(**config_dict)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        from megatron_rl.models.families import get_family

        with torch.no_grad():
            get_family(family).randomise_tiny(model, torch.Generator().manual_seed(seed))
        shard_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(tmp_dir, safe_serialization=True, **shard_kwargs)
        GenerationConfig(
            bos_token_id=SPECIAL_TOKENS["bos"], eos_token_id=SPECIAL_TOKENS["eos"], pad_token_id=SPECIAL_TOKENS["pad"]
        ).save_pretrained(tmp_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def ensure_tiny_model_dir(out_dir: str | os.PathLike, family: str, *, seed: int = 0) -> bool:
    """Build a tiny model at `out_dir` unless it exists; True when this call built it.

    Every rank of a job may call this at once: one builds under a lock file beside
    the directory while the others wait, then find the finished directory (the
    build renames a complete temporary directory into place).
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        return False
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out_dir.exists():
            return False
        make_tiny_model_dir(out_dir, family, seed=seed)
    return True


def preset_model_path(config_path: str | os.PathLike | None) -> str | None:
    """The `model.path` a preset file gives (its defaults included), before command-line overrides."""
    if not config_path:
        return None
    from megatron_rl.config.core import load_yaml_preset

    model = load_yaml_preset(config_path).get("model")
    path = model.get("path") if isinstance(model, dict) else None
    return path if isinstance(path, str) else None


def tiny_family_to_build(model: Any, preset_path: str | None) -> str:
    """The family of the tiny random model to build at `model.path` before a run, '' for none.

    Only a missing directory, and only at the path the preset itself names next to
    `model.make_tiny_if_missing` (`preset_path`), or anywhere with `model.make_tiny=true`:
    a mistyped `model.path=...` must stop with an error, never train a random model.
    model: a ModelConfig.
    """
    if not model.path or Path(model.path).exists():
        return ""
    if model.make_tiny:
        return model.make_tiny_if_missing or "qwen3_moe"
    if model.make_tiny_if_missing and preset_path is not None and model.path == preset_path:
        return model.make_tiny_if_missing
    return ""
