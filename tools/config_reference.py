#!/usr/bin/env python
"""Write the configuration reference page from the schema (megatron_rl.config.reference).

    python tools/config_reference.py            # -> docs/reference/configuration.md
    python tools/config_reference.py --check    # exit 1 when the committed page differs

Run it after changing a field of megatron_rl/config (a unit test fails until the page is regenerated).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from generated_page import page_main  # noqa: E402  (tools/, beside this script)

from megatron_rl.config.reference import reference_markdown  # noqa: E402

PAGE = REPO / "docs" / "reference" / "configuration.md"


def main(argv: list[str] | None = None) -> int:
    return page_main(argv, doc=__doc__, page=PAGE, generate=reference_markdown, source="the schema",
                     command="python tools/config_reference.py")


if __name__ == "__main__":
    sys.exit(main())
