"""Every command the documentation shows does what it says, every `section.key` it names is a key, and it
speaks of the product only (the checks: tests/unit/docs_check.py). Each check is first shown to catch a
planted mistake: a false make target, a false subcommand flag, a false key, a preset shown without the
model it needs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.unit.docs_check import (
    REPO,
    Command,
    command_problems,
    console_problems,
    development_words,
    page_commands,
    preset_commands,
    schema_keys,
    unknown_keys,
    unlabelled_command_blocks,
)

PAGES = sorted([*(REPO / "docs").rglob("*.md"), REPO / "README.md", REPO / "launch" / "README.md", REPO / "tools" / "README.md"])
GENERATED = {REPO / "docs" / "reference" / "configuration.md", REPO / "docs" / "performance" / "results.md"}
"""Written by tools/ from the schema and from bench/results/ (their own tests keep them true)."""
PRESETS = sorted((REPO / "configs").glob("*.yaml"))

SHOWN_AS_MISTAKES = {("troubleshooting.md", "optimizer.learning_rate")}
"""Keys a page shows on purpose as what a user might mistype (with the error the run prints)."""


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.fixture(scope="module")
def keys() -> set[str]:
    return schema_keys()


# ---- the checks catch what they are for --------------------------------------------------------------------


def test_the_checks_catch_a_planted_false_command_flag_key_and_preset(keys, tmp_path):
    page = tmp_path / "planted.md"
    page.write_text(
        "```bash\n"
        "make demo-nothing                       # no such target\n"
        "megatron-rl plan --config configs/tiny-gspo.yaml --no-such-flag\n"
        "megatron-rl train --config configs/tiny-gspo.yaml train.no_such_key=1\n"
        "launch/torchrun.sh configs/qwen3-30b-a3b-gspo-1x8h100.yaml \\\n"
        "    data.path=/data/prompts.parquet     # the model is missing\n"
        "python -m megatron_rl.elastic --no-such-option\n"
        "```\n"
        "The `rollout.no_such_key` key, and `megatron_rl/rollout/prompts.py` (a file, not a key).\n"
    )
    commands = page_commands(page)
    assert [c.argv[0] for c in commands] == ["make", "megatron-rl", "megatron-rl", "launch/torchrun.sh", "python"]
    problems = {str(c): command_problems(c, keys) for c in commands}
    assert all(problems.values()), problems
    assert "make -n exits" in problems[str(commands[0])][0]
    assert "train.no_such_key is not a config key" in problems[str(commands[2])]
    assert "model.path=" in problems[str(commands[3])][0] and "no *.safetensors" in problems[str(commands[3])][0]
    assert "--no-such-option is not an option" in problems[str(commands[4])][0]
    assert unknown_keys(page.read_text(), keys) == [(4, "train.no_such_key"), (9, "rollout.no_such_key")]


def test_the_checks_pass_a_command_that_works(keys):
    good = [Command("here", ("make", "-n", "docs")),
            Command("here", ("megatron-rl", "train", "--config", "configs/tiny-gspo.yaml", "model.path=outputs/demo/model")),
            Command("here", ("megatron-rl", "plan", "--config", "configs/qwen3-30b-a3b-gspo-4x8h100.yaml"))]
    assert {str(c): command_problems(c, keys) for c in good} == {str(c): [] for c in good}


def test_development_words_are_found():
    text = "Measured when a GPU was lent.\nThe 2x goal is not reached.\nA clean line.\nRed two stops earlier."
    assert [n for n, _ in development_words(text)] == [1, 2, 4]


# ---- the pages ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_command_a_page_shows_exists_and_runs_as_shown(page, keys):
    problems = [f"{c.where}: `{c}`: {p}" for c in page_commands(page) for p in command_problems(c, keys)]
    problems += [f"{where}: a command block without a language: label it bash" for where in unlabelled_command_blocks(page)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_the_commands_a_preset_header_shows_run_as_shown(preset, keys):
    problems = [f"{c.where}: `{c}`: {p}" for c in preset_commands(preset) for p in command_problems(c, keys)]
    assert not problems, "\n".join(problems)


def test_console_samples_are_what_the_command_prints():
    problems = [p for page in PAGES for p in console_problems(page)]
    assert not problems, "\n".join(problems)


def test_section_key_mentions_are_schema_keys(keys):
    problems = []
    for page in PAGES:
        if page in GENERATED:
            continue
        text = page.read_text(encoding="utf-8")
        for number, key in unknown_keys(text, keys):
            if (page.name, key) in SHOWN_AS_MISTAKES:
                assert f"unknown config key '{key}'" in text, f"{page.name} shows {key} as a mistake without the error it gets"
                continue
            problems.append(f"{_name(page)}:{number}: `{key}` is no config key (a module? write megatron_rl/<path>.py)")
    assert not problems, "\n".join(problems)


def test_the_pages_speak_of_the_product_only():
    problems = [f"{_name(page)}:{n}: {word!r}" for page in PAGES if page not in GENERATED
                for n, word in development_words(page.read_text(encoding="utf-8"))]
    assert not problems, "\n".join(problems)


def _passages(text: str) -> list[str]:
    """A table row or a paragraph: the unit a claim about one run is made in."""
    out = []
    for block in text.split("\n\n"):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        out += rows if rows else [block]
    return out


def test_the_gpu_runs_quoted_in_the_pages_are_their_json():
    """Where a page quotes a `make gpu-check` result file, the test counts it gives are the file's, and each check
    the file lists as failed is named there."""
    import json

    results = sorted((REPO / "bench" / "results").glob("gpu-*.json"))
    assert results, "no GPU result files"
    for result in results:
        data = json.loads(result.read_text())
        passed = data.get("tests", {}).get("counts", {}).get("passed")
        for page in PAGES:
            if page in GENERATED:
                continue
            for passage in _passages(page.read_text(encoding="utf-8")):
                if result.name not in passage:
                    continue
                for claimed in re.findall(r"(\d+) passed", passage) if passed is not None else []:
                    assert int(claimed) == passed, f"{_name(page)} says {claimed} passed for {result.name}: it holds {passed}"
                for check in data.get("failed_checks", []):
                    assert check in passage, f"{_name(page)} quotes {result.name} without its failed check {check!r}"
