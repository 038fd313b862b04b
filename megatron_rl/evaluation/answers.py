"""Final answers for maj@k, compared the way the reward compares them, and the check that a row can be scored.

Each reward has an AnswerRule: `final(response) -> str` (the answer a response
gives, "" for none) and `same(a, b) -> bool` (two final answers are one vote):
- exact: the stripped response; equal strings;
- math: what the `math` reward reads (rewards.math_candidate: the last
  \\boxed{...}, else the last number after an answer marker, else a response
  that is one number, else none); equal strings or math-verify equivalence, as
  the reward verifies;
- a user function (`module:function`) may carry `final_answer` and
  `same_answer` attributes; without them its stripped response and string
  equality are used.

A row is scorable when the reward, given the row's own reference answer as the
response (\\boxed{answer} for math), returns a finite number without raising,
and for the registered rewards returns 1: a reference math-verify cannot parse
would otherwise score every sample 0 and go unnoticed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from megatron_rl.rollout.rewards import REWARDS, math_candidate


class EvalSetError(ValueError):
    """An evaluation set that cannot be scored; the message names the set, the row and the fix."""


@dataclass(kw_only=True)
class AnswerRule:
    """How one reward reads and compares final answers."""

    final: Callable[[str], str]
    """The final answer of a response ("" = none)."""
    same: Callable[[str, str], bool]
    """Whether two final answers are the same answer (one vote)."""
    reference_response: Callable[[Any], str]
    """A response that gives the reference answer (the scorability check)."""


def _math_same() -> Callable[[str, str], bool]:
    from megatron_rl.extras import import_extra

    math_verify = import_extra("math_verify", extra="data", feature="maj@k with the `math` reward")
    parsed: dict[str, Any] = {}

    def parse(text: str):
        if text not in parsed:
            parsed[text] = math_verify.parse(text)
        return parsed[text]

    def same(a: str, b: str) -> bool:
        if a == b:
            return True
        try:
            return bool(math_verify.verify(parse(a), parse(b)))
        except Exception:  # noqa: BLE001 - an answer math-verify cannot compare is another answer
            return False

    return same


def answer_rule(reward: str, fn: Callable) -> AnswerRule:
    """The AnswerRule of a reward named `reward` (a registered name or 'module:function') whose function is `fn`."""
    if reward == "math":
        return AnswerRule(
            final=lambda response: math_candidate(response).strip(),
            same=_math_same(),
            reference_response=lambda answer: f"\\boxed{{{answer}}}",
        )
    final = getattr(fn, "final_answer", lambda response: response.strip())
    same = getattr(fn, "same_answer", lambda a, b: a == b)
    return AnswerRule(final=final, same=same, reference_response=lambda answer: str(answer))


def check_scorable(prompts: list, reward: str, fn: Callable, rule: AnswerRule, where: str) -> None:
    """EvalSetError naming the first row the reward cannot score (see the module docstring)."""
    for prompt in prompts:
        row = f"{where} row {prompt.index}"
        answer = prompt.answer
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise EvalSetError(f"{row}: the reference answer is empty ({answer!r}); fill it in or remove the row")
        try:
            value = float(fn(rule.reference_response(answer), answer, prompt=prompt.text))
        except Exception as err:  # noqa: BLE001 - a user function may raise anything
            raise EvalSetError(
                f"{row}: the reward {reward!r} cannot score this row's answer {answer!r} ({type(err).__name__}: {err}); "
                "fix the answer or set the set's reward"
            ) from None
        if not math.isfinite(value) or (reward in REWARDS and value != 1.0):
            raise EvalSetError(
                f"{row}: the reward {reward!r} gives the reference answer {answer!r} itself {value} (not 1): it cannot "
                "score this row; fix the answer's format or set the set's reward"
            )
