"""Partial rollouts: generation in chunks that weight pushes may fall between.

    rollouts = generate_in_chunks(engine, prompt_ids, spec, chunk_tokens=16, engine_turn=stream.engine_turn)

A batch is generated `chunk_tokens` new tokens at a time through the engine's
ordinary `generate` (so every engine kind works: in-process, servers,
colocated). Before each chunk the caller's `engine_turn` context is entered; a
weight push that is waiting for the engine runs there, between two chunks.
The samples still open then continue under the new weights with their prefix
kept: the next chunk is generated from prompt + response so far. So

* a push waits for at most one chunk of decoding (not for the longest sample
  of the batch), and generation resumes right after it;
* every response token keeps the engine logprob and the weight version it was
  sampled with (`RolloutSample.token_versions`); a sample's `weight_version` is
  its oldest token's version (what staleness is measured by).

Continuing costs a prefill of the prefix per chunk (vLLM's prefix cache serves
the prompt part). Chunks of one batch all have the same length: a sample that
stops early leaves the batch, the others have generated exactly the same number
of tokens, so one SamplingSpec serves every chunk.

Not supported with chunking (refused at config load): routed-expert capture
(R3 routes are recorded per engine call) and stop strings (one could span two
chunks); stop token ids and EOS end a sample as usual.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Callable, ContextManager, Sequence

import torch

from megatron_rl.data.batch import RolloutSample, Rollouts
from megatron_rl.rollout.engine import RolloutError
from megatron_rl.rollout.sampling import SamplingSpec


@dataclass
class _OpenSample:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    stop_reason: int | str | None = None
    done: bool = False

    def extend(self, sample: RolloutSample, version: int, asked: int, max_new_tokens: int) -> None:
        new = sample.response_token_ids.tolist()
        self.response += new
        self.logprobs += sample.rollout_logprobs.tolist()
        self.versions += [version] * len(new)
        self.finish_reason, self.stop_reason = sample.finish_reason, sample.stop_reason
        # Ends on EOS / a stop token, at the length limit, or short of the chunk (the engine's context limit).
        self.done = sample.finish_reason == "stop" or len(self.response) >= max_new_tokens or len(new) < asked

    def to_sample(self) -> RolloutSample:
        return RolloutSample(
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            prompt_token_ids=torch.tensor(self.prompt_ids, dtype=torch.int64),
            response_token_ids=torch.tensor(self.response, dtype=torch.int64),
            rollout_logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            stop_reason=self.stop_reason,
            weight_version=min(self.versions),
            token_versions=torch.tensor(self.versions, dtype=torch.int64),
        )


def chunk_seed(seed: int | None, chunk_index: int) -> int | None:
    """The batch seed of chunk `chunk_index` (chunk 0 uses the batch seed itself)."""
    return None if seed is None else (int(seed) * 1_000_003 + chunk_index) % (1 << 62)


def generate_in_chunks(
    engine,
    prompts: Sequence[Sequence[int]],
    spec: SamplingSpec,
    chunk_tokens: int,
    engine_turn: Callable[[], ContextManager] = contextlib.nullcontext,
) -> Rollouts:
    """spec.n samples per prompt (prompt-major, like engine.generate), `chunk_tokens` new tokens per engine call.

    ``engine_turn()`` is entered around every engine call (see the module docstring).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1 (train.partial_rollout_tokens)")
    if spec.return_routed_experts or spec.stop:
        raise ValueError("partial rollouts do not support routed-expert capture or stop strings (rollout.return_routed_experts, rollout.stop)")
    start = time.perf_counter()
    generated = 0
    asked = min(chunk_tokens, spec.max_new_tokens)
    with engine_turn():
        first = engine.generate([list(p) for p in prompts], replace(spec, max_new_tokens=asked))
    samples = [_OpenSample(s.prompt_index, s.sample_index, s.prompt_token_ids.tolist()) for s in first.samples]
    for open_sample, sample in zip(samples, first.samples):
        open_sample.extend(sample, first.weight_version, asked, spec.max_new_tokens)
    chunk_index = 1
    while still_open := [s for s in samples if not s.done]:
        asked = min(chunk_tokens, spec.max_new_tokens - len(still_open[0].response))
        chunk_spec = replace(spec, n=1, max_new_tokens=asked, seed=chunk_seed(spec.seed, chunk_index))
        with engine_turn():
            out = engine.generate([s.prompt_ids + s.response for s in still_open], chunk_spec)
        if len(out.samples) != len(still_open):
            raise RolloutError(f"chunk {chunk_index}: the engine returned {len(out.samples)} samples for {len(still_open)} prompts")
        for open_sample, sample in zip(still_open, out.samples):
            open_sample.extend(sample, out.weight_version, asked, spec.max_new_tokens)
        generated += len(still_open)
        chunk_index += 1
    result = [s.to_sample() for s in samples]
    rollouts = Rollouts(samples=result, n_samples=spec.n, weight_version=min(s.weight_version for s in result))
    rollouts.metrics.update(
        generate_s=time.perf_counter() - start,
        response_tokens=float(sum(s.response_length for s in result)),
        chunks=float(chunk_index),
        continued_samples=float(generated),
    )
    return rollouts


__all__ = ["chunk_seed", "generate_in_chunks"]
