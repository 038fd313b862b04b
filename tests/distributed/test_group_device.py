"""parallel.devices.group_device: a collective's small flags and counts are made on the device its group's backend
takes (NCCL: this process's CUDA device; gloo: the host), through the calls the push and the route gather make.

On a GPU the NCCL branch runs for real in tests/gpu/test_group_device_gpu.py (NCCL refuses a host tensor).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed


def _worker(rank: int, world_size: int):
    from megatron_rl.parallel.devices import group_device
    from megatron_rl.weight_sync.push import any_rank

    dist.init_process_group("gloo")
    try:
        pair = dist.new_group([0, 1], backend="gloo")
        return {
            "world": group_device(), "pair": group_device(pair),
            # each flag set on one rank only: every rank learns it (and a flag set nowhere stays False)
            "rank1": any_rank(rank == 1, dist.group.WORLD), "rank0": any_rank(rank == 0, pair), "none": any_rank(False, pair),
        }
    finally:
        dist.destroy_process_group()


def test_gloo_groups_take_host_tensors_and_any_rank_agrees():
    for result in run_distributed(_worker, 2, timeout=120):
        assert result["world"] == result["pair"] == torch.device("cpu"), result
        assert result["rank1"] is True and result["rank0"] is True and result["none"] is False, result


def test_an_nccl_group_takes_this_process_cuda_device(monkeypatch):
    """The choice for NCCL, with the backend's name as torch reports it (the call itself needs a GPU)."""
    from megatron_rl.parallel import devices as context

    monkeypatch.setattr(context.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(context.torch.cuda, "current_device", lambda: 3)
    assert context.group_device(object()) == torch.device("cuda", 3)
    monkeypatch.setattr(context.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert context.group_device(object()) == torch.device("cpu")
