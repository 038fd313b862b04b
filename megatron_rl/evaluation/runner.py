"""Evaluating the held-out sets of data.eval_sets with a rollout engine: load and check, generate, score, report.

    evaluator = Evaluator.from_config(cfg, tokenizer)       # every set read and checked: no engine yet
    report = evaluator.evaluate(engine, step=n)               # k samples of every prompt of every set
    report.metrics      # {"eval/<set>/mean@k": ..., "eval/<set>/<source>/pass@1": ...} for the metric sinks
    report.table()      # the console table
    report.write(dir)   # <dir>/step_<n>.json: config, metrics, per source, per prompt

1. Loading (`load_eval_set`): the training data's row checks (prompt and
   answer fields), prompts longer than rollout.max_prompt_tokens are an error
   (a dropped prompt would change the score), every row must be scorable by
   the set's reward (megatron_rl.evaluation.answers), k and pass@k checked.
2. Generation (`samples.generate_samples`, the one engine call of single-turn
   evaluation): one engine call per set, all prompts at once, k samples each, with the
   set's sampling settings and a seed fixed by (train.seed, set name): the same
   at every step and in `megatron-rl eval`, and apart from the training seeds, so
   training is the same with or without evaluation. With rollout.agent set,
   every sample is instead a whole episode of that agent, with the same
   settings and seeds (megatron_rl.evaluation.samples).
3. Scoring: the set's reward on every sample (failures counted, as in
   training; an episode's score is its reward, rollout.agent_reward), final
   answers and the maj@k vote, then scores.aggregate over the set and over each
   data source. Episodes add their agent statistics (eval/<set>/agent/...).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from megatron_rl.config.core import to_dict
from megatron_rl.config.evaluation import EvalSetConfig
from megatron_rl.data.dataset import DatasetError, Prompt, PromptDataset, read_rows
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.evaluation.answers import AnswerRule, EvalSetError, answer_rule, check_scorable
from megatron_rl.evaluation.samples import SetSamples, episode_samples, reward_fails, single_turn_samples
from megatron_rl.evaluation.scores import PromptResult, aggregate, by_source, majority_vote
from megatron_rl.rollout.rewards import compute_rewards, get_reward_fn
from megatron_rl.rollout.sampling import SamplingSpec

logger = logging.getLogger(__name__)

SOURCE_KEY = "data_source"
"""The optional column naming each row's data source (metrics per source)."""


@dataclass(kw_only=True)
class EvalSet:
    """One held-out set, read, tokenised and checked."""

    name: str
    config: EvalSetConfig
    prompts: list[Prompt]
    sources: list[str]
    """data_source of each prompt ("" where the row has none)."""
    reward: str
    """The reward's name (registered or module:function)."""
    reward_fn: Callable
    rule: AnswerRule
    spec: SamplingSpec
    """k samples per prompt, the set's sampling settings and seed."""


def eval_seed(train_seed: int, name: str) -> int:
    """The sampling seed of set `name`: fixed across steps, distinct per set (below 2**60; sampling mixes in the prompt)."""
    digest = hashlib.sha256(f"eval:{train_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 4


def load_eval_set(name: str, config: EvalSetConfig, cfg, tokenizer: Tokenizer) -> EvalSet:
    """Read and check set `name` (module docstring, step 1); EvalSetError / DatasetError name the row and the fix."""
    where = f"data.eval_sets.{name} ({config.path})"
    dataset = PromptDataset(
        config.path, tokenizer, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
        apply_chat_template=cfg.data.apply_chat_template, max_prompt_tokens=cfg.rollout.max_prompt_tokens,
        long_prompts="error", shuffle=False,
    )
    rows = read_rows(config.path)
    sources = []
    for prompt in dataset.prompts:
        source = rows[prompt.index].get(SOURCE_KEY)
        if source is not None and not isinstance(source, (str, int)):
            raise DatasetError(f"{where} row {prompt.index}: field {SOURCE_KEY!r} must be a string, got {source!r}")
        sources.append("" if source is None else str(source))
    reward = config.reward or cfg.data.reward
    reward_fn = get_reward_fn(reward)
    rule = answer_rule(reward, reward_fn)
    check_scorable(dataset.prompts, reward, reward_fn, rule, where)
    spec = SamplingSpec.from_config(
        cfg.rollout, n=config.k, temperature=config.temperature, top_p=config.top_p, top_k=-1,
        max_new_tokens=config.max_new_tokens or cfg.rollout.max_new_tokens, seed=eval_seed(cfg.train.seed, name),
        return_routed_experts=False,
    )
    spec.validate()
    return EvalSet(name=name, config=config, prompts=dataset.prompts, sources=sources, reward=reward, reward_fn=reward_fn, rule=rule, spec=spec)


def score_set(eval_set: EvalSet, samples: SetSamples) -> list[PromptResult]:
    """Rewards, final answers and the maj@k vote of every prompt's samples (episodes come with their rewards)."""
    k, config = eval_set.config.k, eval_set.config
    responses, texts = samples.responses, samples.answer_texts
    prompts = eval_set.prompts
    rewards, failed = samples.rewards, set(samples.failed)
    if rewards is None:
        answers = [prompts[i // k].answer for i in range(len(texts))]
        prompt_texts = [prompts[i // k].text for i in range(len(texts))]
        scored = compute_rewards(eval_set.reward_fn, texts, answers, prompt_texts)
        rewards = scored.rewards
        if scored.num_errors:  # compute_rewards counts failures; which samples failed is needed per prompt
            failed = {i for i, (r, a, t) in enumerate(zip(texts, answers, prompt_texts)) if reward_fails(eval_set.reward_fn, r, a, t)}
    results = []
    for p, prompt in enumerate(prompts):
        span = range(p * k, (p + 1) * k)
        finals = [eval_set.rule.final(texts[i]) for i in span]
        results.append(PromptResult(
            index=prompt.index,
            data_source=eval_set.sources[p],
            answer=prompt.answer,
            rewards=[rewards[i] for i in span],
            correct=[rewards[i] >= config.correct_at for i in span],
            lengths=[samples.lengths[i] for i in span],
            truncated=[samples.truncated[i] for i in span],
            final_answers=finals,
            majority=majority_vote(finals, eval_set.rule.same),
            reward_errors=sum(i in failed for i in span),
            responses=[responses[i] for i in span] if config.save_responses else None,
        ))
    return results


@dataclass(kw_only=True)
class SetReport:
    """One set's scores at one step."""

    name: str
    config: EvalSetConfig
    metrics: dict[str, float]
    sources: dict[str, dict[str, float]]
    results: list[PromptResult]
    generate_s: float
    """Seconds the engine took to generate the set's samples."""
    agent: dict[str, float] = field(default_factory=dict)
    """rollout.agent set: the set's episode statistics (agent/turns_mean, agent/tool_calls/<tool>, agent/cut_<reason>, ...)."""


@dataclass(kw_only=True)
class EvalReport:
    """Every set's scores at one step (weights of version `step`)."""

    step: int
    sets: list[SetReport] = field(default_factory=list)

    @property
    def metrics(self) -> dict[str, float]:
        """Flat numbers for the metric sinks: eval/<set>/<metric> and eval/<set>/<source>/<metric>."""
        flat = {}
        for s in self.sets:
            flat.update({f"eval/{s.name}/{key}": value for key, value in s.metrics.items()})
            for source, metrics in s.sources.items():
                flat.update({f"eval/{s.name}/{source}/{key}": value for key, value in metrics.items()})
            flat.update({f"eval/{s.name}/{key}": value for key, value in s.agent.items()})
            flat[f"eval/{s.name}/generate_s"] = s.generate_s
        return flat

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "sets": {
                s.name: {
                    "config": to_dict(s.config), "metrics": s.metrics, "sources": s.sources, "generate_s": s.generate_s,
                    **({"agent": s.agent} if s.agent else {}), "prompts": [r.to_json() for r in s.results],
                }
                for s in self.sets
            },
        }

    def write(self, directory: str | Path, path: str | Path | None = None) -> Path:
        """<directory>/step_<step>.json (or `path`), written whole (a temporary file renamed)."""
        path = Path(path) if path is not None else Path(directory) / f"step_{self.step}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(self.to_json(), indent=1))
        partial.replace(path)
        return path

    def table(self) -> str:
        """The console table: one line per set and per data source."""
        head = ["set", "source", "prompts", "k", "mean@k", "pass@1", "pass@k", "maj@k", "len mean", "p50", "p95", "max", "trunc", "errors"]
        lines = []
        for s in self.sets:
            for source, m in [("all", s.metrics), *s.sources.items()]:
                k = int(m["samples_per_prompt"])
                lines.append([
                    s.name, source, f"{int(m['num_prompts'])}", f"{k}", f"{m[f'mean@{k}']:.3f}", _cell(m, "pass@1"),
                    _cell(m, f"pass@{k}"), f"{m[f'maj@{k}']:.3f}", f"{m['length_mean']:.1f}", f"{m['length_p50']:.0f}",
                    f"{m['length_p95']:.0f}", f"{m['length_max']:.0f}", f"{m['truncated_fraction']:.3f}", f"{int(m['reward_errors'])}",
                ])
        widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head))]
        render = lambda row: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
        episodes = [_episodes_line(s.name, s.agent) for s in self.sets if s.agent]
        return "\n".join([f"evaluation at step {self.step}", render(head), *map(render, lines), *episodes])


def _episodes_line(name: str, agent: dict[str, float]) -> str:
    """One console line of a set's episode statistics (rollout.agent set)."""
    tools = sorted(key.rsplit("/", 1)[1] for key in agent if key.startswith("agent/tool_calls/"))
    calls = ", ".join(f"{t} {int(agent[f'agent/tool_calls/{t}'])} ({int(agent[f'agent/tool_errors/{t}'])} errors)" for t in tools) or "none"
    cuts = "/".join(f"{int(agent.get(f'agent/cut_{c}', 0))}" for c in ("max_turns", "budget", "length"))
    return (
        f"{name} episodes: {int(agent['agent/episodes'])}, turns mean {agent['agent/turns_mean']:.2f} max {int(agent['agent/turns_max'])}, "
        f"tool calls: {calls}, cut max_turns/budget/length {cuts}, failed {int(agent['agent/failed_episodes'])}"
    )


def _cell(metrics: dict[str, float], key: str) -> str:
    return f"{metrics[key]:.3f}" if key in metrics else "-"


class Evaluator:
    """The sets of data.eval_sets, loaded and checked once; evaluate() scores them with an engine's current weights.

    With rollout.agent set (`agent_cls`), every sample is an episode of that agent (evaluation.samples)."""

    def __init__(self, sets: list[EvalSet], tokenizer: Tokenizer, agent_cls: type | None = None, rollout_config: Any = None):
        self.sets, self.tokenizer = sets, tokenizer
        self.agent_cls, self.rollout_config = agent_cls, rollout_config

    @classmethod
    def from_config(cls, cfg, tokenizer: Tokenizer) -> "Evaluator":
        sets = [load_eval_set(name, config, cfg, tokenizer) for name, config in cfg.data.eval_sets.items()]
        agent_cls = None
        if cfg.rollout.agent:
            from megatron_rl.rollout.agents import load_agent

            agent_cls = load_agent(cfg.rollout.agent)
        return cls(sets, tokenizer, agent_cls, cfg.rollout)

    def samples(self, engine, eval_set: EvalSet) -> SetSamples:
        """The set's k samples per prompt: episodes when an agent is set, else single-turn completions."""
        if self.agent_cls is not None:
            return episode_samples(engine, eval_set, self.tokenizer, self.agent_cls, self.rollout_config)
        return single_turn_samples(engine, eval_set, self.tokenizer)

    def evaluate(self, engine, step: int) -> EvalReport:
        report = EvalReport(step=step)
        for eval_set in self.sets:
            start = time.perf_counter()
            samples = self.samples(engine, eval_set)
            generate_s = time.perf_counter() - start
            results = score_set(eval_set, samples)
            pass_ks = eval_set.config.pass_ks()
            report.sets.append(SetReport(
                name=eval_set.name, config=eval_set.config, metrics=aggregate(results, pass_ks),
                sources=by_source(results, pass_ks), results=results, generate_s=generate_s, agent=samples.agent_metrics,
            ))
        return report


__all__ = ["EvalReport", "EvalSet", "EvalSetError", "Evaluator", "SetReport", "load_eval_set", "score_set"]
