"""On a CUDA GPU: an NCCL group refuses a host tensor, and group_device gives the tensor it takes
(one rank: NCCL refuses two ranks of one group on one GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rl.ports import free_port


@pytest.mark.gpu
def test_nccl_takes_the_group_device_and_refuses_the_host():
    from megatron_rl.parallel.devices import group_device

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        device = group_device()
        assert device == torch.device("cuda", 0)
        flag = torch.ones(1, dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        assert int(flag.item()) == 1
        with pytest.raises(RuntimeError):
            dist.all_reduce(torch.ones(1, dtype=torch.int32), op=dist.ReduceOp.MAX)  # what the flags once were
    finally:
        dist.destroy_process_group()
