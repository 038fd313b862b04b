"""The experience source of each mode (megatron_rl.experience_source) as the trainer calls it: which prompts each
step's generation draws, with which sampling seed, and the data position a checkpoint stores, worked out by hand.

Generation is a rollout-function plug-in (rollout.function, a module written to a temporary folder) that answers
sample 0 of each prompt right and sample 1 wrong and writes down each call's seed and prompt rows; it never uses an
engine, so the sources get none. Four prompts, two per step, two samples each, train.seed=0, no shuffling: step k's
seed is step_seed(0, k, 0) = 64 k; the stream's batch b has step_seed(0, 2^20 + b, 0) = (1,048,576 + b) x 64."""

from __future__ import annotations

import importlib
import json
import math
import sys
import textwrap
import time

import pytest
import torch

from megatron_rl.config import RLConfig, from_dict
from megatron_rl.experience_source import (
    LaggedSource, NoExperienceHere, StreamingSource, SynchronousSource, experience_source,
)
from megatron_rl.plugins import load_plugins
from megatron_rl.rollout.rewards import get_reward_fn
from tests.unit.test_plugins import SCRIPTED

RECORDING = SCRIPTED + """
    CALLS = []
    '''(sampling seed, prompt rows) of every call, in order.'''

    def right_then_wrong(engine, prompts, spec, tokenizer, cfg):
        CALLS.append((spec.seed, [p.index for p in prompts]))
        return first_sample_answers(engine, prompts, spec, tokenizer, cfg)
"""
"""test_plugins' scripted rollout function (sample 0 of each prompt right, the others 0), each call written down."""

STREAM_SEED = (1 << 20) * 64  # 67,108,864: the stream's batch 0


def position(epoch: int, cursor: int) -> dict[str, int]:
    """PromptDataset.state_dict() of the four-row set read without shuffling (its seed 0)."""
    return {"epoch": epoch, "cursor": cursor, "seed": 0, "size": 4}


@pytest.fixture(scope="module")
def sums(tmp_path_factory):
    """(a sentencepiece tokenizer, a file of four sums: row r asks r+1 + r+1, answer 2r+2)."""
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.models.tiny import build_sentencepiece_model

    folder = tmp_path_factory.mktemp("sums")
    rows = [{"prompt": f"{r + 1} + {r + 1} =", "answer": str(2 * r + 2)} for r in range(4)]
    (folder / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return load_tokenizer(build_sentencepiece_model(folder / "sp.model")), folder / "sums.jsonl"


@pytest.fixture
def recording(tmp_path, monkeypatch):
    """The rollout function's module, imported from a folder of this test's own (a fresh CALLS list)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"recording_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(RECORDING))
    importlib.invalidate_caches()
    yield importlib.import_module(name)
    sys.modules.pop(name, None)


def make(recording, sums, **train):
    """The source the config picks, over the four sums, started with no engine at step train['first_step'] (0)."""
    from megatron_rl.data.dataset import PromptDataset

    first_step = train.pop("first_step", 0)
    restore = train.pop("restore", None)
    algorithm = {"tis_mode": "token"} if train.get("max_staleness") else {}
    cfg = from_dict(RLConfig, {
        "data": {"reward": "exact"}, "algorithm": algorithm,
        "rollout": {"function": f"{recording.__name__}:right_then_wrong", "n_samples": 2},
        "train": {"prompts_per_step": 2, "seed": 0, **train},
    })
    load_plugins(cfg)
    tokenizer, path = sums
    dataset = PromptDataset(path, tokenizer, shuffle=False)
    source = experience_source(cfg, dataset, tokenizer, get_reward_fn("exact"), None)
    if restore is not None:
        source.restore(restore)
    source.start(None, first_step=first_step)
    return source, dataset


def test_a_rank_without_the_data_takes_nothing_and_stores_no_position():
    source = experience_source(from_dict(RLConfig, {"data": {"reward": "exact"}}), None, None, get_reward_fn("exact"))
    assert isinstance(source, NoExperienceHere)
    source.start(None, first_step=0)
    assert source.take(0, 0) is None and source.position() is None
    source.close()


def test_the_synchronous_source_generates_each_step_in_take(recording, sums):
    source, dataset = make(recording, sums, steps=2)
    assert isinstance(source, SynchronousSource) and not isinstance(source, LaggedSource)
    experience = source.take(0, 0)
    assert recording.CALLS == [(0, [0, 1])]
    assert source.position() == position(0, 2)
    # each group's rewards [1, 0]: mean 1/2, sample std sqrt(((1/2)^2 + (1/2)^2) / 1) = sqrt(1/2);
    # grpo advantages +-(1/2) / (sqrt(1/2) + 1e-6)
    assert experience.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(experience.advantages, torch.tensor([0.5, -0.5, 0.5, -0.5]) / (math.sqrt(0.5) + 1e-6))
    assert experience.metrics["reward/mean"] == 0.5
    source.take(1, 1)
    assert recording.CALLS == [(0, [0, 1]), (64, [2, 3])]
    assert source.position() == position(0, 4)
    source.close()


def test_the_lagged_source_generates_the_next_step_ahead_and_stores_where_it_starts(recording, sums):
    source, dataset = make(recording, sums, steps=3, off_policy_lag=1)
    assert isinstance(source, LaggedSource)
    source.take(0, 0)  # step 0 in take, step 1 starts behind it
    assert source.position() == position(0, 2)  # step 1's prompts are not behind the checkpoint
    source.before_weights_change()  # the push waits for step 1's generation: it used the weights before it
    assert recording.CALLS == [(0, [0, 1]), (64, [2, 3])]
    assert dataset.state_dict() == position(0, 4) and source.position() == position(0, 2)
    experience = source.take(1, 1)  # step 1's batch, generated ahead; step 2 starts (a new epoch's first rows)
    row_2 = dataset.prompts[2].token_ids
    assert experience.rollouts.tokens[0, : len(row_2)].tolist() == row_2  # its first sample answers row 2
    source.before_weights_change()
    assert recording.CALLS[2] == (128, [0, 1]) and source.position() == position(0, 4)
    source.take(2, 2)  # the last step: nothing generated ahead
    assert len(recording.CALLS) == 3 and source.position() == position(1, 2)
    source.close()


def test_a_resumed_lagged_source_generates_the_step_in_flight_again_with_its_seed(recording, sums):
    source, _ = make(recording, sums, steps=3, off_policy_lag=1, restore=position(0, 2), first_step=1)
    source.take(1, 1)  # what the checkpoint after step 0 resumes: step 1 on rows 2, 3 with seed 64, as uninterrupted
    source.before_weights_change()
    assert recording.CALLS == [(64, [2, 3]), (128, [0, 1])]
    source.close()


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the producer did not get there in time"
        time.sleep(0.01)


def test_the_streaming_source_stores_the_position_after_the_groups_it_handed_over(recording, sums):
    source, dataset = make(recording, sums, steps=4, max_staleness=1)
    assert isinstance(source, StreamingSource)
    experience = source.take(0, 0)
    assert recording.CALLS[0] == (STREAM_SEED, [0, 1])
    assert experience.metrics["async/staleness_max"] == 0.0
    # the producer keeps max_staleness x prompts_per_step = 2 groups queued: batch 1 (rows 2, 3) is generated, not taken
    _wait_for(lambda: dataset.state_dict() == position(0, 4))
    assert recording.CALLS[1] == (STREAM_SEED + 64, [2, 3])
    assert source.position() == position(0, 2)
    experience = source.take(1, 1)  # batch 1's groups, sampled with version 0: staleness 1 - 0 = 1, within the bound
    assert experience.metrics["async/staleness_max"] == 1.0 and experience.metrics["async/dropped_stale_groups"] == 0.0
    assert source.position() == position(0, 4)
    source.close()


def test_a_resumed_streaming_source_starts_at_the_stored_position_with_that_steps_seed(recording, sums):
    source, _ = make(recording, sums, steps=4, max_staleness=1, restore=position(0, 2), first_step=1)
    source.take(1, 1)
    assert recording.CALLS[0] == (STREAM_SEED + 64, [2, 3])
    source.close()
