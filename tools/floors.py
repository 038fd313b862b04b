#!/usr/bin/env python
"""Print pip constraints that pin each of setup.py's core requirements to its floor (`name>=X` -> `name==X`).

    python tools/floors.py > floors.txt
    pip install -c floors.txt torch && pip install -c floors.txt -e '.[wandb,data,test]'

`make test-floor` runs the suite in such an environment (.venv-floor): the oldest
versions setup.py admits are the ones it is tested on, so a floor is a claim the
suite checks. Reads setup.py's CORE literal without running setup.py.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "setup.py"


def core_requirements(setup: Path = SETUP) -> list[str]:
    """setup.py's CORE list, as written."""
    for node in ast.parse(setup.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "CORE":
            return ast.literal_eval(node.value)
    raise SystemExit(f"{setup}: no CORE list of requirements")


def floor_constraints(requirements: list[str]) -> list[str]:
    """`name==X` for each `name>=X`; a requirement without a floor is refused (nothing to test it at)."""
    lines = []
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)>=([0-9][0-9A-Za-z.]*)", requirement.replace(" ", ""))
        if match is None:
            raise SystemExit(f"setup.py: core requirement {requirement!r} has no single floor (name>=X): give it one")
        lines.append(f"{match[1]}=={match[2]}")
    return lines


def main() -> int:
    print("\n".join(floor_constraints(core_requirements())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
