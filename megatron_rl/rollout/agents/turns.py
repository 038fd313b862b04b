"""Turns of many episodes on one engine: each turn is sent when its episode is ready and answered when it ends.

    turns = make_turns(engine, spec, engine_turn, push_waiting)
    if turns.admits(key, request): turns.submit(key, request)     # an episode needs the model
    for key, output, version in turns.poll(): ...                   # turns that ended (or a push interrupted)
    turns.finish(key)                                                # the episode ended
    turns.idle()                                                     # nothing to generate: a push may land now
    turns.close()

No turn waits for the turns of other episodes (continuous batching across
episodes), and a slow tool holds only its own episode. Three engine shapes:

- an in-process VLLMEngine (`step_session`): vLLM's LLMEngine runs one step
  per poll and a turn joins the next step as soon as its episode is ready
  (rollout.interrupt.StepSession admits it while its prefill fits the step
  whole). When a push waits, the step in progress ends the session: the
  unfinished turns come back with finish_reason None and go on under the new
  weights (each token carries the version that sampled it);
- vLLM servers (`complete_turn`): one HTTP request per turn, on a thread pool
  per server holding at most its max_num_seqs requests. The first turn of an
  episode goes to the server with the fewest live episodes (then the fewest
  requests in flight), its later turns to the same server (sticky: that
  server's prefix cache holds the conversation). When a push waits, no turn
  is sent until the ones in flight have ended and the push ran; a server that
  stops answering /health while it has turns is dead (rollout.client_limits);
- any other engine, or stop strings (a push could split a stop string between
  two segments): the ready turns go to `engine.generate` together, one call
  per poll.

The engine is held (`engine_turn()` entered, then the engine's own serving
lock) only while turns are in flight: while every episode waits for its
environment, a push may land between two turns. An engine failure restarts the
engine (rollout.max_restarts, the engine's recovery: the trainer's weights
again) and the turns in flight start over on it; nothing an episode already
has is lost.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Any, Callable, ContextManager, Hashable

from megatron_rl.rollout.prompts import check_prompts
from megatron_rl.rollout.engine import RolloutFailedError
from megatron_rl.rollout.engine_protocol import RolloutEngine, ServerPoolEngine, SteppedEngine
from megatron_rl.rollout.partial import SegmentOutput, SegmentRequest
from megatron_rl.rollout.sampling import SamplingSpec

Finished = tuple[Hashable, SegmentOutput, int]
"""(episode key, what the turn generated, the weight version that sampled it)."""


class _Turns:
    """What the three shapes share: holding the engine while turns are in flight, restarts after failures."""

    def __init__(self, engine: RolloutEngine, spec: SamplingSpec, engine_turn: Callable[[], ContextManager],
                 push_waiting: Callable[[], bool]):
        self.engine, self.spec = engine, replace(spec, n=1, return_routed_experts=False)
        self.engine_turn, self.push_waiting = engine_turn, push_waiting
        self._held: contextlib.ExitStack | None = None
        self.restarts = 0
        self.requests = 0
        self.max_restarts = int(engine.config.max_restarts)

    @property
    def in_flight(self) -> int:
        raise NotImplementedError

    def _hold(self) -> None:
        if self._held is None:
            stack = contextlib.ExitStack()
            try:
                stack.enter_context(self.engine_turn())
                self._open(stack)
            except BaseException:
                stack.close()
                raise
            self._held = stack

    def _open(self, stack: contextlib.ExitStack) -> None:
        """Enter what the engine needs while turns run (after engine_turn())."""

    def idle(self) -> None:
        """Let the engine go (nothing in flight): a push may land before the next turn."""
        if self._held is not None and not self.in_flight:
            held, self._held = self._held, None
            held.close()

    def close(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            held.close()

    def shutdown(self) -> None:
        self.close()

    def finish(self, key: Hashable) -> None:
        """The episode `key` ended (no more turns)."""

    def _check(self, request: SegmentRequest) -> None:
        check_prompts([request.token_ids], int(self.engine.max_model_len), int(self.engine.vocab_size))

    def _restart(self, error: BaseException) -> None:
        """Restart the engine after `error` (re-raised when it is not an engine failure or restarts ran out)."""
        self.close()
        if self.restarts >= self.max_restarts:
            raise RolloutFailedError(
                f"episodes' turns failed after {self.restarts} engine restart(s) (rollout.max_restarts={self.max_restarts}); "
                f"last error: {type(error).__name__}: {error}"
            ) from error
        if not self.engine.restart_after(error):
            raise error
        self.restarts += 1


class _SteppedTurns(_Turns):
    """In-process: one engine step per poll (module docstring)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self._session: Any = None
        self._version = 0

    @property
    def in_flight(self) -> int:
        return self._session.in_flight if self._session is not None else 0

    def _open(self, stack: contextlib.ExitStack) -> None:
        self._session = stack.enter_context(self.engine.step_session(self.spec))
        self._version = int(self.engine.weight_version)
        stack.callback(self._drop_session)

    def _drop_session(self) -> None:
        self._session = None

    def admits(self, key: Hashable, request: SegmentRequest) -> bool:
        return self._session is None or self._session.admits(request)

    def submit(self, key: Hashable, request: SegmentRequest) -> None:
        self._check(request)
        self._hold()
        self._session.add(key, request)
        self.requests += 1

    def poll(self, timeout: float = 0.0) -> list[Finished]:
        if not self.in_flight:
            return []
        try:
            finished = self._session.step()
        except Exception as error:  # noqa: BLE001 - an engine failure restarts the engine, anything else propagates
            again = self._session.requests()
            self._restart(error)
            for key, request in again:
                self.submit(key, request)
            return []
        version = self._version
        if self.push_waiting():  # the push runs before the next turn or step
            finished += self._session.abort()  # finish_reason None: the episode continues under the new weights
            self.close()
        return [(key, output, version) for key, output in finished]


class _ServerTurns(_Turns):
    """Servers: one request per turn, sticky per episode, least-loaded for a new one (module docstring)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        import httpx

        engine = self.engine
        self._client = httpx.Client(timeout=httpx.Timeout(engine.config.request_timeout_s, read=None),
                                    headers=engine.auth_headers)
        self.capacity = [int(s) for s in engine.max_num_seqs]
        self._pools = [ThreadPoolExecutor(max_workers=c, thread_name_prefix="episode-turn") for c in self.capacity]
        self.home: dict[Hashable, int] = {}
        """Episode -> its server (sticky)."""
        self.live = [0] * len(self.capacity)
        self.busy = [0] * len(self.capacity)
        self._futures: dict[Future, tuple[Hashable, SegmentRequest, int, int]] = {}
        self._draining = False
        from megatron_rl.rollout.client_limits import health_interval_s

        self._interval = health_interval_s(engine.config.request_timeout_s)
        self._misses = [0] * len(self.capacity)
        self._last_answer = time.monotonic()

    @property
    def in_flight(self) -> int:
        return len(self._futures)

    def server_of(self, key: Hashable) -> int:
        """The episode's server: its own, or (first turn) the one with the fewest live episodes, then requests."""
        server = self.home.get(key)
        if server is None:
            server = min(range(len(self.capacity)), key=lambda s: (self.live[s], self.busy[s], s))
            self.home[key] = server
            self.live[server] += 1
        return server

    def admits(self, key: Hashable, request: SegmentRequest) -> bool:
        if self._draining:
            return False
        server = self.home.get(key)
        return server is None or self.busy[server] < self.capacity[server]

    def submit(self, key: Hashable, request: SegmentRequest) -> None:
        self._check(request)
        self._hold()
        server = self.server_of(key)
        future = self._pools[server].submit(self.engine.complete_turn, server, request, self.spec, self._client)
        self._futures[future] = (key, request, server, int(self.engine.weight_version))
        self.busy[server] += 1
        self.requests += 1

    def finish(self, key: Hashable) -> None:
        server = self.home.pop(key, None)
        if server is not None:
            self.live[server] -= 1

    def poll(self, timeout: float = 0.0) -> list[Finished]:
        if not self._futures:
            return []
        if not self._draining and self.push_waiting():
            self._draining = True  # no new turn until these end and the push ran
        done, _ = wait(list(self._futures), timeout=timeout, return_when=FIRST_COMPLETED)
        finished: list[Finished] = []
        failed: BaseException | None = None
        failed_turns = []
        for future in done:
            key, request, server, version = self._futures.pop(future)
            self.busy[server] -= 1
            error = future.exception()
            if error is not None:
                failed = failed or error
                failed_turns.append((key, request))
                continue
            finished.append((key, future.result(), version))
        if failed is not None:
            self._start_over(failed, failed_turns)
        elif done:
            self._last_answer = time.monotonic()
            self._misses = [0] * len(self.capacity)
        elif time.monotonic() - self._last_answer > self._interval:
            self._check_health()
        if not self._futures and self._draining:
            self._draining = False
            self.close()
        return finished

    def _check_health(self) -> None:
        from megatron_rl.rollout.client_limits import HEALTH_FAILURES_TO_DEAD
        from megatron_rl.rollout.server_engine import ServerDeadError

        self._last_answer = time.monotonic()
        for server in sorted({s for _, _, s, _ in self._futures.values()}):
            self._misses[server] = 0 if self.engine.healthy(server) else self._misses[server] + 1
            if self._misses[server] >= HEALTH_FAILURES_TO_DEAD:
                self._start_over(ServerDeadError(
                    f"vLLM server {self.engine.urls[server]} stopped answering /health ({self._misses[server]} checks "
                    f"{self._interval:.0f} s apart) with {self.busy[server]} turns in flight"
                ))
                return

    def _start_over(self, error: BaseException, failed_turns: list | None = None) -> None:
        """An engine failure: restart (the engine's recovery), then every turn in flight again from its start."""
        again = (failed_turns or []) + [(key, request) for key, request, _, _ in self._futures.values()]
        for future in self._futures:
            future.cancel()
        self._futures.clear()
        self.busy = [0] * len(self.capacity)
        self._misses = [0] * len(self.capacity)
        self._restart(error)
        for key, request in again:
            self.submit(key, request)

    def _open(self, stack: contextlib.ExitStack) -> None:
        stack.enter_context(self.engine.serving())

    def shutdown(self) -> None:
        self.close()
        self._client.close()
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)


class _GenerateTurns(_Turns):
    """Any other engine: the ready turns in one engine.generate call per poll (n=1 each)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self._queued: list[tuple[Hashable, SegmentRequest]] = []

    @property
    def in_flight(self) -> int:
        return len(self._queued)

    def admits(self, key: Hashable, request: SegmentRequest) -> bool:
        return True

    def submit(self, key: Hashable, request: SegmentRequest) -> None:
        self._check(request)
        self._queued.append((key, request))
        self.requests += 1

    def poll(self, timeout: float = 0.0) -> list[Finished]:
        queued, self._queued = self._queued, []
        finished: list[Finished] = []
        by_length: dict[int, list[int]] = {}
        for k, (_, request) in enumerate(queued):
            by_length.setdefault(request.max_new_tokens, []).append(k)
        with self.engine_turn():
            for max_new, rows in by_length.items():
                seed = queued[rows[0]][1].seed  # engine.generate seeds prompt k of the call with prompt_seed(seed, k)
                rollouts = self.engine.generate([queued[k][1].token_ids for k in rows], replace(self.spec, max_new_tokens=max_new, seed=seed))
                for k, s in zip(rows, rollouts.samples):
                    output = SegmentOutput(s.response_token_ids.tolist(), s.rollout_logprobs.tolist(), s.finish_reason, s.stop_reason)
                    finished.append((queued[k][0], output, int(rollouts.weight_version)))
        return finished


def make_turns(engine: RolloutEngine, spec: SamplingSpec, engine_turn: Callable[[], ContextManager] | None = None,
               push_waiting: Callable[[], bool] = lambda: False) -> _Turns:
    """The turn scheduler for `engine` (module docstring)."""
    args = (engine, spec, engine_turn or contextlib.nullcontext, push_waiting)
    if spec.stop:
        return _GenerateTurns(*args)
    if isinstance(engine, SteppedEngine):
        return _SteppedTurns(*args)
    if isinstance(engine, ServerPoolEngine):
        return _ServerTurns(*args)
    return _GenerateTurns(*args)


__all__ = ["make_turns"]
