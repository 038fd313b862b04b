"""The harness runs ranks on the CPU (gloo) on purpose, GPUs present or not: no CUDA device is visible to them."""

from __future__ import annotations

import os

from tests.distributed.harness import run_distributed


def _what_the_rank_sees(rank: int, world_size: int) -> tuple[str | None, bool]:
    import torch

    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()


def test_ranks_see_no_cuda_device():
    assert run_distributed(_what_the_rank_sees, 2, timeout=120) == [("", False), ("", False)]
