"""The configuration reference page (docs/reference/configuration.md) is the schema's, key for key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Literal

from megatron_rl.config import RLConfig
from megatron_rl.config.reference import allowed_values, reference_markdown, section_table, type_name, yaml_value

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "reference" / "configuration.md"


def test_committed_page_is_the_generated_one():
    assert PAGE.read_text(encoding="utf-8") == reference_markdown(), (
        "docs/reference/configuration.md differs from the schema: run python tools/config_reference.py"
    )


def test_every_key_of_every_section_has_a_row():
    page = PAGE.read_text(encoding="utf-8")
    for section in dataclasses.fields(RLConfig):
        assert f"\n## {section.name}\n" in page
        for f in dataclasses.fields(section.default_factory()):
            assert f"| `{section.name}.{f.name}` |" in page, f"{section.name}.{f.name} missing from the reference"


def test_check_flag_of_the_script(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n")
    script = [sys.executable, str(REPO / "tools" / "config_reference.py"), "--out", str(stale)]
    assert subprocess.run([*script, "--check"], capture_output=True).returncode == 1
    assert subprocess.run(script, capture_output=True).returncode == 0
    assert subprocess.run([*script, "--check"], capture_output=True).returncode == 0


@dataclasses.dataclass(kw_only=True)
class _Example:
    """An example section."""

    mode: Literal["a", "b"] = "a"
    """Which | mode (see `x.<k>`) for <name>."""
    size: int | None = None
    flag: bool = True
    tags: list[str] = dataclasses.field(default_factory=list)


def test_rows_written_out_by_hand():
    assert section_table(_Example, "ex") == [
        "| key | type | default | allowed | description |",
        "| --- | --- | --- | --- | --- |",
        "| `ex.mode` | str | `a` | a, b | Which \\| mode (see `x.<k>`) for &lt;name&gt;. |",
        "| `ex.size` | int \\| None | `null` |  |  |",
        "| `ex.flag` | bool | `true` | true, false |  |",
        "| `ex.tags` | list[str] | `[]` |  |  |",
    ]
    assert type_name(Literal[0, 1, 2]) == "int"
    assert allowed_values(Literal[0, 1, 2], "x") == "0, 1, 2"
    assert allowed_values(bool | None, "x") == "true, false, null"
    assert allowed_values(str, "algorithm.loss") == "dapo, dr_grpo, grpo, gspo, gspo_token, or package.module:function"
    assert yaml_value("") == '""' and yaml_value({"a": [1, None]}) == "{a: [1, null]}"
