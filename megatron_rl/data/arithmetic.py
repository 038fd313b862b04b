"""Multi-step arithmetic word problems with a held-out split, generated from fixed seeds (no download).

    write_arithmetic_splits("outputs/quickstart/data", train_size=2000, heldout_size=200)
    # -> train.jsonl, heldout.jsonl: {"prompt": ..., "answer": "17", "data_source": "arithmetic-2step"}

Each problem chains `steps` operations (add, take away, multiply into groups, share out
evenly) on small whole numbers (at most MAX_VALUE at every step: a 135M-parameter model
solves about one in ten at that size, and few with numbers up to 100), in one of several story templates, e.g.

    "Mia has 7 marbles. Mia buys 5 more marbles. Then Mia gives away 3 marbles. How many
     marbles does Mia have now?"  -> 9

Every intermediate value is a whole number in [0, MAX_VALUE] (divisions are exact), so the
answer is one integer that the `math` reward checks. The prompt ends with the instruction
ANSWER_INSTRUCTION. The held-out split is drawn from its own seed and every training
problem whose text equals a held-out one is dropped and drawn again: the two files share
no prompt. The same arguments always write the same bytes.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

MAX_VALUE = 20
"""Largest value any problem holds at any step."""
MAX_START = 10
"""Largest starting amount."""
MAX_CHANGE = 5
"""Most items bought, given or lost in one step."""

ANSWER_INSTRUCTION = "Give the final answer as a number in \\boxed{}."
"""Appended to every problem: the `math` reward reads the last \\boxed{...} of a response."""

NAMES = ("Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Sara", "Tom", "Yuki", "Ben")
ITEMS = ("apples", "marbles", "stickers", "coins", "books", "pencils", "cards", "shells", "cookies", "stamps")
TRAIN_SEED = 1234
"""Seed of the training split."""
HELDOUT_SEED = 98765
"""Seed of the held-out split."""


class ArithmeticDataError(ValueError):
    """Arguments that cannot make the requested splits; the message names the value and the fix."""


@dataclass(kw_only=True)
class Problem:
    """One generated problem."""

    prompt: str
    answer: int
    steps: int

    def row(self) -> dict[str, str]:
        """The dataset row (megatron_rl.data.dataset): prompt, answer, data_source."""
        return {"prompt": self.prompt, "answer": str(self.answer), "data_source": f"arithmetic-{self.steps}step"}


def _operation(rng: random.Random, value: int, name: str, item: str) -> tuple[str, int]:
    """One step applied to `value`: (its sentence, the new value); every result stays in [0, MAX_VALUE]."""
    choices = ["add", "take"]
    if 1 <= value <= MAX_VALUE // 2:
        choices.append("times")
    divisors = [d for d in (2, 3, 4, 5) if value >= d and value % d == 0]
    if divisors:
        choices.append("share")
    kind = rng.choice(choices)
    if kind == "add" and value < MAX_VALUE:
        n = rng.randint(1, min(MAX_CHANGE, MAX_VALUE - value))
        return rng.choice([f"{name} buys {n} more {item}.", f"A friend gives {name} {n} more {item}."]), value + n
    if kind in ("add", "take") and value > 0:
        n = rng.randint(1, min(MAX_CHANGE, value))
        return rng.choice([f"{name} gives away {n} {item}.", f"{name} loses {n} {item}."]), value - n
    if kind == "times":
        n = rng.randint(2, max(2, min(5, MAX_VALUE // value)))
        return f"{name} ends up with {n} times as many {item}.", value * n
    if kind == "share":
        n = rng.choice(divisors)
        return f"{name} shares the {item} equally among {n} friends and keeps one friend's share.", value // n
    n = rng.randint(1, MAX_CHANGE)  # value 0, kind take: nothing to take, so add
    return f"{name} buys {n} more {item}.", value + n


def make_problem(rng: random.Random, steps: int) -> Problem:
    """A problem of `steps` operations after the starting amount."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    value = rng.randint(2, MAX_START)
    sentences = [f"{name} has {value} {item}."]
    for i in range(steps):
        sentence, value = _operation(rng, value, name, item)
        if i and not sentence.startswith(name):  # "A friend gives ..." -> "Then a friend gives ..."
            sentence = f"{sentence[0].lower()}{sentence[1:]}"
        sentences.append(f"Then {sentence}" if i else sentence)
    sentences.append(f"How many {item} does {name} have now? {ANSWER_INSTRUCTION}")
    return Problem(prompt=" ".join(sentences), answer=value, steps=steps)


def make_problems(count: int, *, seed: int, steps: tuple[int, ...], exclude: frozenset[str] = frozenset()) -> list[Problem]:
    """`count` distinct problems from `seed`, steps drawn from `steps` in turn, none of whose prompt is in `exclude`."""
    rng = random.Random(seed)
    problems: list[Problem] = []
    seen = set(exclude)
    attempts = 0
    while len(problems) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ArithmeticDataError(
                f"only {len(problems)} distinct problems of {steps} steps after {attempts} draws (seed {seed}): ask for fewer "
                "problems or more steps"
            )
        problem = make_problem(rng, steps[len(problems) % len(steps)])
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            problems.append(problem)
    return problems


def arithmetic_splits(
    train_size: int, heldout_size: int, *, steps: tuple[int, ...] = (1, 2), train_seed: int = TRAIN_SEED,
    heldout_seed: int = HELDOUT_SEED,
) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): disjoint prompts, each split from its own seed (module docstring)."""
    if train_size < 1 or heldout_size < 1:
        raise ArithmeticDataError(f"train_size={train_size}, heldout_size={heldout_size}: both splits need at least one problem")
    if not steps or any(s < 1 for s in steps):
        raise ArithmeticDataError(f"steps={steps}: give one or more step counts >= 1, e.g. 2 3")
    if train_seed == heldout_seed:
        raise ArithmeticDataError(f"train_seed = heldout_seed = {train_seed}: the splits need different seeds")
    heldout = make_problems(heldout_size, seed=heldout_seed, steps=steps)
    train = make_problems(train_size, seed=train_seed, steps=steps, exclude=frozenset(p.prompt for p in heldout))
    return [p.row() for p in train], [p.row() for p in heldout]


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Rows as JSON lines, written to a temporary file and renamed (never a half-written file under `path`)."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_arithmetic_splits(out_dir: str | os.PathLike, train_size: int = 2000, heldout_size: int = 200, **kwargs) -> dict[str, Path]:
    """train.jsonl and heldout.jsonl in `out_dir` (arguments as arithmetic_splits); returns {split: path}."""
    train, heldout = arithmetic_splits(train_size, heldout_size, **kwargs)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = {"train": out / "train.jsonl", "heldout": out / "heldout.jsonl"}
        write_jsonl(train, paths["train"])
        write_jsonl(heldout, paths["heldout"])
    except OSError as err:
        raise ArithmeticDataError(f"cannot write the data to {str(out)!r}: {err.strerror or err}; choose a directory you can write") from None
    return paths
