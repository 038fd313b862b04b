"""Rewards: one float per sample, from a registered name or a user function.

A reward function is `fn(response: str, answer, *, prompt: str) -> float`.
`data.reward` names one in REWARDS (`exact`, `math`) or gives an import path
`package.module:function`. A function that raises or returns NaN/inf does not
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
from typing import Any, Callable

from megatron_rl.extras import import_extra
from megatron_rl.rollout.import_path import import_path

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]


class RewardError(RuntimeError):
    """The reward function cannot be found or failed on a whole batch."""


def exact_match(response: str, answer: Any, *, prompt: str = "") -> float:
    """1.0 when the response, stripped of surrounding white space, equals the answer."""
    return float(response.strip() == str(answer).strip())


def math_answer(response: str, answer: Any, *, prompt: str = "") -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the reference.

    The last \\boxed{...} in the response is checked if present, else the whole
    response; the reference is parsed the same way.
    """
    math_verify = import_extra("math_verify", extra="data", feature="the `math` reward")
    parse, verify = math_verify.parse, math_verify.verify

    gold = parse(f"${answer}$" if not str(answer).startswith("$") else str(answer))
    return float(bool(verify(gold, parse(math_candidate(response)))))


def math_candidate(response: str) -> str:
    """What the `math` reward parses of a response: its last \\boxed{...} as $...$, else the whole response."""
    boxed = re.findall(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", response)
    return f"${boxed[-1]}$" if boxed else response


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
    module_name, attr, fn = import_path("data.reward", name, name, RewardError)
    if not callable(fn):
        raise RewardError(f"data.reward={name!r}: module {module_name!r} has no callable {attr!r}")
    return fn


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
