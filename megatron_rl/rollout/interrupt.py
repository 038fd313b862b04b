"""The engine side of partial rollouts (rollout.partial): run requests step by step, stop when a push waits.

    outputs = run_engine_steps(llm.llm_engine, requests, spec, push_waiting)       # in-process vllm.LLM

In-process, this drives vLLM's LLMEngine directly: add_request with DELTA
outputs (each step returns the new tokens and their logprobs), step until
every request finished or `push_waiting()` says a push waits, then
abort_request on the unfinished ones. With the engine core in this process a
step is one schedule + forward, so nothing runs after the abort; with the
engine core in its own process, tokens it sampled after the last step we read
are dropped with the aborted requests (their logprobs were never seen).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable

from megatron_rl.rollout.partial import SegmentOutput, SegmentRequest
from megatron_rl.rollout.sampling import SamplingSpec, to_vllm_segment_params

logger = logging.getLogger(__name__)

_request_ids = itertools.count()


def run_engine_steps(
    llm_engine: Any, requests: list[SegmentRequest], spec: SamplingSpec, push_waiting: Callable[[], bool]
) -> list[SegmentOutput]:
    """Generate `requests` on vLLM's LLMEngine until all finish or, after a step, `push_waiting()` is true.

    Returns one SegmentOutput per request; the unfinished ones are aborted in the engine.
    """
    ids = [f"mrl-partial-{next(_request_ids)}" for _ in requests]
    outputs = {request_id: SegmentOutput() for request_id in ids}
    added: list[str] = []
    try:
        for request_id, request in zip(ids, requests):
            params = to_vllm_segment_params(spec, request.max_new_tokens, request.seed)
            llm_engine.add_request(request_id, {"prompt_token_ids": request.token_ids}, params)
            added.append(request_id)
        while llm_engine.has_unfinished_requests():
            for step_output in llm_engine.step():
                segment = outputs.get(step_output.request_id)
                if segment is not None:
                    _add_completion(segment, step_output.outputs[0], step_output.finished)
            if push_waiting():
                break
    finally:
        unfinished = [request_id for request_id in added if outputs[request_id].finish_reason is None]
        if unfinished:
            llm_engine.abort_request(unfinished)
    return [outputs[request_id] for request_id in ids]


def _add_completion(segment: SegmentOutput, completion: Any, finished: bool) -> None:
    """Append one DELTA CompletionOutput (new tokens, their logprob dicts) to a segment."""
    new_ids = list(completion.token_ids)
    segment.token_ids += new_ids
    segment.logprobs += [entry[token].logprob for token, entry in zip(new_ids, completion.logprobs or [])]
    if finished:
        segment.finish_reason, segment.stop_reason = completion.finish_reason, completion.stop_reason


__all__ = ["run_engine_steps"]
