"""torchrun as the launch scripts run it: its own log in a file, each failed rank's one line at the end, rank 0's last.

    python -m megatron_rl.elastic --log-file outputs/logs/torchrun.log --nproc-per-node=2 --max-restarts=3 \\
        -m megatron_rl.cli train --config configs/tiny-gspo-cpu2.yaml

Takes torchrun's own arguments (torch.distributed.run) plus `--log-file` (`{node_rank}` in it is replaced by the
node's rank), and runs torchrun in this process:
1. torchrun's log (rendezvous, "sending SIGTERM", restarts, its failure summary) goes to the file, not the console;
2. a rank that dies or fails is restarted by torchrun itself (--max-restarts); the restarted ranks resume from the
   newest complete checkpoint and say why they restarted (megatron_rl.trainer);
3. SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 are passed on to the ranks (torchrun's --signals-to-handle), which
   save at the next step boundary; torchrun waits --shutdown-timeout seconds (600 unless given) for them, then this
   exits with EXIT_PREEMPTED (3), which launch/slurm.sbatch turns into `scontrol requeue`;
4. when the job fails, one line per failed rank whose message differs from rank 0's, then rank 0's line, read from
   the ranks' error files (megatron_rl.errors.write_error_file) or named by the signal that killed the rank; the
   exit code is rank 0's (2 bad input, 1 runtime failure).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from megatron_rl.errors import EXIT_PREEMPTED, EXIT_RUNTIME_FAILURE, LAUNCHER_ENV

FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_TIMEOUT_S = 600
"""Seconds torchrun gives the ranks to finish their step and save after a stop signal, before SIGKILL."""


def _log_to(path: Path) -> logging.Handler:
    """torchrun's loggers (torch.distributed.*) write to `path` only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    torch_logger = logging.getLogger("torch.distributed")
    for console in list(torch_logger.handlers):  # torch's own logging set a stderr handler here
        torch_logger.removeHandler(console)
    torch_logger.addHandler(handler)
    torch_logger.propagate = False
    return handler


def failure_lines(failures: dict) -> tuple[list[str], int]:
    """The console lines of a failed job (rank 0's last) and its exit code, from torchrun's ProcessFailures by rank."""
    def line(rank: int, failure) -> tuple[str, int]:
        message = failure.message
        if isinstance(message, dict):  # torch's own error-file format: a traceback, its first line is not ours
            message = message.get("message", "")
        if failure.signal_name() != "<N/A>" and failure.exitcode < 0:
            return (f"rank {rank} (pid {failure.pid} on {socket.gethostname()}) was killed by {failure.signal_name()} "
                    "without a message: out of memory, a lost node or a kill; see torchrun's log"), EXIT_RUNTIME_FAILURE
        code = failure.exitcode if failure.exitcode > 0 else EXIT_RUNTIME_FAILURE
        return str(message).strip() or f"rank {rank} exited with code {failure.exitcode}", code

    def stopped_by_torchrun(failure) -> bool:  # torchrun's own SIGTERM to the others once one rank failed
        return failure.exitcode == -signal.SIGTERM

    if any(not stopped_by_torchrun(f) for f in failures.values()):
        failures = {rank: f for rank, f in failures.items() if not stopped_by_torchrun(f)}
    by_rank = {rank: line(rank, failure) for rank, failure in sorted(failures.items())}
    last_rank = 0 if 0 in by_rank else min(by_rank)
    last, code = by_rank[last_rank]
    lines = []
    for rank, (text, _) in by_rank.items():
        if rank != last_rank and text != last and text not in lines:
            lines.append(text if f"rank {rank}" in text else f"rank {rank}: {text}")
    return [*lines, last], code


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--log-file", default="torchrun.log")
    known, torchrun_argv = ours.parse_known_args(sys.argv[1:] if argv is None else argv)
    args = parse_args([f"--signals-to-handle={FORWARDED_SIGNALS}", f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
                       *torchrun_argv])
    log_file = Path(known.log_file.format(node_rank=args.node_rank))  # one file per node (launch/slurm.sbatch)
    handler = _log_to(log_file)
    os.environ[LAUNCHER_ENV] = "1"  # the ranks leave the console to this process
    try:
        run(args)
    except ChildFailedError as failed:
        logging.getLogger("torch.distributed.elastic").error("%s", failed.format_msg())
        handler.flush()
        lines, code = failure_lines(failed.failures)
        for text in lines:
            print(text, file=sys.stderr)
        return code
    except SignalException as stop:
        from megatron_rl.parallel.watch import STOP_SIGNALS

        handler.flush()
        name = signal.Signals(stop.sigval).name
        if stop.sigval in STOP_SIGNALS:
            print(f"megatron-rl: stopped by {name}: the ranks were asked to save a checkpoint at the step boundary "
                  f"(within {args.shutdown_timeout} s); launching again continues from the newest complete one "
                  f"(checkpoint.resume=auto); torchrun's log: {log_file}", file=sys.stderr)
            return EXIT_PREEMPTED
        print(f"megatron-rl: stopped by {name}: the ranks ended without a save (SIGTERM or SIGUSR1 saves first); "
              f"launching again continues from the newest complete checkpoint; torchrun's log: {log_file}", file=sys.stderr)
        return EXIT_RUNTIME_FAILURE
    return 0


if __name__ == "__main__":
    from megatron_rl.cli import finished

    sys.exit(finished(main()))
