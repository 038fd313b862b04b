"""Asynchronous experience: rollout runs continuously beside training, bounded by a staleness limit.

With train.max_staleness = S > 0 the rank holding the engine runs a producer
thread that never waits for the trainer except to respect the bound:

1. draw train.prompts_per_step prompts, generate rollout.n_samples each (with
   train.partial_rollouts, interruptible by pushes: `rollout.partial`), score
   them, drop the groups algorithm.group_filter drops when dynamic sampling is
   on (it filters the stream), and queue each group tagged with its weight version (the
   oldest version any of its tokens was sampled with);
2. repeat while fewer than S x prompts_per_step groups wait in the queue.

The trainer's step k (its weights are version k) takes prompts_per_step groups
in order; a group with staleness k - version > S is dropped and counted
(`async/dropped_stale_groups`), so every trained group satisfies the bound
(per token too: the batch carries each token's version, and the actor leaves
tokens beyond the bound out of the loss, `async/stale_tokens_masked/sum`). The
trainer's old-policy forward runs at version k, so the loss needs the
behaviour correction algorithm.tis_mode (required by the config).
At the end of the step the trainer pushes version k + 1 inside
`paused_for_push()`: the push waits for the engine call in progress (a whole
generation batch; with partial rollouts, one decode step: the generation sees
`push_waiting()`, stops and lets the push run, then continues the samples in
flight), the producer then continues on the new weights. Generation stops for
no longer than the push.

Data position and resume: prompts are drawn in order and groups are consumed
in the same order (FIFO), so the prompts whose groups were trained, dropped as
stale or filtered out form a prefix of the data stream. Checkpoints store the
position right after the last consumed group (`consumed_position`); on resume
the producer starts there: no prompt is trained twice, and the groups that were
queued or in flight at the checkpoint are generated again (with the resumed
weights) rather than restored.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_rl.algorithms import DynamicSamplingExhausted, kept_samples
from megatron_rl.experience import Experience, agent_metrics, assemble_experience, generate_and_score, score_rollouts, step_seed
from megatron_rl.rollout.function import rollout_batch
from megatron_rl.rollout.partial import generate_partial
from megatron_rl.rollout.sampling import SamplingSpec

logger = logging.getLogger(__name__)

_STREAM_SEED_OFFSET = 1 << 20
"""Generation batch b of the stream samples with step_seed(seed, offset + b, 0): apart from the synchronous loop's seeds."""


@dataclass
class Group:
    """The n samples of one prompt, scored, with where the data stream stands after its prompt."""

    samples: list
    rewards: torch.Tensor
    shaped: torch.Tensor
    truncated: torch.Tensor
    version: int
    """Oldest weight version of any token of the group."""
    data_position: dict
    """PromptDataset.state_dict() right after this group's prompt was drawn."""


class AsyncExperienceStream:
    """The producer thread and the trainer's side of it (lives on the rank that holds the engine)."""

    def __init__(self, engine, dataset, tokenizer, reward_fn: Callable, cfg, *, first_batch: int = 0, agent=None):
        """agent: a rollout.agents.EpisodeRunner when rollout.agent is set (samples are episodes)."""
        self.engine, self.dataset, self.tokenizer, self.reward_fn, self.cfg = engine, dataset, tokenizer, reward_fn, cfg
        self.agent = agent
        self.max_staleness = cfg.train.max_staleness
        self.groups_per_step = cfg.train.prompts_per_step
        self._capacity = self.groups_per_step * self.max_staleness
        self._cond = threading.Condition()
        self._queue: deque[Group] = deque()
        self._push_pending = self._engine_busy = self._stopping = False
        self._error: BaseException | None = None
        self._batch_index = first_batch
        self.consumed_position = dataset.state_dict()
        self.counters = {"dropped_stale_groups": 0, "filtered_groups": 0, "reward_errors": 0}
        self._engine_s = 0.0  # engine busy time since the last take
        self._thread = threading.Thread(target=self._produce, name="rollout-producer", daemon=True)
        self._thread.start()

    # -- producer ------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def engine_turn(self):
        """Around every engine call of the producer: waits while a push (or evaluation) holds the engine."""
        with self._cond:
            self._cond.wait_for(lambda: not self._push_pending or self._stopping)
            if self._stopping:
                raise _Stopped()
            self._engine_busy = True
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._cond:
                self._engine_busy = False
                self._engine_s += time.perf_counter() - start
                self._cond.notify_all()

    def queued_groups(self) -> int:
        """Groups generated and waiting for the trainer."""
        with self._cond:
            return len(self._queue)

    def push_waiting(self) -> bool:
        """Whether a push (or evaluation) waits for the engine: a partial rollout stops after its current step."""
        return self._push_pending

    def _produce(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or len(self._queue) < self._capacity)
                    if self._stopping:
                        return
                groups = self._generate_batch()
                with self._cond:
                    self._queue.extend(groups)
                    self._cond.notify_all()
        except _Stopped:
            return
        except BaseException as error:  # noqa: BLE001 - handed to the trainer's next take()
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _generate_batch(self) -> list[Group]:
        cfg, algo = self.cfg, self.cfg.algorithm
        prompts, positions = [], []
        for _ in range(self.groups_per_step):
            prompts += self.dataset.next_batch(1)
            positions.append(self.dataset.state_dict())
        spec = SamplingSpec.from_config(cfg.rollout, seed=step_seed(cfg.train.seed, _STREAM_SEED_OFFSET + self._batch_index, 0))
        self._batch_index += 1
        token_ids = [p.token_ids for p in prompts]
        if self.agent is not None:  # episodes: every turn is an engine call of its own, inside engine_turn()
            push_waiting = self.push_waiting if cfg.train.partial_rollouts else (lambda: False)
            rollouts, rewards, shaped, truncated, errors = generate_and_score(
                self.engine, prompts, spec, self.tokenizer, self.reward_fn, cfg, self.agent, self.engine_turn, push_waiting
            )
        else:
            if cfg.train.partial_rollouts:
                rollouts = generate_partial(self.engine, token_ids, spec, self.engine_turn, self.push_waiting)
            else:
                with self.engine_turn():
                    rollouts = rollout_batch(self.engine, prompts, spec, self.tokenizer, cfg)
            rewards, shaped, truncated, scored = score_rollouts(rollouts, prompts, self.tokenizer, self.reward_fn, cfg.rollout.max_new_tokens, algo)
            errors = scored.num_errors
        self.counters["reward_errors"] += errors
        n = cfg.rollout.n_samples
        group_ids = torch.arange(len(prompts), dtype=torch.int64).repeat_interleave(n)
        keep = kept_samples(algo.group_filter, rewards, group_ids).tolist() if algo.dynamic_sampling else None
        groups = []
        for i in range(len(prompts)):
            rows = slice(i * n, (i + 1) * n)
            group_rewards = rewards[rows]
            if keep is not None and not keep[i * n]:
                self.counters["filtered_groups"] += 1
                groups.append(Group([], group_rewards, shaped[rows], truncated[rows], -1, positions[i]))  # consumed, never trained
                continue
            samples = rollouts.group(i)
            groups.append(Group(samples, group_rewards, shaped[rows], truncated[rows], min(s.weight_version for s in samples), positions[i]))
        return groups

    # -- trainer side ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def paused_for_push(self):
        """Hold the engine for a weight push (or an evaluation): waits for the engine call in progress."""
        with self._cond:
            self._push_pending = True
            self._cond.wait_for(lambda: not self._engine_busy)
        try:
            yield
        finally:
            with self._cond:
                self._push_pending = False
                self._cond.notify_all()

    def take(self, trainer_version: int) -> Experience:
        """prompts_per_step groups of staleness <= max_staleness for the trainer at weight version `trainer_version`."""
        start = time.perf_counter()
        kept: list[Group] = []
        seen_rewards = []  # task rewards of the groups generated for this step (kept and filtered, not stale)
        dropped = filtered = 0
        while len(kept) < self.groups_per_step:
            group = self._next_group()
            self.consumed_position = group.data_position
            if not group.samples:
                filtered += 1
                seen_rewards.append(group.rewards)
                self._check_not_exhausted(filtered, len(kept))
            elif trainer_version - group.version > self.max_staleness:
                dropped += 1
                self.counters["dropped_stale_groups"] += 1
            else:
                kept.append(group)
                seen_rewards.append(group.rewards)
        wait_s = time.perf_counter() - start
        with self._cond:
            engine_s, self._engine_s = self._engine_s, 0.0
        experience = self._experience(kept, trainer_version, wait_s, engine_s, dropped, filtered)
        experience.metrics["reward/mean"] = float(torch.cat(seen_rewards).mean())
        experience.metrics.update(agent_metrics(self.agent, self.cfg, trainer_version))
        return experience

    def _check_not_exhausted(self, filtered: int, kept: int) -> None:
        """Dynamic sampling on the stream gives up, as the synchronous loop does, after max_num_gen_batches batches' worth."""
        limit = self.cfg.algorithm.max_num_gen_batches * self.groups_per_step
        if filtered >= limit:
            raise DynamicSamplingExhausted(
                f"dynamic sampling filtered {filtered} groups in a row for one step (algorithm.group_filter="
                f"{self.cfg.algorithm.group_filter}: by default those whose rewards are all equal) and kept "
                f"{kept} of train.prompts_per_step={self.groups_per_step}: raise algorithm.max_num_gen_batches "
                f"(now {self.cfg.algorithm.max_num_gen_batches}), use a reward that tells samples apart, or turn "
                "algorithm.dynamic_sampling off"
            )

    def _next_group(self) -> Group:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._error is not None)
            if self._error is not None and not self._queue:
                raise RuntimeError(f"the rollout producer failed: {type(self._error).__name__}: {self._error}") from self._error
            group = self._queue.popleft()
            self._cond.notify_all()
            return group

    def _experience(self, groups: list[Group], trainer_version: int, wait_s: float, engine_s: float, dropped: int, filtered: int) -> Experience:
        n = self.cfg.rollout.n_samples
        samples = [s for g in groups for s in g.samples]
        group_ids = torch.arange(len(groups), dtype=torch.int64).repeat_interleave(n)
        oldest = min(g.version for g in groups)
        experience = assemble_experience(
            samples, torch.cat([g.rewards for g in groups]), torch.cat([g.shaped for g in groups]),
            torch.cat([g.truncated for g in groups]), group_ids, oldest, self.cfg, self.tokenizer,
        )
        staleness = [trainer_version - g.version for g in groups]
        versions_per_sample = max(int(_token_versions(s).unique().numel()) for s in samples)
        experience.metrics.update({
            "rollout/generate_s": engine_s,
            "async/wait_s": wait_s,
            "async/staleness_max": float(max(staleness)),
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/versions_per_sample_max": float(versions_per_sample),
            "async/dropped_stale_groups": float(dropped),
            "async/filtered_groups": float(filtered),
            "async/dropped_stale_groups_total": float(self.counters["dropped_stale_groups"]),
        })
        return experience

    def close(self) -> None:
        """Stop the producer (it finishes the engine call in progress) and join it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()


class _Stopped(Exception):
    """The stream was closed while the producer waited for the engine."""


def _token_versions(sample: Any) -> torch.Tensor:
    if sample.token_versions is not None:
        return sample.token_versions
    return torch.full((sample.response_length,), sample.weight_version, dtype=torch.int64)


__all__ = ["AsyncExperienceStream", "Group"]
