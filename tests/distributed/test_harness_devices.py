"""The harness runs ranks on the CPU (gloo) on purpose, GPUs present or not: no CUDA device is visible to them."""

from __future__ import annotations

import os

from tests.distributed.harness import run_distributed


def _what_the_rank_sees(rank: int, world_size: int) -> tuple[str | None, bool]:
    import torch

    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


def test_ranks_see_no_cuda_device():
    assert run_distributed(_what_the_rank_sees, 2, timeout=120) == [("", False), ("", False)]


def _sum_of_ranks(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", world_size=world_size, rank=rank)
    try:
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        return value.item()
    finally:
        dist.destroy_process_group()


def test_a_master_port_taken_before_rank_0_binds_it_is_chosen_again(monkeypatch):
    """The port the harness chose can be taken by another process before rank 0's store binds it: that launch is
    started again on another port, and nothing else fails with it."""
    import socket

    from tests.distributed import harness

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    chosen = []
    free = harness.free_port

    def first_the_taken_port() -> int:
        chosen.append(taken.getsockname()[1] if not chosen else free())
        return chosen[-1]

    monkeypatch.setattr(harness, "free_port", first_the_taken_port)
    try:
        assert run_distributed(_sum_of_ranks, 2, timeout=120) == [3.0, 3.0]
    finally:
        taken.close()
    assert len(chosen) == 2 and chosen[0] != chosen[1]
