"""The `math` reward reads a response's final answer, never the whole response (rollout.rewards.math_answer)."""

from __future__ import annotations

import pytest

from megatron_rl.rollout.rewards import math_answer, math_candidate

pytestmark = pytest.mark.extra("data", "math_verify")


@pytest.mark.parametrize("response", [
    "19 + 4 = 6 ... the problem of 19 + 4 is",  # restates the question: math-verify evaluated it to 23 (scored 1.0)
    "What is 19 + 4?",
    "\\boxed{19 + 4}",  # the question, boxed: an expression where the reference is a number
    "The answer is 19 + 4",  # the last number after the marker is 4
    "19 + 4 = 23 is what the problem asks about",  # no marker, and more than a number
])
def test_restating_the_question_scores_nothing(response):
    assert math_answer(response, "23") == 0.0


@pytest.mark.parametrize(("response", "final"), [
    ("so \\boxed{6} or rather \\boxed{23}", "$23$"),  # the last \boxed{}
    ("The answer is 23.", "$23$"),
    ("the final answer is 23! Next, problem 5.", "$23$"),  # to the end of its sentence
    ("Answer: 19 + 4 = 23", "$23$"),  # the last number after the marker
    ("#### 1,000", "$1000$"),  # GSM8K's marker; commas group thousands
    ("answer:\n-2.5", "$-2.5$"),
    ("Answer is 3/4", "$3/4$"),
    ("answer: 6. ... The answer is 23", "$23$"),  # the last marker
    (" 23.\n", "$23$"),  # a response that is one number
    ("The answer is twenty-three", ""),  # a marker without a number: none
    ("23 apples", ""),
])
def test_the_final_answer_rule(response, final):
    assert math_candidate(response) == final


@pytest.mark.parametrize(("response", "answer", "reward"), [
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is 0.5", "1/2", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("\\boxed{2x+2}", "2(x+1)", 1.0),  # a symbolic reference: equivalent expressions count
    ("Answer: 22", "23", 0.0),
    ("\\boxed{23}", "23", 1.0),
])
def test_the_final_answer_is_compared_by_value(response, answer, reward):
    assert math_answer(response, answer) == reward


def test_the_rewards_page_table_holds():
    """Each row of docs/rewards.md's table of the `math` rule (responses split on ' / ' are each checked)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text()
    table = page.split("### What `math` reads")[1].split("\n\n| response |")[1].split("\n\n")[0]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert len(rows) == 7
    for cells in rows:
        responses, answer, reward = cells[0].lstrip("| "), cells[1], float(cells[2])
        for response in responses.split(" / "):
            assert math_answer(response.strip("`"), answer.strip("`")) == reward, (response, answer)
