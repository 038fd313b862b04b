"""torchrun as the launch scripts run it: its own log in a file, each failed rank's one line at the end, rank 0's last.

    python -m megatron_rl.elastic --log-file outputs/logs/torchrun.log --nproc-per-node=2 --max-restarts=3 \\
        -m megatron_rl.cli train --config configs/tiny-gspo-cpu2.yaml

Takes torchrun's own arguments (torch.distributed.run) plus `--log-file` (`{node_rank}` in it is replaced by the
node's rank), and runs torchrun in this process:
1. torchrun's log (rendezvous, "sending SIGTERM", restarts, its failure summary) goes to the file, not the console;
2. a rank that dies or fails is restarted by torchrun itself (--max-restarts); the restarted ranks resume from the
   newest complete checkpoint and say why they restarted (megatron_rl.checkpoint.resume);
3. SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 are passed on to the ranks (torchrun's --signals-to-handle), which
   save at the next step boundary; torchrun waits --shutdown-timeout seconds (600 unless given) for them, then this
   exits with EXIT_PREEMPTED (3), which launch/slurm.sbatch turns into `scontrol requeue`. A torchrun without that
   option (torch 2.11) closes the ranks 30 s after the signal, whatever is given: there this process's agent waits
   the same --shutdown-timeout (`graceful_agent`);
4. when torchrun restarts the ranks, one line per rank killed by a signal; when the job fails, one line per failed
   rank whose message differs from rank 0's, then rank 0's line, read from the ranks' error files
   (megatron_rl.errors.write_error_file) or named by the signal that killed the rank; the exit code is rank 0's
   (2 bad input, 1 runtime failure).
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


def torchrun_takes(option: str) -> bool:
    """Whether the installed torchrun's command line has `option` (torch 2.13's has --shutdown-timeout, 2.11's not)."""
    from torch.distributed.run import get_args_parser

    _, unknown = get_args_parser().parse_known_args([f"{option}=1", "script.py"])
    return not unknown


def graceful_agent(grace_s: int) -> type:
    """torch's LocalElasticAgent, closing the ranks with `grace_s` seconds before SIGKILL when a stop signal ends it.

    For a torchrun without --shutdown-timeout (torch 2.11), whose agent closes them with a fixed 30 s: the ranks'
    save at the step boundary after a stop signal (a Slurm warning, a pre-emption) would be killed midway. Its
    agent calls `_shutdown(signal)` while handling the SignalException; restarts after a failed rank call it outside
    one and keep torch's 30 s, as torch 2.13 does with the option. The close here ends the ranks; torch's own close
    that follows finds them gone."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    class GracefulAgent(LocalElasticAgent):
        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args, **kwargs) -> None:
            if self._pcontext is not None and isinstance(sys.exc_info()[1], SignalException):
                self._pcontext.close(death_sig, timeout=grace_s)
            super()._shutdown(death_sig, *args, **kwargs)

    return GracefulAgent


def restart_naming_agent(base: type) -> type:
    """`base` (torch's LocalElasticAgent or `graceful_agent`'s), printing the line of each rank killed by a signal
    (`failure_lines`) when torchrun restarts the ranks: its error file holds nothing, so the restarted ranks' resume
    line can name only the step and phase the others stopped in (a rank that failed with a message is named there,
    and its message is printed once, when the job ends)."""

    class RestartNamingAgent(base):
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            killed = {rank: failure for rank, failure in result.failures.items()
                      if failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM}  # not torchrun's own SIGTERM
            if result.is_failed() and killed and self._remaining_restarts > 0:  # the others' messages: their error files
                restarts = self._worker_group.spec.max_restarts
                attempt = restarts - self._remaining_restarts + 1
                for text in failure_lines(killed)[0]:
                    print(f"megatron-rl: {text}; torchrun restarts the ranks (restart {attempt} of {restarts}): they "
                          "resume from the newest complete checkpoint", file=sys.stderr, flush=True)
            return result

    return RestartNamingAgent


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    ours = argparse.ArgumentParser(
        prog="python -m megatron_rl.elastic", add_help=False, allow_abbrev=False,
        usage="%(prog)s [--log-file PATH] [--shutdown-timeout S] [torchrun's arguments]",
        description="torchrun with its log in a file and each failed rank's one line at the end (megatron_rl.elastic).",
    )
    ours.add_argument("--log-file", default="torchrun.log", metavar="PATH",
                      help="torchrun's own log; {node_rank} in it is the node's rank (default torchrun.log)")
    ours.add_argument("--shutdown-timeout", "--shutdown_timeout", type=int, default=SHUTDOWN_TIMEOUT_S, metavar="S",
                      help=f"seconds the ranks get to save after a stop signal, before SIGKILL (default {SHUTDOWN_TIMEOUT_S})")
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:  # this launcher's options first; torchrun's parser then prints its own and exits
        ours.print_help()
        print("\ntorchrun's arguments (torch.distributed.run), passed on:\n")
    known, torchrun_argv = ours.parse_known_args(argv)
    grace_s = known.shutdown_timeout
    # the agent torchrun's launch makes (torch.distributed.launcher.api.launch_agent) is this one
    if torchrun_takes("--shutdown-timeout"):
        torchrun_argv = [f"--shutdown-timeout={grace_s}", *torchrun_argv]
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        launcher.LocalElasticAgent = restart_naming_agent(LocalElasticAgent)  # torch's own, however often main runs
    else:
        launcher.LocalElasticAgent = restart_naming_agent(graceful_agent(grace_s))
    args = parse_args([f"--signals-to-handle={FORWARDED_SIGNALS}", *torchrun_argv])
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
                  f"(within {grace_s} s); launching again continues from the newest complete one "
                  f"(checkpoint.resume=auto); torchrun's log: {log_file}", file=sys.stderr)
            return EXIT_PREEMPTED
        print(f"megatron-rl: stopped by {name}: the ranks ended without a save (SIGTERM or SIGUSR1 saves first); "
              f"launching again continues from the newest complete checkpoint; torchrun's log: {log_file}", file=sys.stderr)
        return EXIT_RUNTIME_FAILURE
    return 0


if __name__ == "__main__":
    from megatron_rl.cli import finished

    sys.exit(finished(main()))
