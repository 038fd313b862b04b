"""The site's formulas: arithmatex's markup becomes MathML at build time (tools/mkdocs_math.py), and a formula that
would not render stops the build naming the page."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.extra("docs", "latex2mathml", "markdown", "pymdownx")


def hook():
    spec = importlib.util.spec_from_file_location("mkdocs_math", REPO / "tools" / "mkdocs_math.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Page:
    class file:
        src_path = "algorithms.md"


def render(markdown_text: str) -> str:
    import markdown

    html = markdown.markdown(markdown_text, extensions=["pymdownx.arithmatex"], extension_configs={"pymdownx.arithmatex": {"generic": True}})
    return hook().on_page_content(html, page=Page)


def test_inline_and_display_formulas_become_mathml():
    html = render("Ratio $r < 1$ here.\n\n$$\ns_i = \\frac{1}{|y_i|} \\sum_t \\log r_t\n$$\n")
    assert '<span class="arithmatex"><math xmlns="http://www.w3.org/1998/Math/MathML" display="inline">' in html
    assert '<div class="arithmatex"><math xmlns="http://www.w3.org/1998/Math/MathML" display="block">' in html
    assert "<mfrac>" in html and "&#x0003C;" in html  # the fraction, and the < that arithmatex escaped, as MathML
    assert "\\(" not in html and "\\[" not in html


@pytest.mark.parametrize("formula, says", [("$\\frac{1}{$", "does not convert"), ("$\\notacommand{x}$", "uses \\notacommand")])
def test_a_formula_that_would_not_render_stops_the_build_naming_the_page(formula, says):
    with pytest.raises(ValueError, match="algorithms.md") as raised:
        render(formula)
    assert says in str(raised.value)
