#!/usr/bin/env python
"""Write multi-step arithmetic word problems as train.jsonl and heldout.jsonl (disjoint prompts, fixed seeds).

    python tools/prepare_arithmetic.py outputs/quickstart/data
    python tools/prepare_arithmetic.py data/arith --train-size 5000 --heldout-size 500 --steps 2 3 4

Rows are {"prompt", "answer", "data_source"} (megatron_rl.data.dataset's schema; train with data.reward=math and
data.apply_chat_template=true). The same arguments always write the same files. The library is
megatron_rl/data/arithmetic.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import megatron_rl  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.data.arithmetic import HELDOUT_SEED, TRAIN_SEED, ArithmeticDataError, write_arithmetic_splits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="directory for train.jsonl and heldout.jsonl")
    parser.add_argument("--train-size", type=int, default=2000, help="training problems (default 2000)")
    parser.add_argument("--heldout-size", type=int, default=200, help="held-out problems (default 200)")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2], help="operations per problem, drawn in turn (default 1 2)")
    parser.add_argument("--train-seed", type=int, default=TRAIN_SEED, help=f"seed of the training split (default {TRAIN_SEED})")
    parser.add_argument("--heldout-seed", type=int, default=HELDOUT_SEED, help=f"seed of the held-out split (default {HELDOUT_SEED})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        paths = write_arithmetic_splits(args.out_dir, args.train_size, args.heldout_size, steps=tuple(args.steps),
                                        train_seed=args.train_seed, heldout_seed=args.heldout_seed)
    except ArithmeticDataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.train_size} training problems to {paths['train']} and {args.heldout_size} held-out ones to {paths['heldout']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
