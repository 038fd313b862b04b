"""What every engine placement shares around generation: one base class for the in-process and server engines.

`ServingEngine` adds to the engine's end of the push (weight_sync.engine_side.WeightSyncedEngine)
generation under the engine's lock with restarts, lost weights recovered before
serving, and vLLM's sleep mode; each engine adds only how to reach its engines.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.data.batch import Rollouts
from megatron_rl.rollout.engine_options import SLEEP_TAGS
from megatron_rl.rollout.engine import run_with_restarts
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.engine_side import WeightSyncedEngine

logger = logging.getLogger(__name__)


class ServingEngine(WeightSyncedEngine):
    """Generation and sleep mode over the push's engine end (see the module docstring).

    A subclass calls `_init_serving` first in its __init__ and provides, besides the push's hooks
    (WeightSyncedEngine):
      _restart(error)           bring dead engines back and recover the weights (generate's retries)
      _is_engine_failure(error) whether a restart can answer this error
      _sleep_engines(level), _wake_engines(tags), _sleep_frees_memory(), _no_sleep_mode_reason()
    """

    config: RolloutConfig

    def _init_serving(self, config: RolloutConfig, reexport_fn: Callable[[], Iterable[Bucket]] | None) -> None:
        self._init_weight_sync(reexport_fn)
        self.config = config
        self.restarts = 0
        self.asleep: set[str] = set()
        """What of the engines sleeps (vLLM's memory tags, rollout.sleep_level): nothing, or weights and KV cache."""
        self._said_no_sleep_mode = False

    # ---- generation ------------------------------------------------------------------------------
    def _generate_with_restarts(self, generate_once: Callable[[], Rollouts], what: str) -> Rollouts:
        """generate_once under the lock, the engines awake and on the trainer's weights, retried after restarts
        (rollout.engine.run_with_restarts); generate_s, response_tokens and restarts recorded in its metrics."""
        with self.serving():
            start = time.perf_counter()
            rollouts, restarts = run_with_restarts(
                generate_once, self._restart, max_restarts=self.config.max_restarts,
                is_engine_failure=self._is_engine_failure, what=what,
            )
            rollouts.metrics.update(
                generate_s=time.perf_counter() - start,
                response_tokens=float(sum(s.response_length for s in rollouts.samples)),
                restarts=float(restarts),
            )
            return rollouts

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Generation outside generate() (episodes' turns, rollout.agents.turns): under the lock, the engines
        awake and on the trainer's weights; a push waits until it ends."""
        with self._lock:
            self.wake_up()  # a sleeping engine's scheduler is paused: its requests would wait forever
            self._recover_weights()
            yield

    def restart_after(self, error: BaseException) -> bool:
        """After `error` while serving(): restart the engines and give them the trainer's weights again (True)
        when it is an engine failure; False (nothing done) for the caller's errors."""
        if not self._is_engine_failure(error):
            return False
        with self._lock:
            self._restart(error)
        return True

    # ---- sleep mode (rollout.sleep_level) ---------------------------------------------------------
    def sleep(self) -> bool:
        """Put the engines to sleep at rollout.sleep_level while the trainer trains (RolloutConfig.sleep_level);
        True when that releases their memory, False where it cannot (said once; the trainer logs it as
        engine/sleep_frees_memory)."""
        level = self.config.sleep_level
        frees = bool(level) and self._sleep_frees_memory()
        if not level or self.asleep:
            return frees
        if not frees and not self._said_no_sleep_mode:
            self._said_no_sleep_mode = True
            logger.warning("rollout.sleep_level=%d: the memory of %s stays while the trainer trains (%s)",
                           level, self.name, self._no_sleep_mode_reason())
        with self._lock:
            self._sleep_engines(level)
            self.asleep = set(SLEEP_TAGS)
        return frees

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake what sleeps of `tags` ("weights", "kv_cache"; None = all): the weights for a push, the KV cache
        once the trainer's memory has left the device, everything before generating."""
        waking = [t for t in (SLEEP_TAGS if tags is None else tags) if t in self.asleep]
        if not waking:
            return
        with self._lock:
            self._wake_engines(waking)
            self.asleep -= set(waking)

    # ---- what each placement provides ------------------------------------------------------------
    def _restart(self, error: BaseException | None = None) -> None:
        raise NotImplementedError

    def _is_engine_failure(self, error: BaseException) -> bool:
        raise NotImplementedError

    def _sleep_engines(self, level: int) -> None:
        raise NotImplementedError

    def _wake_engines(self, tags: list[str]) -> None:
        raise NotImplementedError

    def _sleep_frees_memory(self) -> bool:
        raise NotImplementedError

    def _no_sleep_mode_reason(self) -> str:
        raise NotImplementedError
