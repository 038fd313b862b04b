#!/usr/bin/env python
"""Write the configuration reference page from the schema (megatron_rl.config.reference).

    python tools/config_reference.py            # -> docs/reference/configuration.md
    python tools/config_reference.py --check    # exit 1 when the committed page differs

Run it after changing a field of megatron_rl/config (a unit test fails until the page is regenerated).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl.config.reference import reference_markdown  # noqa: E402

PAGE = REPO / "docs" / "reference" / "configuration.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=PAGE, help="where to write the page (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    text = reference_markdown()
    if args.check:
        if not args.out.exists() or args.out.read_text(encoding="utf-8") != text:
            print(f"{args.out} differs from the schema: run python tools/config_reference.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
