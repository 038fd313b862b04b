"""A set's k samples per prompt, ready to score: single-turn completions or whole agent episodes.

    samples = single_turn_samples(engine, eval_set, tokenizer)                       # rollout.agent unset
    samples = episode_samples(engine, eval_set, tokenizer, agent_cls, cfg.rollout)   # rollout.agent set

With rollout.agent set, every sample of an eval set is one episode run by the
agents' EpisodeRunner (megatron_rl.rollout.agents) with the run's agent class
and rollout.agent_* settings (tools, parser, turn and token limits): the
episodes training runs, on held-out prompts. A sample's reward is the
episode's reward (rollout.agent_reward: answer = the set's reward on the final
model turn, env = the environment's, both = their sum), so mean@k and pass@k
are over episodes; its final answer (maj@k) is read from the final model turn;
its length counts the model's tokens (observations excluded) and it is
truncated when a turn ended without EOS. The episodes' agent statistics
(turns, tool calls and errors, cuts, failed episodes) come with the samples.

Only EpisodeRunner's constructor, run() and stats.take() (what the training
loop reads, megatron_rl.experience.agent_metrics) and EpisodeBatch's fields are
used. Each set gets its own runner (its reward function), so the training
runner's statistics never see evaluation episodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from megatron_rl.data.tokenizer import Tokenizer


@dataclass(kw_only=True)
class SetSamples:
    """k samples per prompt of one set, prompt-major, as the scorer needs them."""

    responses: list[str]
    """Each sample's whole response text (an episode's: every turn and observation)."""
    answer_texts: list[str]
    """The text the reward scores and the final answer is read from (an episode's final model turn)."""
    lengths: list[int]
    """Response tokens the model generated (an episode's observation tokens excluded)."""
    truncated: list[bool]
    """A turn ended at the length limit (no EOS)."""
    rewards: list[float] | None = None
    """Episodes: each sample's reward (rollout.agent_reward). None: the set's reward scores answer_texts."""
    failed: set[int] = field(default_factory=set)
    """Episodes: samples whose episode failed in user code or whose reward failed (reward errors)."""
    agent_metrics: dict[str, float] = field(default_factory=dict)
    """Episodes: agent/turns_mean, agent/tool_calls/<tool>, agent/cut_<reason>, ... of the set's episodes."""


def generate_samples(engine: Any, eval_set: Any):
    """The k samples of every prompt of a set (runner.EvalSet: Rollouts, prompt-major). Evaluation's one generation
    call site."""
    return engine.generate([p.token_ids for p in eval_set.prompts], eval_set.spec)


def single_turn_samples(engine: Any, eval_set: Any, tokenizer: Tokenizer) -> SetSamples:
    """One engine call (generate_samples): k completions of every prompt."""
    rollouts = generate_samples(engine, eval_set)
    responses = [tokenizer.decode(s.response_token_ids.tolist()) for s in rollouts]
    return SetSamples(
        responses=responses, answer_texts=responses, lengths=[s.response_length for s in rollouts],
        truncated=[s.finish_reason == "length" for s in rollouts],
    )


def episode_samples(engine: Any, eval_set: Any, tokenizer: Tokenizer, agent_cls: type, rollout_config: Any) -> SetSamples:
    """k episodes of every prompt (module docstring), run with the set's sampling settings and seed."""
    from megatron_rl.rollout.agents import EpisodeRunner

    runner = EpisodeRunner(agent_cls, tokenizer, eval_set.reward_fn, rollout_config)
    try:
        batch = runner.run(engine, eval_set.prompts, eval_set.spec)
        agent_metrics = runner.stats.take()
    finally:
        runner.close()
    samples = batch.rollouts.samples
    finals = [e.final_text for e in batch.episodes]
    failed = {i for i, e in enumerate(batch.episodes) if e.failed}
    if rollout_config.agent_reward in ("answer", "both") and batch.num_errors > len(failed):
        prompts = eval_set.prompts
        failed |= {
            i for i, e in enumerate(batch.episodes)
            if reward_fails(eval_set.reward_fn, finals[i], prompts[e.prompt_index].answer, prompts[e.prompt_index].text)
        }
    return SetSamples(
        responses=[tokenizer.decode(s.response_token_ids.tolist()) for s in samples], answer_texts=finals,
        lengths=[int(n) for n in batch.model_tokens.tolist()], truncated=[bool(t) for t in batch.truncated.tolist()],
        rewards=[float(r) for r in batch.rewards.tolist()], failed=failed, agent_metrics=agent_metrics,
    )


def reward_fails(fn: Callable, response: str, answer: Any, prompt: str) -> bool:
    """Whether the reward function raises or returns a non-finite number on this sample (counted as a reward error)."""
    try:
        return not math.isfinite(float(fn(response, answer, prompt=prompt)))
    except Exception:  # noqa: BLE001 - a user function may raise anything
        return True
