"""An engine's outputs as RolloutSamples: each completion checked and made tensors, its routed experts attached."""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_rl.data.batch import RolloutSample
from megatron_rl.rollout.engine import RolloutError
from megatron_rl.rollout.routing import CaptureIndex, assemble_routes


def make_sample(
    *,
    prompt_index: int,
    sample_index: int,
    prompt_ids: list[int],
    response_ids: Sequence[int],
    logprobs: Sequence[float],
    finish_reason: str | None,
    stop_reason: int | str | None,
    weight_version: int,
) -> RolloutSample:
    where = f"prompt {prompt_index} sample {sample_index}"
    if finish_reason not in ("stop", "length"):
        raise RolloutError(f"{where}: the engine ended it with finish_reason={finish_reason!r} (aborted?)")
    if len(response_ids) == 0:
        raise RolloutError(f"{where}: the engine returned an empty response")
    if len(logprobs) != len(response_ids):
        raise RolloutError(f"{where}: {len(logprobs)} logprobs for {len(response_ids)} tokens")
    return RolloutSample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_token_ids=torch.tensor(prompt_ids, dtype=torch.int64),
        response_token_ids=torch.tensor(list(response_ids), dtype=torch.int64),
        rollout_logprobs=torch.tensor(list(logprobs), dtype=torch.float32),
        finish_reason=finish_reason,  # type: ignore[arg-type]
        stop_reason=stop_reason,
        weight_version=weight_version,
    )


def attach_routes(samples: list[RolloutSample], index: CaptureIndex, include_prompt: bool) -> None:
    """Give every sample its routed-expert rows (RoutedExpertsError names the sample that has none)."""
    for s in samples:
        prompt = s.prompt_token_ids.tolist()
        response = s.response_token_ids.tolist()
        key = tuple(prompt) + tuple(response[:-1])
        s.routed_experts = assemble_routes(
            index.take(key), prompt, response, include_prompt, where=f"prompt {s.prompt_index} sample {s.sample_index}"
        )
        s.routed_experts_include_prompt = include_prompt
