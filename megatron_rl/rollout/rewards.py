"""Rewards: one float per sample, from a registered name or a user function.

A reward function is `fn(response: str, answer, *, prompt: str) -> float`.
`data.reward` names one in REWARDS (`exact`, `math`) or gives an import path
`package.module:function`, checked against that call when it is loaded (at
start: megatron_rl.plugins). A function that raises or returns NaN/inf does not
stop the run and is never silent: that sample gets `failure_reward`, the first
failures are logged with the sample and its traceback, and the count is a
metric (`reward/errors`). A batch where every sample fails is an error.
"""

from __future__ import annotations

import logging
import math
import re
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_rl.config.core import ConfigError
from megatron_rl.extras import import_extra
from megatron_rl.rollout.import_path import load_callable

logger = logging.getLogger(__name__)


class RewardFn(Protocol):
    """The call every reward function takes (compute_rewards'): the response's text, the row's answer, the prompt's
    text by keyword -> one float."""

    def __call__(self, response, answer, *, prompt) -> float: ...


class RewardError(ConfigError):
    """The reward function cannot be found, does not take the reward call, or failed on a whole batch."""


def exact_match(response: str, answer: Any, *, prompt: str = "") -> float:
    """1.0 when the response, stripped of surrounding white space, equals the answer."""
    return float(response.strip() == str(answer).strip())


def math_answer(response: str, answer: Any, *, prompt: str = "") -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the reference, else 0.0.

    The final answer (math_candidate) is, in this order:
    1. the content of the response's last \\boxed{...};
    2. else the last number after the response's last answer marker (ANSWER_MARKER: "answer:", "answer is",
       "the final answer is", "####", any case), read to the end of that sentence or line: "The answer is 23."
       and "#### 23" give 23, "Answer: 19 + 4 = 23" gives 23;
    3. else the response itself when it is one number and nothing more ("23", " 23.");
    4. else none: 0.0. The rest of a response is never parsed: parsed whole, "19 + 4 = 6 ... the problem of
       19 + 4 is" scored 1.0 for the answer 23, math-verify evaluating the question the response restated.
    The reference is parsed as LaTeX ($answer$). When it is a number, the final answer must be a number too
    (an integer, a decimal, a/b or \\frac{a}{b}): "\\boxed{19 + 4}" restates the question, and scores 0.0.
    """
    math_verify = import_extra("math_verify", extra="data", feature="the `math` reward")
    parse, verify = math_verify.parse, math_verify.verify

    candidate = math_candidate(response)
    if not candidate or (_is_number(str(answer)) and not _is_number(candidate)):
        return 0.0
    gold = parse(f"${answer}$" if not str(answer).startswith("$") else str(answer))
    return float(bool(verify(gold, parse(candidate))))


ANSWER_MARKER = re.compile(r"####|\banswer\s*(?:is\b|:)", re.IGNORECASE)
"""Where a final answer is announced without \\boxed{}: "answer:", "answer is" (so also "the (final) answer is"),
"####" (GSM8K's)."""
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?")
"""An integer, a decimal or a fraction a/b; commas group thousands."""
_SENTENCE_END = re.compile(r"\n|[.!?](?!\d)")
_FRACTION = re.compile(r"-?\\d?frac\{\d+\}\{\d+\}")


def _is_number(text: str) -> bool:
    """Whether `text` (surrounding $ and white space aside) is a number literal: _NUMBER or \\frac{a}{b}."""
    text = text.strip().strip("$").strip()
    return bool(_NUMBER.fullmatch(text) or _FRACTION.fullmatch(text))


def math_candidate(response: str) -> str:
    """The final answer the `math` reward reads of a response (see math_answer), as $...$; "" when it gives none."""
    boxed = re.findall(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", response)
    if boxed:
        return f"${boxed[-1]}$"
    markers = list(ANSWER_MARKER.finditer(response))
    if markers:
        after = response[markers[-1].end():].lstrip(" \t\n:=")
        end = _SENTENCE_END.search(after)
        numbers = _NUMBER.findall(after[: end.start()] if end else after)
    else:
        alone = re.fullmatch(rf"\s*({_NUMBER.pattern})\s*\.?\s*", response)
        numbers = [alone.group(1)] if alone else []
    return f"${numbers[-1].replace(',', '').replace(' ', '')}$" if numbers else ""


REWARDS: dict[str, RewardFn] = {"exact": exact_match, "math": math_answer}
REWARD_EXTRAS: dict[str, tuple[str, str]] = {"math": ("math_verify", "data")}
"""Registered rewards that need an optional module: name -> (module, the setup.py extra installing it)."""


def get_reward_fn(name: str) -> RewardFn:
    """A registered name or `module:function` -> the function."""
    if name in REWARDS:
        if name in REWARD_EXTRAS:  # say so when the reward is chosen, not as a failure of every sample
            module, extra = REWARD_EXTRAS[name]
            import_extra(module, extra=extra, feature=f"data.reward={name}")
        return REWARDS[name]
    if ":" not in name:
        raise RewardError(f"unknown reward {name!r}: use one of {sorted(REWARDS)} or an import path 'package.module:function'")
    return load_callable("data.reward", name, RewardFn, RewardError)


@dataclass(kw_only=True)
class RewardResult:
    """Rewards of a batch and what went wrong computing them."""

    rewards: list[float]
    """One reward per sample."""
    num_errors: int = 0
    """Samples whose reward function raised or returned a non-finite value."""
    errors: list[str] = field(default_factory=list)
    """Descriptions of the first failures (sample index, prompt, exception)."""


def compute_rewards(
    fn: RewardFn,
    responses: list[str],
    answers: list[Any],
    prompts: list[str],
    *,
    failure_reward: float = 0.0,
    max_logged: int = 3,
) -> RewardResult:
    """Apply `fn` to every sample, isolating failures (see module docstring)."""
    result = RewardResult(rewards=[])
    for i, (response, answer, prompt) in enumerate(zip(responses, answers, prompts, strict=True)):
        try:
            value = float(fn(response, answer, prompt=prompt))
            if not math.isfinite(value):
                raise ValueError(f"reward function returned {value}")
        except Exception as err:  # noqa: BLE001 - a user function may raise anything
            value = failure_reward
            result.num_errors += 1
            if len(result.errors) < max_logged:
                detail = "".join(traceback.format_exception_only(type(err), err)).strip()
                message = f"reward failed on sample {i} (prompt {prompt[:80]!r}, response {response[:80]!r}): {detail}"
                result.errors.append(message)
        result.rewards.append(value)
    if not responses or result.num_errors < len(responses):  # a batch that fails as a whole is one error below
        for message in result.errors:
            logger.warning(message)
    else:
        name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
        raise RewardError(
            f"the reward function {name} (data.reward) failed on all {len(responses)} samples; first: {result.errors[0]}; "
            "fix the function, or set data.reward to another one"
        )
    return result
