"""Rollout engines' errors, and the bounded restart-and-retry loop engines share.

    engine.generate(prompts, SamplingSpec(n=4, seed=step)) -> Rollouts
    engine.update_weights(buckets, version)    # or weight_sync.push_weights on every rank
    engine.shutdown()

Prompts are token ids (list[list[int]]); tokenising is the data layer's job.
Every member callers use of an engine is declared in rollout.engine_protocol (RolloutEngine).
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RolloutError(RuntimeError):
    """Base class of rollout-engine errors."""


class EngineStartError(RolloutError):
    """The engine could not start (e.g. a model directory vLLM cannot load)."""


class PromptError(RolloutError, ValueError):
    """A prompt the engine cannot serve (too long for the context, empty, token out of vocabulary)."""


class RolloutFailedError(RolloutError):
    """The engine kept dying: the batch failed after every allowed restart. No partial batch is returned."""


def run_with_restarts(
    attempt: Callable[[], T],
    restart: Callable[[BaseException], None],
    *,
    max_restarts: int,
    is_engine_failure: Callable[[BaseException], bool],
    what: str,
) -> tuple[T, int]:
    """Run `attempt`; when it fails with an engine failure, `restart` and retry, at most max_restarts times.

    Returns (result, restarts used). Errors that are not engine failures (bad
    input, refused pushes) propagate at once. After the last allowed restart
    fails, or when an attempt after a restart fails exactly as the one before
    (same type and message: the batch itself breaks the engine, and every
    restart would end the same way), raises RolloutFailedError chained to the
    last failure.
    """
    restarts = 0
    last_error: BaseException | None = None
    while True:
        try:
            if last_error is not None:
                restart(last_error)  # a restart that fails counts as one more failure
            return attempt(), restarts
        except BaseException as error:  # noqa: BLE001 - classified right below
            if isinstance(error, (KeyboardInterrupt, SystemExit)) or not is_engine_failure(error):
                raise
            if last_error is not None and _same_failure(error, last_error):
                raise RolloutFailedError(
                    f"{what} failed the same way after {restarts} engine restart(s) ({type(error).__name__}: {error}); "
                    "a failure that repeats after a restart is not restarted into again. No partial batch was returned."
                ) from error
            if restarts >= max_restarts:
                raise RolloutFailedError(
                    f"{what} failed after {restarts} engine restart(s) (rollout.max_restarts={max_restarts}); "
                    f"last error: {type(error).__name__}: {error}. No partial batch was returned."
                ) from error
            restarts += 1
            last_error = error
            logger.warning("%s: engine failure (%s: %s); restart %d of %d", what, type(error).__name__, error, restarts, max_restarts)


def _same_failure(error: BaseException, before: BaseException) -> bool:
    """Whether two engine failures are one: the same type and the same message."""
    return type(error) is type(before) and str(error) == str(before)
