"""The README stays a short front page whose links land on pages and headings of the documentation site."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def slug(heading: str) -> str:
    """The anchor mkdocs (markdown's toc extension) gives a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    in_block, found = False, set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_block = not in_block
        elif not in_block and (match := re.match(r"#{1,6} (.+)", line)):
            found.add(slug(match.group(1)))
    return found


def test_slug_worked_by_hand():
    assert slug("Checking a machine: `megatron-rl doctor`") == "checking-a-machine-megatron-rl-doctor"
    assert slug("Batches at scale: shares, packed sequences") == "batches-at-scale-shares-packed-sequences"


def test_readme_is_short_and_its_links_land():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 150
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert len(links) >= 10, links
    for path, anchor in links:
        assert (REPO / path).is_file(), f"README links to {path}, which does not exist"
        if anchor:
            assert anchor in anchors(REPO / path), f"README links to {path}#{anchor}: no such heading"


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


class _MkdocsLoader(yaml.SafeLoader):
    """mkdocs.yml's own tags (!ENV [NAME, default]) read as their default: only its navigation is read here."""


_MkdocsLoader.add_constructor("!ENV", lambda loader, node: None)


def test_every_page_is_in_the_navigation_and_the_named_sections_exist():
    nav = _nav_pages(yaml.load((REPO / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_MkdocsLoader)["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    for page, heading in [("getting-started.md", "supported-platforms"), ("cluster.md", "failures-pre-emption-and-time-limits"),
                          ("weight-sync.md", "authentication"), ("performance/index.md", "gpu")]:
        assert heading in anchors(DOCS / page), f"{page} lost its section {heading}"


def test_results_section_written_out_by_hand(tmp_path):
    """tools/perf_tables.py on a results file made up here: its device and date, scalars, a record table."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("perf_tables", REPO / "tools" / "perf_tables.py")
    perf_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf_tables)
    path = tmp_path / "toy.json"
    path.write_text('{"device": "cpu", "date": "2026-01-02", "model": {"layers": 2}, "ratio": 0.123456,'
                    ' "runs": {"a": {"s": 1, "x": {"y": 2}}, "b": {"s": 3}}, "console": "l1\\nl2"}')
    assert perf_tables.file_section(path) == [
        "## toy", "", "`bench/results/toy.json`: device cpu; recorded 2026-01-02.", "",
        "| key | value |", "| --- | --- |", "| model.layers | 2 |", "| ratio | 0.1235 |", "",
        "**console**", "", "```", "l1\nl2", "```", "",
        "**runs**", "", "| | s | x.y |", "| --- | --- | --- |", "| a | 1 | 2 |", "| b | 3 |  |", "",
    ]
