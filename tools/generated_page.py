"""The command line of a script that writes a generated documentation page, or checks the committed one.

    sys.exit(page_main(argv, doc=__doc__, page=PAGE, generate=results_markdown, source="bench/results",
                       command="python tools/perf_tables.py"))
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def page_main(argv: list[str] | None, *, doc: str, page: Path, generate: Callable[[], str], source: str, command: str) -> int:
    """--out PATH (default `page`) is written from generate(); with --check, exit 1 when it differs, naming `command`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=page, help="where to write the page (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        if not args.out.exists() or args.out.read_text(encoding="utf-8") != text:
            print(f"{args.out} differs from {source}: run {command}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0
