"""Where each step's experience comes from: one interface for the three ways of generating it.

    source = experience_source(cfg, dataset, tokenizer, reward_fn, agent)   # the one place the mode is chosen
    source.restore(trainer_state["data"])           # a resume, before the engine starts
    source.start(engine, first_step=step)           # once the engine serves the trainer's weights
    experience = source.take(step, weight_version)  # every step (None on a rank without the engine)
    source.before_weights_change()                  # then the push, inside source.engine_held()
    trainer_state["data"] = source.position()       # what a checkpoint stores
    source.close()

| train config | source | step k trains on samples of | generation runs |
| --- | --- | --- | --- |
| (default) | SynchronousSource | weights k | inside take(k) |
| off_policy_lag=1 | LaggedSource | weights k - 1 (k > first step) | step k + 1's beside step k's training |
| max_staleness=S | StreamingSource | weights k - S .. k | continuously (megatron_rl.async_experience) |

Ranks other than the one holding the engine get NoExperienceHere: their rows
come from actor.distribute.

The data position (`position()`) is where a resumed run draws its next prompt:
the prompts of every step trained so far are behind it, those of a batch
generated ahead (the lag's next step, the stream's queued groups) are not, so
a resume generates them again with the resumed weights. It is
data.dataset.PromptDataset's state_dict (epoch, cursor, seed, size).
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, ContextManager, Protocol

from megatron_rl.async_experience import AsyncExperienceStream
from megatron_rl.data.dataset import PromptDataset
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.experience import Experience, collect_experience


class ExperienceSource(Protocol):
    """The trainer's only view of generation (see the module docstring for the order of the calls)."""

    def start(self, engine, first_step: int) -> None:
        """Generation may use `engine` from now on; `first_step` is the first step the run trains."""

    def take(self, step: int, weight_version: int) -> Experience | None:
        """Step `step`'s experience for the actor at `weight_version` (rank 0's; None on other ranks)."""

    def before_weights_change(self) -> None:
        """The step's push comes next: generation that must use the current weights finishes first."""

    def engine_held(self) -> ContextManager[None]:
        """The engine to the caller alone inside the block (a push, an evaluation)."""

    def position(self) -> dict | None:
        """The data position a checkpoint stores (None on ranks without the data)."""

    def restore(self, position: dict) -> None:
        """Continue from a checkpoint's `position()` (before start)."""

    def close(self) -> None:
        """Stop generating and release threads."""


class SynchronousSource:
    """Step k's experience is generated inside take(k) with weights k (megatron_rl.experience.collect_experience)."""

    def __init__(self, dataset: PromptDataset, tokenizer: Tokenizer, reward_fn: Callable, cfg, agent=None):
        self.dataset, self.tokenizer, self.reward_fn, self.cfg, self.agent = dataset, tokenizer, reward_fn, cfg, agent
        self.engine = None

    def start(self, engine, first_step: int) -> None:
        self.engine = engine

    def take(self, step: int, weight_version: int) -> Experience:
        return collect_experience(self.engine, self.dataset, self.tokenizer, self.reward_fn, self.cfg, step, agent=self.agent)

    def before_weights_change(self) -> None:
        pass

    def engine_held(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def position(self) -> dict:
        return self.dataset.state_dict()

    def restore(self, position: dict) -> None:
        self.dataset.load_state_dict(position)

    def close(self) -> None:
        pass


class LaggedSource(SynchronousSource):
    """train.off_policy_lag=1: take(k) hands over step k's experience, generated while step k - 1 trained (with the
    weights before its update), and starts step k + 1's on a background thread; the first step's is generated in
    take. The push waits for it (before_weights_change), so each batch is sampled with one version of the weights."""

    def __init__(self, dataset: PromptDataset, tokenizer: Tokenizer, reward_fn: Callable, cfg, agent=None):
        super().__init__(dataset, tokenizer, reward_fn, cfg, agent)
        self._executor = ThreadPoolExecutor(max_workers=1)
        self._pending: tuple[Future, dict] | None = None
        """The next step's generation and the data position it starts from."""

    def take(self, step: int, weight_version: int) -> Experience:
        if self._pending is not None:
            future, _ = self._pending
            self._pending = None
            experience = future.result()
        else:
            experience = super().take(step, weight_version)
        if step + 1 < self.cfg.train.steps:
            position = self.dataset.state_dict()  # where the in-flight step starts, for checkpoints
            self._pending = (self._executor.submit(super().take, step + 1, weight_version), position)
        return experience

    def before_weights_change(self) -> None:
        if self._pending is not None:  # the next step's generation must finish on the old weights
            self._pending[0].result()

    def position(self) -> dict:
        return self._pending[1] if self._pending is not None else self.dataset.state_dict()

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class StreamingSource:
    """train.max_staleness = S > 0: a producer thread generates continuously (async_experience.AsyncExperienceStream,
    started by start()); take(k) hands over groups at most S weight versions old, a push pauses the producer."""

    def __init__(self, dataset: PromptDataset, tokenizer: Tokenizer, reward_fn: Callable, cfg, agent=None):
        self.dataset, self.tokenizer, self.reward_fn, self.cfg, self.agent = dataset, tokenizer, reward_fn, cfg, agent
        self._stream: AsyncExperienceStream | None = None

    def start(self, engine, first_step: int) -> None:
        self._stream = AsyncExperienceStream(engine, self.dataset, self.tokenizer, self.reward_fn, self.cfg,
                                             first_batch=first_step, agent=self.agent)

    def take(self, step: int, weight_version: int) -> Experience:
        return self._stream.take(weight_version)

    def before_weights_change(self) -> None:
        pass  # engine_held() pauses the producer for the push

    def engine_held(self) -> ContextManager[None]:
        return self._stream.paused_for_push() if self._stream is not None else contextlib.nullcontext()

    def position(self) -> dict:
        # groups queued or in flight are generated again on resume
        return self._stream.consumed_position if self._stream is not None else self.dataset.state_dict()

    def restore(self, position: dict) -> None:
        self.dataset.load_state_dict(position)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


class NoExperienceHere:
    """A rank without the engine: its rows of each step arrive by actor.distribute."""

    def start(self, engine, first_step: int) -> None:
        pass

    def take(self, step: int, weight_version: int) -> None:
        return None

    def before_weights_change(self) -> None:
        pass

    def engine_held(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def position(self) -> None:
        return None

    def restore(self, position: dict) -> None:
        pass

    def close(self) -> None:
        pass


def experience_source(cfg, dataset: PromptDataset | None, tokenizer: Tokenizer | None, reward_fn: Callable,
                      agent=None) -> ExperienceSource:
    """The run's experience source, chosen from train.max_staleness and train.off_policy_lag (the config refuses
    both at once); dataset None: a rank without the engine."""
    if dataset is None:
        return NoExperienceHere()
    if cfg.train.max_staleness:
        return StreamingSource(dataset, tokenizer, reward_fn, cfg, agent)
    if cfg.train.off_policy_lag:
        return LaggedSource(dataset, tokenizer, reward_fn, cfg, agent)
    return SynchronousSource(dataset, tokenizer, reward_fn, cfg, agent)


__all__ = ["ExperienceSource", "LaggedSource", "NoExperienceHere", "StreamingSource", "SynchronousSource", "experience_source"]
