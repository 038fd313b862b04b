"""How a command ends on an error: one line for what the user can fix, a traceback only for bugs.

    try:
        run(...)
    except Exception as error:
        code = report_error("megatron-rl train", error, debug=args.debug, log_dir=...)
        if code is None:
            raise  # a bug: its full traceback
        return code

- bad input (a config key or value, a dataset file or row, a model or tokenizer
  directory, a reward function, a checkpoint, an engine that cannot start on the
  model): the message, which names the value, the file/row/key and the fix, on one
  line, exit code 2 (EXIT_BAD_INPUT);
- a runtime failure the project detects (an engine that keeps dying, a full disk,
  non-finite logprobs): the message on one line, exit code 1 (EXIT_RUNTIME_FAILURE);
- anything else is a bug: re-raised, so Python prints its full traceback.

The message is printed by rank 0 of a torchrun job only (every rank reads the same
config, data and model, so they all fail alike; N copies say nothing more). The
traceback of a reported error goes to `<logging.dir>/logs/error[.rankN].log`, and
to the console too with `--debug`.

Exception types are matched by qualified name, so this module imports nothing heavy.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

EXIT_RUNTIME_FAILURE = 1
OTHER_RANKS_WAIT_S = 3.0
"""How long a rank other than 0 waits before exiting on a reported error: torchrun stops every rank when one
exits, and rank 0, which prints the message, must get to print it."""
EXIT_BAD_INPUT = 2

BAD_INPUT = frozenset({
    "megatron_rl.config.core.ConfigError",  # also models.hf_config.UnsupportedModelError
    "megatron_rl.data.dataset.DatasetError",
    "megatron_rl.data.tokenizer.TokenizerError",
    "megatron_rl.rollout.rewards.RewardError",
    "megatron_rl.checkpoint.state.CheckpointError",
    "megatron_rl.rollout.engine.EngineStartError",
    "megatron_rl.weight_sync.vllm_transfer.TransferStartError",
    "megatron_rl.rollout.engine.PromptError",
    "megatron_rl.extras.MissingExtraError",
    "megatron_rl.checkpoint.dist_format.ConversionError",
})
"""Errors whose message tells the user what to change in their input: exit code 2."""

RUNTIME_FAILURES = frozenset({
    "megatron_rl.rollout.engine.RolloutFailedError",
    "megatron_rl.rollout.server_engine.ServerDeadError",
    "megatron_rl.checkpoint.state.StorageFullError",
    "megatron_rl.algorithms.validation.NonFiniteLogprobsError",
    "megatron_rl.actor.batch.BatchError",  # e.g. NaN/inf logprobs returned by the engine, named by sample and position
    "megatron_rl.algorithms.dynamic_sampling.DynamicSamplingExhausted",
})
"""Failures of a run with good input that the project detects and explains: exit code 1."""


def exit_code_for(error: BaseException) -> int | None:
    """EXIT_BAD_INPUT, EXIT_RUNTIME_FAILURE, or None for an unexpected exception (a bug)."""
    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(error).__mro__}
    if names & BAD_INPUT:
        return EXIT_BAD_INPUT
    if names & RUNTIME_FAILURES:
        return EXIT_RUNTIME_FAILURE
    return None


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def one_line(error: BaseException) -> str:
    """The error's message on one line (a multi-line message keeps its first line and the rest indented)."""
    return str(error).strip() or type(error).__name__


def write_traceback(error: BaseException, log_dir: str | os.PathLike | None) -> Path | None:
    """Append the traceback to `<log_dir>/logs/error[.rankN].log` when that directory can be written; its path."""
    if not log_dir or not Path(log_dir).is_dir():  # a run that did not start creates nothing
        return None
    rank = int(os.environ.get("RANK", "0"))
    path = Path(log_dir) / "logs" / (f"error.rank{rank}.log" if rank else "error.log")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as log:
            log.write("".join(traceback.format_exception(error)) + "\n")
    except OSError:
        return None
    return path


def report_error(command: str, error: BaseException, *, debug: bool = False, log_dir: str | os.PathLike | None = None) -> int | None:
    """Print a known error as one line (rank 0) and return its exit code; None for a bug (the caller re-raises)."""
    code = exit_code_for(error)
    if code is None:
        return None
    write_traceback(error, log_dir)
    if is_rank0():
        if debug:
            traceback.print_exception(error, file=sys.stderr)
        print(f"{command}: error: {one_line(error)}", file=sys.stderr)
        sys.stderr.flush()
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(OTHER_RANKS_WAIT_S)
    return code
