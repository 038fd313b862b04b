"""Arithmetic word problems (megatron_rl.data.arithmetic, tools/prepare_arithmetic.py): answers, seeds, the split.

Each answer is recomputed here by reading the problem's sentences (an interpreter written from the sentence
templates, independent of the generator's arithmetic).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from megatron_rl.data.arithmetic import ANSWER_INSTRUCTION, MAX_VALUE, ArithmeticDataError, arithmetic_splits, write_arithmetic_splits
from megatron_rl.data.dataset import read_rows

REPO = Path(__file__).resolve().parents[2]


def solve(prompt: str) -> tuple[int, int]:
    """(the answer, the number of operations) read from the problem text; every value checked in range on the way."""
    body = prompt.removesuffix(f" {ANSWER_INSTRUCTION}")
    sentences = [s.strip() for s in re.split(r"(?<=\.) ", body)]
    first = re.fullmatch(r"(\w+) has (\d+) (\w+)\.", sentences[0])
    assert first, sentences[0]
    value, operations = int(first.group(2)), 0
    for sentence in sentences[1:-1]:
        sentence = sentence.removeprefix("Then ")
        if m := re.search(r"(?:buys|gives \w+) (\d+) more", sentence):
            value += int(m.group(1))
        elif m := re.search(r"(?:gives away|loses) (\d+) ", sentence):
            value -= int(m.group(1))
        elif m := re.search(r"ends up with (\d+) times as many", sentence):
            value *= int(m.group(1))
        elif m := re.search(r"equally among (\d+) friends", sentence):
            assert value % int(m.group(1)) == 0, prompt  # shares are whole
            value //= int(m.group(1))
        else:
            raise AssertionError(f"unknown sentence {sentence!r}")
        assert 0 <= value <= MAX_VALUE, prompt
        operations += 1
    assert sentences[-1].startswith("How many"), prompt
    return value, operations


def test_answers_match_the_text():
    train, heldout = arithmetic_splits(300, 100, steps=(2, 3))
    for row in train + heldout:
        value, operations = solve(row["prompt"])
        assert row["answer"] == str(value), row
        assert row["data_source"] == f"arithmetic-{operations}step"
    assert {r["data_source"] for r in heldout} == {"arithmetic-2step", "arithmetic-3step"}


def test_heldout_split_is_disjoint_and_deterministic(tmp_path):
    train, heldout = arithmetic_splits(2000, 200)
    assert len(train) == 2000 and len(heldout) == 200
    train_prompts, heldout_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in heldout}
    assert len(train_prompts) == 2000 and len(heldout_prompts) == 200  # no repeats inside a split
    assert not train_prompts & heldout_prompts
    # a different training seed draws other problems, still never a held-out one
    other, heldout_again = arithmetic_splits(2000, 200, train_seed=7)
    assert heldout_again == heldout and other != train and not {r["prompt"] for r in other} & heldout_prompts

    first = write_arithmetic_splits(tmp_path / "a", 500, 50)
    second = write_arithmetic_splits(tmp_path / "b", 500, 50)
    for split in ("train", "heldout"):
        assert first[split].read_bytes() == second[split].read_bytes()
    assert read_rows(first["heldout"]) == arithmetic_splits(500, 50)[1]  # the file holds the rows, readable as data


def test_the_training_split_skips_heldout_prompts():
    """A training seed equal in effect to the held-out one: every problem it draws first is a held-out one, all skipped."""
    from megatron_rl.data.arithmetic import make_problems

    heldout = make_problems(20, seed=5, steps=(2,))
    train = make_problems(20, seed=5, steps=(2,), exclude=frozenset(p.prompt for p in heldout))
    assert not {p.prompt for p in train} & {p.prompt for p in heldout}


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(ArithmeticDataError, match="train_size=0"):
        arithmetic_splits(0, 10)
    with pytest.raises(ArithmeticDataError, match="steps=\\(0,\\)"):
        arithmetic_splits(10, 10, steps=(0,))
    with pytest.raises(ArithmeticDataError, match="different seeds"):
        arithmetic_splits(10, 10, train_seed=3, heldout_seed=3)
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from prepare_arithmetic import main
    finally:
        sys.path.pop(0)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main([str(blocker / "data")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(blocker / "data") in err
