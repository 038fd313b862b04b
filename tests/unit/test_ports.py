"""megatron_rl.ports: a port for what this process is about to start, drawn where the kernel hands none out itself."""

from __future__ import annotations

import socket

from megatron_rl.ports import ephemeral_range, free_port


def test_ports_are_free_and_outside_the_range_the_kernel_hands_out():
    low, high = ephemeral_range()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:  # the kernel's own setting, read here independently
        assert (low, high) == tuple(int(v) for v in fh.read().split())
    for host in ("127.0.0.1", ""):  # loopback (servers, the harness) and every address (nccl_m2n's rendezvous)
        ports = {free_port(host) for _ in range(20)}
        assert all(p < low or p > high for p in ports), (sorted(ports), low, high)
        for port in ports:  # each can be bound
            with socket.socket() as sock:
                sock.bind((host, port))
    with socket.socket() as sock:  # a kernel-chosen port, for contrast, is inside the range
        sock.bind(("127.0.0.1", 0))
        assert low <= sock.getsockname()[1] <= high


def test_ranks_that_seed_random_alike_draw_different_ports():
    """Every trainer rank seeds Python's `random` with the run's seed (parallel.seed_all); colocated servers started at
    once on two ranks must still not draw the same port."""
    import random

    draws = []
    for _ in range(2):  # two "ranks"
        random.seed(1234)
        draws.append([free_port() for _ in range(5)])
    assert draws[0] != draws[1], draws
