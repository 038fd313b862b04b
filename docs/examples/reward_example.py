"""A custom reward (docs/rewards.md), with this folder on PYTHONPATH:
data.reward=reward_example:graded_answer

The response must end with a line `Answer: <number>`. By hand, for the
answer "72":

    "So 48 + 24 = 72.\nAnswer: 72"   -> 1.0  the number, right
    "Answer: 72.0"                   -> 1.0  the same number
    "so the answer is 72"            -> 0.0  no Answer line
    "Answer: 70"                     -> 0.1  the format, a wrong number
    "Answer: seventy-two"            -> 0.1  the format, no number
"""

from __future__ import annotations

import re

FORMAT_ONLY = 0.1
"""The right format with a wrong number: small, so that the right answer
stays what is learned."""

ANSWER_LINE = re.compile(r"^Answer:\s*(.+?)\s*$", flags=re.MULTILINE)


def graded_answer(response: str, answer, *, prompt: str = "") -> float:
    found = ANSWER_LINE.findall(response)
    if not found:
        return 0.0
    try:
        right = float(found[-1].rstrip(".")) == float(answer)
    except ValueError:  # the line holds no number
        return FORMAT_ONLY
    return 1.0 if right else FORMAT_ONLY
