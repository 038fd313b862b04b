"""mkdocs hook: the formulas arithmatex marks up (`$...$`, `$$...$$`) become MathML when the site is built.

    hooks: [tools/mkdocs_math.py]            # mkdocs.yml, beside pymdownx.arithmatex with generic: true

Browsers draw MathML themselves (MathML Core: Chromium 109+, Firefox, Safari), so a page needs no
script and no content network: the site reads the same offline, on a cluster's login node. A formula
latex2mathml cannot convert fails the build, naming the page and the formula.
"""

from __future__ import annotations

import html
import re

# arithmatex's generic output: \( ... \) in a span for inline math, \[ ... \] in a div for a block
_INLINE = re.compile(r'<span class="arithmatex">\\\((.+?)\\\)</span>', re.DOTALL)
_BLOCK = re.compile(r'<div class="arithmatex">\\\[(.+?)\\\]</div>', re.DOTALL)


def latex_to_mathml(latex: str, *, block: bool, where: str) -> str:
    """One formula (HTML-escaped, as arithmatex leaves it) as a <math> element."""
    from latex2mathml.converter import convert

    source = html.unescape(latex).strip()
    try:
        mathml = convert(source, display="block" if block else "inline")
    except Exception as err:  # noqa: BLE001 - latex2mathml raises its own error types
        raise ValueError(f"{where}: formula {source!r} does not convert to MathML ({err!r}); rewrite it") from None
    unknown = re.findall(r">(\\[A-Za-z]+)<", mathml)  # a command latex2mathml does not know is left as its text
    if unknown:
        raise ValueError(f"{where}: formula {source!r} uses {', '.join(unknown)}, which MathML would show as text; rewrite it")
    return mathml


def on_page_content(content: str, page, **_) -> str:
    where = getattr(getattr(page, "file", None), "src_path", "a page")
    content = _BLOCK.sub(lambda m: f'<div class="arithmatex">{latex_to_mathml(m[1], block=True, where=where)}</div>', content)
    return _INLINE.sub(lambda m: f'<span class="arithmatex">{latex_to_mathml(m[1], block=False, where=where)}</span>', content)
