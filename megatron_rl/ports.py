"""A TCP port for something this process is about to start (a rendezvous store, a vLLM server, a weight-transfer
group): free when chosen, and drawn where no other process is handed it without asking for it by number.

A port that `bind(0)` gives is in the kernel's ephemeral range, and so is the local port of every outgoing
connection gloo, NCCL, vLLM and HTTP clients open: any of them can take it between this choice and the bind that
follows seconds later. Below that range only an explicit bind takes a port, so the draw is made there (32 tries),
falling back to `bind(0)` where the range is unknown or the low ports are all taken. The caller still binds it
later and handles a port taken in between (rarer now, not impossible).
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

LINUX_DEFAULT_RANGE = (32768, 60999)
TRIES = 32


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (Linux: /proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return LINUX_DEFAULT_RANGE


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` a moment ago ("" = every address of this host), below the ephemeral range if one is."""
    low, _ = ephemeral_range()
    # the OS's randomness, not `random`'s: every trainer rank seeds that alike, and ranks starting servers at once
    # would draw the same ports
    draw = random.SystemRandom()
    candidates = draw.sample(range(max(1024, low - 8192), low), TRIES) if low - 8192 > 1024 else []
    for port in candidates + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError(f"no free TCP port on {host or 'any address'}")


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not bind `port` on `host` now because another socket holds it (EADDRINUSE).

    Bound as vLLM's server binds it (SO_REUSEADDR, vllm.entrypoints.launchers.launcher.create_server_socket): a port
    an earlier server's closed connections left in TIME_WAIT counts as free. Any other failure (an address not of
    this host) is the server's to report: False."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


__all__ = ["ephemeral_range", "free_port", "port_in_use"]
