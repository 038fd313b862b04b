#!/usr/bin/env python
"""Rewrite the rank files of a training checkpoint saved by an older megatron_rl so a resume loads them.

    python tools/convert_rank_state.py outputs/checkpoints/step_00000100 [more step directories ...]

Resume reads rank_XXXXX.pt with torch.load(weights_only=True): tensors and
plain values only, since unpickling anything else can run code. Older files
held numpy's generator state as a numpy array; this stores it as a tensor.
It unpickles the old files in full: run it only on checkpoints you wrote
yourself. Files already loadable are left alone; each is replaced atomically.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import megatron_rl  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt_dirs", nargs="+", help="step_XXXXXXXX directories of a training checkpoint")
    args = parser.parse_args(argv)
    from megatron_rl.checkpoint.no_code import convert_rank_files

    for ckpt_dir in map(Path, args.ckpt_dirs):
        if not sorted(ckpt_dir.glob("rank_*.pt")):
            print(f"convert_rank_state: {ckpt_dir} holds no rank_*.pt files: give a step_XXXXXXXX directory", file=sys.stderr)
            return 2
        converted = convert_rank_files(ckpt_dir)
        print(f"{ckpt_dir}: {len(converted)} rank file(s) converted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
