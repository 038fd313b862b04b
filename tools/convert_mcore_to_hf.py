#!/usr/bin/env python
"""Convert a megatron-core dist checkpoint to a Hugging Face model directory.

    python tools/convert_mcore_to_hf.py ckpt/qwen3-30b-a3b-mcore out/qwen3-30b-a3b-hf
    python tools/convert_mcore_to_hf.py outputs/checkpoints/step_00000100 out/hf --hf-dir Qwen/Qwen3-30B-A3B

Reads a checkpoint from tools/convert_hf_to_mcore.py or a training
step_XXXXXXXX directory (saved from any layout; a checkpoint root with a
`latest` file means its newest step). config.json, generation config and
tokenizer files come from CKPT_DIR/hf, or --hf-dir, or the training run's
model.path. Writes safetensors shards of at most --max-shard-size with
model.safetensors.index.json; one process, memory near one --bucket-size.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

try:
    import megatron_rl  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt_dir", help="megatron dist checkpoint directory (or a training checkpoint root with `latest`)")
    parser.add_argument("out_dir", help="output HF model directory (written to a temporary sibling, renamed when complete)")
    parser.add_argument("--hf-dir", default=None, help="directory with config.json and tokenizer files (default: CKPT_DIR/hf)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    parser.add_argument("--bucket-size", default="1GiB", help="parameters read at a time: the memory bound (default 1GiB)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="output dtype (auto: as stored)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists (only once the new one is complete)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # megatron-core's import-time notes (no Transformer Engine / Apex on this machine, deprecations).
    warnings.filterwarnings("ignore", module=r"megatron\.core")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")
    from megatron_rl.checkpoint.convert import ConversionError, convert_mcore_to_hf
    from megatron_rl.checkpoint.state import CheckpointError
    from megatron_rl.config.core import ConfigError

    try:
        out = convert_mcore_to_hf(
            args.ckpt_dir,
            args.out_dir,
            hf_dir=args.hf_dir,
            max_shard_size=args.max_shard_size,
            bucket_size=args.bucket_size,
            dtype=args.dtype,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (ConversionError, ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote Hugging Face model {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
