"""The process a rollout server runs (`megatron-rl serve`, and every server a VLLMServer starts): vLLM's OpenAI API
server, with the request-head limit of rollout.server_limits and the ZMQ sockets between its processes in a
directory of its own.

    python -m megatron_rl.rollout.server_main <the arguments of python -m vllm.entrypoints.openai.api_server>

vLLM's own entry point (vllm.entrypoints.launchers.api_server.entry.main: its parser, its logging set-up, its
checks, run_server) runs here with one uvicorn option more: the HTTP protocol, which answers 431 to a request head
over rollout.server_limits.HEAD_LIMIT_BYTES before it is read in full (run_server passes uvicorn options through).

vLLM names the sockets between the API server and its engine core by uuid in the system temp directory and leaves
them there when it stops: 3 socket files a start. A server the trainer starts gets a directory from the trainer
(VLLM_RPC_BASE_PATH set), which removes it at the server's stop (rollout.engine_files.SocketDir). `megatron-rl serve`
replaces itself with the server (signals reach it directly), so nothing is left to clean up after it: this process
makes its own directory and removes it when vLLM's server returns (SIGTERM, SIGINT, a failed start). A server killed
by SIGKILL leaves it (named mrl-vllm-* in the temp directory).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
import sys

from megatron_rl.rollout.engine_env import started_with_stop_signals_blocked, stop_signals_blocked
from megatron_rl.rollout.engine_files import SocketDir


def run_vllm_server(argv: list[str]) -> None:
    """vLLM's API server on `argv`, as its own entry point runs it, with the head-limited HTTP protocol."""
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from megatron_rl.rollout.server_limits import head_limited_protocol

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-compatible API server")).parse_args(argv)
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    uvloop.run(run_server(args, http=head_limited_protocol()))


def main(argv: list[str]) -> None:
    sockets = SocketDir()
    if SocketDir.VARIABLE not in os.environ:  # a server the trainer starts has the trainer's directory
        os.environ.update(sockets.environment())  # before vLLM reads it, and inherited by its engine core
        if sockets.path:
            print(f"megatron-rl serve: vLLM's sockets in {sockets.path} (removed when the server ends)", file=sys.stderr,
                  flush=True)
    try:
        # a server the trainer started with the stop signals blocked: its engine core keeps them blocked too
        with stop_signals_blocked() if started_with_stop_signals_blocked() else nullcontext():
            run_vllm_server(argv)
    finally:
        sockets.remove()


if __name__ == "__main__":
    main(sys.argv[1:])
