"""The process `megatron-rl serve` becomes: vLLM's OpenAI API server, with the ZMQ sockets between its processes in a
directory of its own, removed when the server ends.

    python -m megatron_rl.rollout.served <the arguments of python -m vllm.entrypoints.openai.api_server>

vLLM names the sockets between the API server and its engine core by uuid in the system temp directory and leaves
them there when it stops: 3 socket files a start. A server the trainer starts gets a directory from the trainer, which
removes it at the server's stop (rollout.common.SocketDir). `megatron-rl serve` replaces itself with the server
(signals reach it directly), so nothing is left to clean up after it: this process makes its own directory and
removes it when vLLM's server returns (SIGTERM, SIGINT, a failed start). A server killed by SIGKILL leaves it
(named mrl-vllm-* in the temp directory).
"""

from __future__ import annotations

import os
import runpy
import sys

from megatron_rl.rollout.common import SocketDir

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def main(argv: list[str]) -> None:
    sockets = SocketDir()
    os.environ.update(sockets.environment())  # before vLLM reads it, and inherited by its engine core
    if sockets.path:
        print(f"megatron-rl serve: vLLM's sockets in {sockets.path} (removed when the server ends)", file=sys.stderr, flush=True)
    sys.argv = [SERVER_MODULE, *argv]
    try:
        runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)  # spawned children import it by name
    finally:
        sockets.remove()


if __name__ == "__main__":
    main(sys.argv[1:])
