"""Partial rollouts: a weight push interrupts generation after the engine step in progress.

    rollouts = generate_partial(engine, prompt_ids, spec, engine_turn=stream.engine_turn,
                                push_waiting=stream.push_waiting)

Every sample is one engine request (sample j of prompt i). The engine runs the
requests one engine step at a time (in-process: vLLM's LLMEngine add_request /
step / abort_request with DELTA outputs; servers: streamed completions) and
asks `push_waiting()` after every step. A segment is what one such run gives:

1. inside `engine_turn()`, the engine generates until every request finished
   or a push waits; then it aborts the unfinished requests and returns each
   request's new tokens and engine logprobs so far, tagged with the weight
   version that sampled them (one version per segment: pushes wait for it);
2. the segment's turn ends, so the waiting push runs: it waited for one decode
   step of the engine, not for the longest sample of the batch;
3. the open samples go back to the engine as prompt + response so far with the
   remaining max_new_tokens, under the new weights.

So every response token carries the weight version and the engine logprob it
was sampled with (`RolloutSample.token_versions`, `rollout_logprobs`), and a
sample's `weight_version` is its oldest token's (what staleness is measured by).
Cost of an interruption: each open sample's prompt + prefix is prefilled again
under the new weights (the push reset the prefix cache; the KV of the old
weights would not be the new model's). Without a push, nothing is re-prefilled.

Seeds: segment 0 of sample j of prompt i samples with prompt_seed(seed, i) + j,
the seed engine.generate gives it, so a batch no push interrupts has the tokens
engine.generate gives. A continued sample samples with a seed mixed from that
one and its prefix length (where the push landed depends on timing).

Not supported (refused at config load, and here): routed-expert capture (R3:
the routes of a continued prefix are recomputed under the new weights) and stop
strings (one could span two segments; vLLM checks only the new text). Stop
token ids and EOS end a sample as usual.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Protocol, Sequence, runtime_checkable

import torch

from megatron_rl.data.batch import RolloutSample, Rollouts
from megatron_rl.rollout.samples import make_sample
from megatron_rl.rollout.engine import RolloutError
from megatron_rl.rollout.sampling import SamplingSpec, prompt_seed


@dataclass(frozen=True)
class SegmentRequest:
    """One sample's next segment: the tokens to continue, how many new ones at most, and its seed."""

    token_ids: list[int]
    """Prompt + response so far."""
    max_new_tokens: int
    seed: int | None


@dataclass
class SegmentOutput:
    """What the engine generated for one request before it finished or was interrupted."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    """'stop' or 'length' when the request finished; None when a push interrupted it."""
    stop_reason: int | str | None = None


@runtime_checkable
class SegmentEngine(Protocol):
    """An engine that runs requests step by step and stops when a push waits (VLLMEngine: an engine in this process;
    rollout.engine_protocol.SteppedEngine)."""

    def generate_segment(
        self, requests: list[SegmentRequest], spec: SamplingSpec, push_waiting: Callable[[], bool]
    ) -> tuple[list[SegmentOutput], int]:
        """One SegmentOutput per request (in order) and the weight version that sampled them."""
        ...


@dataclass
class _OpenSample:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    seed: int | None
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def next_request(self, max_new_tokens: int) -> SegmentRequest:
        return SegmentRequest(self.prompt_ids + self.response, max_new_tokens - len(self.response), self.segment_seed())

    def segment_seed(self) -> int | None:
        """The sample's seed in segment 0; mixed with the prefix length for a continuation."""
        if self.seed is None or not self.response:
            return self.seed
        return prompt_seed(self.seed, len(self.response))

    def extend(self, output: SegmentOutput, version: int) -> None:
        if len(output.logprobs) != len(output.token_ids):
            raise RolloutError(
                f"prompt {self.prompt_index} sample {self.sample_index}: {len(output.logprobs)} logprobs for "
                f"{len(output.token_ids)} tokens in one segment"
            )
        self.response += output.token_ids
        self.logprobs += output.logprobs
        self.versions += [version] * len(output.token_ids)
        self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason

    def to_sample(self) -> RolloutSample:
        sample = make_sample(
            prompt_index=self.prompt_index, sample_index=self.sample_index, prompt_ids=self.prompt_ids,
            response_ids=self.response, logprobs=self.logprobs, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason, weight_version=min(self.versions),
        )
        sample.token_versions = torch.tensor(self.versions, dtype=torch.int64)
        return sample


def check_partial_spec(spec: SamplingSpec) -> None:
    """ValueError for what partial rollouts cannot continue exactly (see the module docstring)."""
    spec.validate()
    if spec.return_routed_experts or spec.stop:
        raise ValueError(
            f"partial rollouts with return_routed_experts={spec.return_routed_experts}, stop={spec.stop}: the routes of "
            "a continued prefix would be recomputed under the new weights, and a stop string could span two segments; "
            "turn train.partial_rollouts off, or use rollout.stop_token_ids instead of rollout.stop"
        )


def generate_partial(
    engine: SegmentEngine,
    prompts: Sequence[Sequence[int]],
    spec: SamplingSpec,
    engine_turn: Callable[[], ContextManager] = contextlib.nullcontext,
    push_waiting: Callable[[], bool] = lambda: False,
) -> Rollouts:
    """spec.n samples per prompt (prompt-major, like engine.generate), interrupted by pushes (module docstring).

    ``engine_turn()`` is entered around every segment; ``push_waiting()`` is asked after every engine step.
    """
    check_partial_spec(spec)
    if not isinstance(engine, SegmentEngine):
        raise TypeError(f"{type(engine).__name__} cannot interrupt a generation (no generate_segment): set train.partial_rollouts=false")
    start = time.perf_counter()
    samples = [
        _OpenSample(i, j, [int(t) for t in prompt], None if spec.seed is None else prompt_seed(spec.seed, i) + j)
        for i, prompt in enumerate(prompts) for j in range(spec.n)
    ]
    segments = continued = 0
    while still_open := [s for s in samples if s.finish_reason is None]:
        with engine_turn():
            outputs, version = engine.generate_segment(
                [s.next_request(spec.max_new_tokens) for s in still_open], spec, push_waiting
            )
        if len(outputs) != len(still_open):
            raise RolloutError(f"segment {segments}: the engine returned {len(outputs)} outputs for {len(still_open)} requests")
        for sample, output in zip(still_open, outputs):
            sample.extend(output, version)
        continued += len(still_open) if segments else 0
        segments += 1
    result = [s.to_sample() for s in samples]
    rollouts = Rollouts(samples=result, n_samples=spec.n, weight_version=min(s.weight_version for s in result))
    rollouts.metrics.update(
        generate_s=time.perf_counter() - start,
        response_tokens=float(sum(s.response_length for s in result)),
        segments=float(segments),
        continued_samples=float(continued),
    )
    return rollouts


__all__ = ["SegmentEngine", "SegmentOutput", "SegmentRequest", "check_partial_spec", "generate_partial"]
