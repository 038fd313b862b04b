"""One step of experience: prompts -> engine samples -> rewards -> advantages.

Runs on the rank that holds the rollout engine; the result is broadcast to
every trainer rank. The stages, in order:

1. take `train.prompts_per_step` prompts and generate `rollout.n_samples` each
   (rollout.function, or rollout.agent's episodes);
2. score every sample (reward function, failures isolated and counted) and add
   DAPO's soft overlong punishment (algorithm.overlong_buffer > 0);
3. with dynamic sampling, drop the groups algorithm.group_filter drops (by
   default those whose rewards are all equal) and generate again until the step
   holds `prompts_per_step` groups (or fail, saying what to change, after
   algorithm.max_num_gen_batches);
4. advantages per group (algorithm.advantage), and overlong filtering
   (responses cut at the length limit leave the loss).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_rl.algorithms import DynamicSamplingAccumulator, compute_advantages, overlong_filter_mask, soft_overlong_punishment
from megatron_rl.data.batch import PaddedRollouts, Rollouts
from megatron_rl.data.dataset import PromptDataset
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.rollout.function import rollout_batch
from megatron_rl.rollout.rewards import compute_rewards
from megatron_rl.rollout.sampling import SamplingSpec


@dataclass(kw_only=True)
class Experience:
    """A step's training data. B = groups x n_samples, T = longest prompt + response."""

    rollouts: PaddedRollouts
    """tokens [B, T], response_mask [B, T] (overlong-filtered), rollout_logprobs [B, T], routed experts (packed by
    sample: `PackedRoutes`)."""
    rewards: torch.Tensor
    """[B] float32: task reward plus length shaping (what the advantages are computed from)."""
    advantages: torch.Tensor
    """[B] float32: one advantage per sample, shared by its tokens."""
    group_ids: torch.Tensor
    """[B] int64: which prompt group each sample belongs to (0..groups-1)."""
    truncated: torch.Tensor
    """[B] bool: cut at the length limit (no EOS)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Generation-side numbers for logging."""


def step_seed(base_seed: int, step: int, gen_batch: int) -> int:
    """Sampling seed of one generation batch: distinct per step and per retry, reproducible on resume."""
    return (base_seed * 1_000_003 + step) * 64 + gen_batch


def score_rollouts(rollouts: Rollouts, prompts: list, tokenizer: Tokenizer, reward_fn: Callable, max_new_tokens: int, algo: Any):
    """(task rewards [N], shaped rewards [N] (+ overlong punishment), truncated [N] bool, reward errors)."""
    responses = [tokenizer.decode(s.response_token_ids.tolist()) for s in rollouts]
    answers = [prompts[s.prompt_index].answer for s in rollouts]
    texts = [prompts[s.prompt_index].text for s in rollouts]
    result = compute_rewards(reward_fn, responses, answers, texts)
    rewards = torch.tensor(result.rewards, dtype=torch.float32)
    shaped = rewards
    if algo.overlong_buffer > 0:
        lengths = torch.tensor([s.response_length for s in rollouts], dtype=torch.int64)
        shaped = rewards + soft_overlong_punishment(lengths, max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
    truncated = torch.tensor([s.finish_reason == "length" for s in rollouts], dtype=torch.bool)
    return rewards, shaped, truncated, result


def generate_and_score(engine, prompts: list, spec: SamplingSpec, tokenizer: Tokenizer, reward_fn: Callable, cfg, agent=None,
                       engine_turn=None, push_waiting=None):
    """(rollouts, task rewards, shaped rewards, truncated, reward errors): one engine call, or episodes with `agent`.

    agent: a rollout.agents.EpisodeRunner (rollout.agent set): every sample is one episode, possibly of several
    turns; overlong shaping counts its model tokens. None: the rollout function (rollout.function; the built-in is
    one engine.generate call), one completion per sample.
    """
    if agent is not None:
        batch = agent.run(engine, prompts, spec, engine_turn, push_waiting or (lambda: False))
        shaped = batch.rewards
        if cfg.algorithm.overlong_buffer > 0:
            algo = cfg.algorithm
            shaped = batch.rewards + soft_overlong_punishment(batch.model_tokens, cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_penalty)
        return batch.rollouts, batch.rewards, shaped, batch.truncated, batch.num_errors
    rollouts = rollout_batch(engine, prompts, spec, tokenizer, cfg)
    rewards, shaped, truncated, scored = score_rollouts(rollouts, prompts, tokenizer, reward_fn, cfg.rollout.max_new_tokens, cfg.algorithm)
    return rollouts, rewards, shaped, truncated, scored.num_errors


def agent_metrics(agent, cfg, step: int) -> dict[str, float]:
    """The episode metrics of the step (rollout.agents.stats) and, every rollout.agent_trace_every steps, a trace."""
    if agent is None:
        return {}
    from pathlib import Path

    from megatron_rl.rollout.agents.stats import write_trace

    metrics = agent.stats.take()
    every = cfg.rollout.agent_trace_every
    if every and step % every == 0 and agent.stats.last_trace:
        write_trace(Path(cfg.logging.dir) / "episodes.jsonl", step, agent.stats.last_trace)
    agent.stats.trace_episodes = cfg.rollout.agent_trace_episodes if every and (step + 1) % every == 0 else 0
    return metrics


def collect_experience(
    engine,
    dataset: PromptDataset,
    tokenizer: Tokenizer,
    reward_fn: Callable,
    cfg,
    step: int,
    agent=None,
) -> Experience:
    """Generate, score and filter until the step's batch is full (see the module docstring).

    agent: a rollout.agents.EpisodeRunner when rollout.agent is set (samples are episodes)."""
    algo, num_groups = cfg.algorithm, cfg.train.prompts_per_step
    accumulator = (DynamicSamplingAccumulator(num_groups, algo.max_num_gen_batches, group_filter=algo.group_filter)
                   if algo.dynamic_sampling else None)
    all_rewards, samples, rewards, shaped, truncated = [], [], None, None, None
    num_errors, gen_batch, generate_s, weight_version = 0, 0, 0.0, 0
    while True:
        prompts = dataset.next_batch(num_groups)
        spec = SamplingSpec.from_config(cfg.rollout, seed=step_seed(cfg.train.seed, step, gen_batch))
        start = time.perf_counter()
        rollouts, batch_rewards, batch_shaped, batch_truncated, errors = generate_and_score(engine, prompts, spec, tokenizer, reward_fn, cfg, agent)
        generate_s += time.perf_counter() - start
        weight_version = rollouts.weight_version
        all_rewards.append(batch_rewards)
        num_errors += errors
        group_ids = torch.tensor([gen_batch * num_groups + s.prompt_index for s in rollouts], dtype=torch.int64)
        gen_batch += 1
        if accumulator is None:
            samples, rewards, shaped, truncated = list(rollouts), batch_rewards, batch_shaped, batch_truncated
            group_ids = group_ids - group_ids.min()
            break
        # DAPO filters groups on the task reward (accuracy), not on the length-shaped one.
        accumulator.add(batch_rewards, group_ids, samples=list(rollouts), shaped=batch_shaped, truncated=batch_truncated)
        if accumulator.is_full:
            kept = accumulator.take()
            samples, rewards, shaped, truncated = kept["samples"], kept["rewards"], kept["shaped"], kept["truncated"]
            group_ids = kept["group_ids"]
            break
    experience = assemble_experience(samples, rewards, shaped, truncated, group_ids, weight_version, cfg, tokenizer)
    experience.metrics.update({
        "reward/mean": float(torch.cat(all_rewards).mean()),
        "reward/errors": float(num_errors),
        "rollout/generate_s": generate_s,
        "rollout/gen_batches": float(gen_batch),
        **agent_metrics(agent, cfg, step),
    })
    return experience


def assemble_experience(samples: list, rewards, shaped, truncated, group_ids, weight_version: int, cfg, tokenizer: Tokenizer) -> Experience:
    """The step's Experience from its kept samples (prompt-major groups): padding, advantages, overlong filter, metrics."""
    algo = cfg.algorithm
    # engine routes (R3, rollout.return_routed_experts) packed by sample: rank 0 holds no routes for padding
    padded = Rollouts(samples=samples, n_samples=cfg.rollout.n_samples, weight_version=weight_version).to_padded(
        tokenizer.pad_id, pack_routes=True)
    advantages = compute_advantages(shaped, group_ids, algo, group_size=cfg.rollout.n_samples)
    if algo.overlong_filter:
        padded.response_mask = overlong_filter_mask(padded.response_mask, truncated)
    lengths = padded.response_lengths.to(torch.float32)
    metrics = {
        "reward/train_mean": float(rewards.mean()),
        "reward/overlong_penalty": float((shaped - rewards).mean()),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_fraction": float(truncated.to(torch.float32).mean()),
        "rollout/weight_version": float(weight_version),
        "advantage/abs_mean": float(advantages.abs().mean()),
    }
    return Experience(rollouts=padded, rewards=shaped, advantages=advantages, group_ids=group_ids, truncated=truncated, metrics=metrics)
