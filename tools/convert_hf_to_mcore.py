#!/usr/bin/env python
"""Convert a Hugging Face model directory to a megatron-core dist checkpoint.

    python tools/convert_hf_to_mcore.py Qwen/Qwen3-30B-A3B ckpt/qwen3-30b-a3b-mcore
    python tools/convert_hf_to_mcore.py HF_DIR OUT_DIR --target-tp 4 --target-ep 8   # also check a layout

Runs in one process (not under torchrun): the checkpoint holds global tensors
and megatron reshards it at load, so it loads into any TP/PP/EP layout; the
--target-* flags only check that a layout fits the model before writing.
Memory stays near one parameter (see megatron_rl/checkpoint/convert.py).
OUT_DIR also gets hf/ (config.json, generation_config.json, tokenizer files),
which tools/convert_mcore_to_hf.py restores.
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


def parallel_size(text: str) -> int:
    """A --target-* value: a whole number >= 1 (0 is no layout, not 'the default')."""
    try:
        size = int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parallel size: give a whole number >= 1")
    return size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", metavar="HF_DIR", help="HF model directory: config.json + model.safetensors or shards (with or without an index)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="output megatron checkpoint directory (written to a temporary sibling, renamed when complete)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="stored dtype (auto: as in the HF files)")
    parser.add_argument("--target-tp", type=parallel_size, default=None, help="tensor-parallel size to check the model against")
    parser.add_argument("--target-pp", type=parallel_size, default=1, help="pipeline-parallel size to check")
    parser.add_argument("--target-ep", type=parallel_size, default=1, help="expert-parallel size to check")
    parser.add_argument("--target-etp", type=parallel_size, default=None, help="expert tensor-parallel size to check (default: megatron_rl's)")
    parser.add_argument("--max-file-size", default="512MiB", help="size of the checkpoint's data files (default 512MiB); bounds the writer's memory")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists (only once the new one is complete)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # megatron-core's import-time notes (no Transformer Engine / Apex on this machine, deprecations).
    warnings.filterwarnings("ignore", module=r"megatron\.core")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.checkpoint")
    from megatron_rl.checkpoint.convert import ConversionError, convert_hf_to_mcore
    from megatron_rl.checkpoint.state import CheckpointError
    from megatron_rl.config.core import ConfigError
    from megatron_rl.config.schema import ParallelConfig

    targets = []
    if args.target_tp is not None or args.target_pp != 1 or args.target_ep != 1 or args.target_etp is not None:
        targets.append(
            ParallelConfig(
                tensor_parallel=1 if args.target_tp is None else args.target_tp,
                pipeline_parallel=args.target_pp,
                expert_parallel=args.target_ep,
                expert_tensor_parallel=args.target_etp,
            )
        )
    try:
        out = convert_hf_to_mcore(
            args.hf_dir,
            args.out_dir,
            dtype=args.dtype,
            target_layouts=targets,
            max_file_size=args.max_file_size,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (ConversionError, ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote megatron checkpoint {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
