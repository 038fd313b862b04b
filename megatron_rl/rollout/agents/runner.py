"""Running many episodes at once on a rollout engine: tokens in, tokens out.

    runner = EpisodeRunner(load_agent(cfg.rollout.agent), tokenizer, reward_fn, cfg)
    rollouts, rewards, lengths, truncated, errors = runner.run(engine, prompts, spec)

Every episode is one sample: prompt + all turns and observations. The loop:

1. an episode that waits for the model is one engine request (its exact token
   ids so far, at most max_new_tokens new ones, capped by the episode's token
   budget), sent as soon as the episode is ready (agents.turns: an in-process
   engine takes it into its next step, a server gets it over HTTP, the same
   server for every turn of the episode); no turn waits for the turns of other
   episodes. In-process, a weight push may land inside a turn: the turn goes
   on under the new weights and each token carries the version it was sampled
   with;
2. a finished turn goes to the environment (`step`) on a thread pool
   (rollout.agent_workers), so tools and slow environments run while the engine
   generates for the other episodes; the loop collects the answers that are
   ready after each engine step (and waits for one only when no episode needs
   the engine: then the engine is free for a push);
3. the observation is rendered (agents.render) and appended as tokens; the
   episode waits for the engine again, until the environment says done, the
   model ends a turn at max_new_tokens, or a limit is hit: rollout.agent_max_turns,
   rollout.agent_max_tokens (counted: agent/cut_max_turns, agent/cut_budget).

The sample's response is everything after the prompt; `response_loss_mask`
is True on the model's tokens, False on observations; `rollout_logprobs` are the
engine's (0 on observations); `token_versions` the weight version of each model
token (observations take their turn's). The response always ends with a model
token (no observation follows the last turn).

R3 (rollout.return_routed_experts): the engine records the routes of every
request of the batch (start before the loop, collect after it), and each
sample's routed_experts cover prompt + all turns: a position takes the route of
the first request of its episode that computed it, so observation tokens get
the routes the next turn's prefill computed (agents.routes, which also says
which weights computed which routes when a push lands between two turns).

Seeds: the first request of sample j of prompt i samples with
prompt_seed(seed, i) + j, the seed engine.generate gives it, so single-turn
episodes reproduce engine.generate's tokens exactly; a later request mixes
that seed with the episode's length so far.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
import traceback
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from megatron_rl.data.batch import RolloutSample, Rollouts
from megatron_rl.rollout.agents.base import AgentContext, Environment, ModelTurn, StepResult
from megatron_rl.rollout.agents.render import ObservationRenderer
from megatron_rl.rollout.agents.routes import EpisodeCapture, capture_routes
from megatron_rl.rollout.agents.stats import EpisodeStats
from megatron_rl.rollout.agents.turns import make_turns
from megatron_rl.rollout.engine_protocol import RolloutEngine
from megatron_rl.rollout.partial import SegmentOutput, SegmentRequest
from megatron_rl.rollout.sampling import SamplingSpec, prompt_seed

logger = logging.getLogger(__name__)

_GATHER_S = 0.005
"""With no episode waiting for the engine: after the first environment step finishes, how long the runner waits
for others to finish too, so that their next turns share one engine step."""
_POLL_S = 0.002
"""Servers, with environments running or turns to send: how long one poll waits for a turn to end."""
_HEALTH_POLL_S = 0.5
"""Servers, with nothing else to do: how long one poll waits for a turn to end."""


@dataclass
class Episode:
    """One episode in flight: its tokens so far, which of them the model sampled, and how it ended."""

    prompt_index: int
    sample_index: int
    prompt: Any
    seed: int | None
    env: Environment | None = None
    prompt_ids: list[int] = field(default_factory=list)
    response: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_start: int = 0
    """Index in `response` where the current model turn began."""
    turns: int = 0
    env_reward: float = 0.0
    final_text: str = ""
    finish_reason: str = "stop"
    cut: str = ""
    """'' (ended by the environment or the answer), 'max_turns', 'budget' or 'length'."""
    failed: str = ""
    """Why user code failed this episode ('' = it did not)."""
    done: bool = False
    turn_token_ids: list[list[int]] = field(default_factory=list)
    """Every model turn's token ids as the engine returned them (for tests and traces)."""
    requests: list[tuple[int, int]] = field(default_factory=list)
    """Every engine request: (its input tokens, the tokens it sampled) (R3: agents.routes)."""

    def request(self, max_new_tokens: int, budget: int) -> SegmentRequest | None:
        """The next engine request, or None when the budget leaves no room for a token."""
        room = budget - len(self.prompt_ids) - len(self.response)
        if room < 1:
            return None
        tokens = self.prompt_ids + self.response
        seed = self.seed if self.seed is None or not self.response else prompt_seed(self.seed, len(self.response))
        turn_so_far = len(self.response) - self.turn_start
        return SegmentRequest(tokens, min(max_new_tokens - turn_so_far, room), seed)

    def add_model_tokens(self, output: SegmentOutput, version: int) -> None:
        self.requests.append((len(self.prompt_ids) + len(self.response), len(output.token_ids)))
        self.response += output.token_ids
        self.mask += [True] * len(output.token_ids)
        self.logprobs += list(output.logprobs)
        self.versions += [version] * len(output.token_ids)

    def add_observation(self, ids: list[int]) -> None:
        version = self.versions[-1] if self.versions else 0
        self.response += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.turn_start = len(self.response)

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)

    def to_sample(self, eos_id: int) -> RolloutSample:
        response, mask, logprobs, versions = self.response, self.mask, self.logprobs, self.versions
        if self.failed:
            mask = [False] * len(response)
        if not response:  # failed before the first turn: one placeholder token, out of the loss
            response, mask, logprobs, versions = [eos_id], [False], [0.0], [0]
        return RolloutSample(
            prompt_index=self.prompt_index, sample_index=self.sample_index,
            prompt_token_ids=torch.tensor(self.prompt_ids, dtype=torch.int64),
            response_token_ids=torch.tensor(response, dtype=torch.int64),
            rollout_logprobs=torch.tensor(logprobs, dtype=torch.float32),
            finish_reason="length" if self.finish_reason == "length" else "stop",  # type: ignore[arg-type]
            stop_reason=None, weight_version=min(versions), token_versions=torch.tensor(versions, dtype=torch.int64),
            response_loss_mask=torch.tensor(mask, dtype=torch.bool),
        )


@dataclass
class EpisodeBatch:
    """What `EpisodeRunner.run` returns for a batch of prompts."""

    rollouts: Rollouts
    rewards: torch.Tensor
    """[N] float32 task rewards (rollout.agent_reward)."""
    model_tokens: torch.Tensor
    """[N] int64 model tokens per episode (what overlong shaping counts)."""
    truncated: torch.Tensor
    """[N] bool: a turn cut at max_new_tokens or by the budget (no EOS)."""
    num_errors: int
    """Reward-function failures plus failed episodes."""
    episodes: list[Episode]


class EpisodeRunner:
    """Runs episodes of one Environment class on an engine (see the module docstring)."""

    def __init__(self, agent_cls: type[Environment], tokenizer: Any, reward_fn: Callable, rollout_config: Any):
        self.agent_cls, self.tokenizer, self.reward_fn, self.config = agent_cls, tokenizer, reward_fn, rollout_config
        self.stats = EpisodeStats()
        self._ended: list[Episode] = []
        """Episodes ended since the loop last told the turn scheduler (its servers' live counts)."""
        if rollout_config.agent_trace_every:  # step 0 is traced; then every agent_trace_every steps (experience.agent_metrics)
            self.stats.trace_episodes = int(rollout_config.agent_trace_episodes)
        self.context = AgentContext(tokenizer=tokenizer, config=rollout_config, stats=self.stats)
        self.renderer = ObservationRenderer(tokenizer, getattr(agent_cls, "observation_role", "user"))
        self._pool = ThreadPoolExecutor(max_workers=int(rollout_config.agent_workers), thread_name_prefix="agent-env")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the loop ------------------------------------------------------------------------------------

    def run(
        self, engine: RolloutEngine, prompts: list, spec: SamplingSpec,
        engine_turn: Callable[[], ContextManager] | None = None, push_waiting: Callable[[], bool] = lambda: False,
    ) -> EpisodeBatch:
        budget = min(int(self.config.agent_max_tokens) or int(engine.max_model_len), int(engine.max_model_len))
        episodes = [
            Episode(i, j, p, None if spec.seed is None else prompt_seed(spec.seed, i) + j)
            for i, p in enumerate(prompts) for j in range(spec.n)
        ]
        self._ended.clear()
        waiting = deque(e for e in episodes if self._start(e))
        pending: dict[Future, Episode] = {}
        by_key = {id(e): e for e in episodes}
        turns = make_turns(engine, spec, engine_turn, push_waiting)
        start = time.perf_counter()
        with capture_routes(engine, spec.return_routed_experts) as routes:  # R3: every request of the batch
            try:
                while waiting or pending or turns.in_flight:
                    while waiting:  # every ready episode's turn joins the engine as soon as it has room
                        episode = waiting[0]
                        request = episode.request(spec.max_new_tokens, budget)
                        if request is None:
                            waiting.popleft()
                            self._end(episode, "budget")
                            continue
                        if not turns.admits(id(episode), request):
                            break
                        waiting.popleft()
                        turns.submit(id(episode), request)
                    if turns.in_flight:
                        for key, output, version in turns.poll(_POLL_S if pending or waiting else _HEALTH_POLL_S):
                            episode = by_key[key]
                            if self._turn_ended(episode, output, version, spec, pending):
                                waiting.append(episode)
                    done = [f for f in pending if f.done()]
                    if not done and pending and not waiting and not turns.in_flight:
                        turns.idle()  # every episode waits for its environment: a push may land now
                        wait(list(pending), return_when=FIRST_COMPLETED)
                        done = list(wait(list(pending), timeout=_GATHER_S).done)  # steps that end together share a step
                    for future in done:
                        episode = pending.pop(future)
                        if self._after_step(episode, future, budget):
                            waiting.append(episode)
                    while self._ended:  # episodes that ended this pass: their server takes new ones
                        turns.finish(id(self._ended.pop()))
            finally:
                turns.shutdown()
        self.stats.count("engine_requests", turns.requests)
        self.stats.count("engine_restarts", turns.restarts)
        self.stats.count("wall_s", time.perf_counter() - start)
        return self._finish(episodes, spec, routes)

    def _start(self, episode: Episode) -> bool:
        episode.env = self.agent_cls(self.context)
        try:
            first = episode.env.reset(episode.prompt)
            episode.prompt_ids = list(episode.prompt.token_ids) if first is None else self.renderer.prompt(first)
        except Exception as error:  # noqa: BLE001 - user code: fails this episode only
            episode.prompt_ids = list(episode.prompt.token_ids)
            self._fail(episode, "reset", error)
            return False
        return True

    def _turn_ended(self, episode: Episode, output: SegmentOutput, version: int, spec: SamplingSpec, pending: dict) -> bool:
        """Add a turn's tokens; its environment step goes to the pool. True when it must go on (a push interrupted it)."""
        episode.add_model_tokens(output, version)
        if output.finish_reason is None:  # a push interrupted the turn: it goes on under the new weights
            self.stats.count("interrupted_turns")
            return True
        turn_ids = episode.response[episode.turn_start:]
        episode.turn_token_ids.append(list(turn_ids))
        episode.turns += 1
        episode.final_text = self.tokenizer.decode(turn_ids)
        if output.finish_reason == "length":
            episode.finish_reason = "length"  # no EOS: at max_new_tokens, or the budget capped the turn
            self._end(episode, "length" if len(turn_ids) >= spec.max_new_tokens else "budget")
            return False
        turn = ModelTurn(index=episode.turns - 1, token_ids=list(turn_ids), text=episode.final_text, finish_reason=output.finish_reason)
        pending[self._pool.submit(_call_step, episode.env, turn)] = episode
        return False

    def _after_step(self, episode: Episode, future: Future, budget: int) -> bool:
        """Apply the environment's answer; True when the episode needs the engine again."""
        try:
            result = future.result()
            if not isinstance(result, StepResult):
                raise TypeError(f"step() returned {type(result).__name__}, not a StepResult")
            if result.reward is not None:
                reward = float(result.reward)
                if not math.isfinite(reward):
                    raise ValueError(f"step() returned reward {reward}")
                episode.env_reward += reward
            if result.done:
                self._end(episode, "")
                return False
            if episode.turns >= int(self.config.agent_max_turns):
                self._end(episode, "max_turns")
                return False
            ids = self.renderer.render(result.observation, getattr(episode.env, "observation_role", None))
        except Exception as error:  # noqa: BLE001 - user code: fails this episode only
            self._fail(episode, "step", error)
            return False
        if len(episode.prompt_ids) + len(episode.response) + len(ids) >= budget:
            self._end(episode, "budget")
            return False
        episode.add_observation(ids)
        self.stats.count("observation_tokens", len(ids))
        return True

    def _end(self, episode: Episode, cut: str) -> None:
        episode.done, episode.cut = True, cut
        self._ended.append(episode)
        if cut:
            self.stats.count(f"cut_{cut}")

    def _fail(self, episode: Episode, where: str, error: BaseException) -> None:
        episode.done, episode.failed = True, f"{where}: {type(error).__name__}: {error}"
        self._ended.append(episode)
        self.stats.count("failed_episodes")
        if self.stats.failed_logged < 3:
            self.stats.failed_logged += 1
            logger.warning(
                "episode of prompt %d sample %d failed in %s.%s (it leaves the loss, reward 0):\n%s",
                episode.prompt_index, episode.sample_index, type(episode.env).__name__, where,
                "".join(traceback.format_exception(type(error), error, error.__traceback__)).strip(),
            )

    # -- rewards and samples ---------------------------------------------------------------------------

    def _finish(self, episodes: list[Episode], spec: SamplingSpec, routes: EpisodeCapture | None = None) -> EpisodeBatch:
        from megatron_rl.rollout.rewards import compute_rewards

        mode = self.config.agent_reward
        answer = torch.zeros(len(episodes), dtype=torch.float32)
        errors = 0
        if mode in ("answer", "both"):
            scored = compute_rewards(
                self.reward_fn, [e.final_text for e in episodes], [e.prompt.answer for e in episodes],
                [e.prompt.text for e in episodes],
            )
            answer, errors = torch.tensor(scored.rewards, dtype=torch.float32), scored.num_errors
        env = torch.tensor([e.env_reward for e in episodes], dtype=torch.float32)
        rewards = answer if mode == "answer" else env if mode == "env" else answer + env
        failed = torch.tensor([bool(e.failed) for e in episodes])
        rewards = torch.where(failed, torch.zeros_like(rewards), rewards)
        samples = [e.to_sample(self.tokenizer.eos_id) for e in episodes]
        if routes is not None:  # R3: prompt + every turn, each position routed by the first request that computed it
            routes.attach(episodes, samples, bool(self.config.routed_experts_include_prompt))
        rollouts = Rollouts(samples=samples, n_samples=spec.n, weight_version=min(s.weight_version for s in samples))
        self.stats.add_episodes(episodes)
        self.stats.maybe_keep_trace(episodes, self.tokenizer, rewards)
        return EpisodeBatch(
            rollouts=rollouts, rewards=rewards,
            model_tokens=torch.tensor([e.model_tokens for e in episodes], dtype=torch.int64),
            truncated=torch.tensor([e.finish_reason == "length" for e in episodes], dtype=torch.bool),
            num_errors=errors + int(failed.sum()), episodes=episodes,
        )


def _call_step(env: Environment, turn: ModelTurn) -> Any:
    result = env.step(turn)
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable
