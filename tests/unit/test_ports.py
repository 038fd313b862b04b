"""megatron_rl.ports: a port for what this process is about to start, drawn where the kernel hands none out itself."""

from __future__ import annotations

import socket

from megatron_rl.ports import ephemeral_range, free_port, port_in_use


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


def test_a_port_is_in_use_while_a_socket_listens_on_it_and_free_in_time_wait():
    """What VLLMServer.start asks of a port given to it before starting vLLM: in use while another process's socket
    listens on it; free once that closes, also with the closed side's connection left in TIME_WAIT, as an earlier vLLM
    server on the port leaves it (vLLM's launcher binds with SO_REUSEADDR; a plain bind would still fail there)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's create_server_socket
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert port_in_use("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the listening side closes first: its end of the connection waits in TIME_WAIT on `port`
    listener.close()
    client.close()
    with socket.socket() as plain:  # the contrast: without SO_REUSEADDR the port is not bindable yet
        try:
            plain.bind(("127.0.0.1", port))
            plain_bound = True
        except OSError:
            plain_bound = False
    assert not plain_bound, "no TIME_WAIT connection was left on the port: the case is not made"
    assert not port_in_use("127.0.0.1", port)
    assert not port_in_use("192.0.2.1", port)  # not an address of this host: for the server to report, not in use
