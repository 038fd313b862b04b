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

Under torchrun each rank also writes its one line into torchrun's error file
(TORCHELASTIC_ERROR_FILE), so torchrun's summary shows the line instead of a
traceback, and a restarted attempt's resume line names it
(megatron_rl.checkpoint.resume); under the launch scripts' torchrun
(megatron_rl.elastic) the ranks print nothing themselves and the launcher prints
each failed rank's line at the end, rank 0's last. Bad input ends a job that
torchrun would restart: the ranks of a restarted attempt find the first
attempt's verdict and exit with it at once.

Exception types are matched by qualified name, so this module imports nothing heavy.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

EXIT_RUNTIME_FAILURE = 1
EXIT_PREEMPTED = 3
"""A stop asked by SIGTERM / SIGUSR1 (pre-emption, a time limit): a checkpoint was saved; launch again to resume."""
LAUNCHER_ENV = "MEGATRON_RL_LAUNCHER"
"""Set by megatron_rl.elastic for its ranks: they leave the console to it."""
BAD_INPUT_VERDICT = "bad_input.json"
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
    "megatron_rl.checkpoint.no_code.CheckpointFileError",  # a checkpoint file refused (it asks for code) or unreadable
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
    "megatron_rl.parallel.watch.CollectiveError",
})
"""Failures of a run with good input that the project detects and explains: exit code 1."""


PREEMPTED = frozenset({"megatron_rl.trainer.StoppedBySignal"})


def exit_code_for(error: BaseException) -> int | None:
    """EXIT_BAD_INPUT, EXIT_RUNTIME_FAILURE, EXIT_PREEMPTED, or None for an unexpected exception (a bug)."""
    names = {f"{cls.__module__}.{cls.__qualname__}" for cls in type(error).__mro__}
    if names & PREEMPTED:
        return EXIT_PREEMPTED
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
    line = f"{command}: {'' if code == EXIT_PREEMPTED else 'error: '}{one_line(error)}"
    if code != EXIT_PREEMPTED:  # a stop that was asked for is no error
        write_traceback(error, log_dir)
    write_error_file(line, code, "".join(traceback.format_exception(error)))
    if os.environ.get(LAUNCHER_ENV):  # megatron_rl.elastic prints every rank's line at the end
        if debug:
            traceback.print_exception(error, file=sys.stderr)
    elif is_rank0():
        if debug:
            traceback.print_exception(error, file=sys.stderr)
        print(line, file=sys.stderr)
        sys.stderr.flush()
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(OTHER_RANKS_WAIT_S)
    return code


def write_error_file(line: str, code: int, trace: str = "") -> None:
    """torchrun's error file of this rank (TORCHELASTIC_ERROR_FILE): the one line, its exit code and the traceback
    (the file, not the console). Bad input also leaves the verdict for the ranks of a restarted attempt."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": line, "exitcode": code, "timestamp": int(time.time()), "traceback": trace}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
        if code == EXIT_BAD_INPUT:
            Path(path).parents[2].joinpath(BAD_INPUT_VERDICT).write_text(json.dumps(data))
    except OSError:
        pass


def replay_bad_input() -> int | None:
    """In an attempt torchrun restarted: the first attempt's bad-input verdict, written again to this rank's error file
    (nothing printed, no work done), and its exit code; None when there is none."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
        return None
    verdict = Path(path).parents[2] / BAD_INPUT_VERDICT
    try:
        data = json.loads(verdict.read_text())
        message, exitcode = str(data["message"]), int(data["exitcode"])
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one this project wrote: run as a first attempt
        return None
    write_error_file(message, exitcode)
    if not os.environ.get(LAUNCHER_ENV) and is_rank0():
        print(message, file=sys.stderr)
    return exitcode
