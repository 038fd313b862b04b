"""Built-in verifiable tasks, generated from a seed (no download).

`data.path=synthetic:<task>[:<num_prompts>[:<seed>]]`, e.g. `synthetic:first_letter:512`.
Each row is {"prompt": str, "answer": str}; the `exact` reward checks the
response against the answer. They exist so that the whole RL loop can be
shown learning on a laptop in minutes: a tiny model solves a task like
`first_letter` only after training, so the rising reward is the loop's doing.
"""

from __future__ import annotations

import random
import string

from megatron_rl.config.synthetic import SYNTHETIC_PREFIX, SYNTHETIC_TASKS, parse_synthetic  # noqa: F401  (named here for callers)



def _first_letter(rng: random.Random, alphabet: str = string.ascii_lowercase, lengths: tuple[int, int] = (3, 6)) -> dict[str, str]:
    letters = [rng.choice(alphabet) for _ in range(rng.randint(*lengths))]
    return {"prompt": f"first letter of {' '.join(letters)} is", "answer": letters[0]}


def _first_letter8(rng: random.Random) -> dict[str, str]:
    """first_letter over four letters from a-h (chance level 1/8; the answer is always 4 letters back)."""
    return _first_letter(rng, "abcdefgh", (4, 4))


def _last_letter(rng: random.Random) -> dict[str, str]:
    letters = [rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6))]
    return {"prompt": f"last letter of {' '.join(letters)} is", "answer": letters[-1]}


def _add_digits(rng: random.Random) -> dict[str, str]:
    a, b = rng.randint(0, 4), rng.randint(0, 5)
    return {"prompt": f"{a} + {b} =", "answer": str(a + b)}


def _lookup8(rng: random.Random) -> dict[str, str]:
    """A value held only by a lookup tool (rollout.agent=lookup): key and value are independent letters a-h."""
    key = rng.choice("abcdefgh")
    return {"prompt": f"value of {key} is", "answer": rng.choice("abcdefgh"), "key": key}


TASKS = {"first_letter": _first_letter, "first_letter8": _first_letter8, "last_letter": _last_letter, "add": _add_digits, "lookup8": _lookup8}
if set(TASKS) != set(SYNTHETIC_TASKS):  # the config's list of names (checked when a config loads) is these tasks'
    raise ImportError(f"config.synthetic.SYNTHETIC_TASKS {sorted(SYNTHETIC_TASKS)} differs from data.tasks.TASKS {sorted(TASKS)}")

ANSWER_ALPHABETS = {
    "first_letter": string.ascii_lowercase,
    "first_letter8": "abcdefgh",
    "last_letter": string.ascii_lowercase,
    "add": string.digits,
    "lookup8": "abcdefgh",
}
"""The answers each task can have: the demo's format warm-up draws random answers from these."""


def synthetic_rows(spec: str) -> list[dict[str, str]]:
    name, num, seed = parse_synthetic(spec)
    rng = random.Random(seed)
    return [TASKS[name](rng) for _ in range(num)]
