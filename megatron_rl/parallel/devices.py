"""Which device a small tensor goes to: a collective's flag (by its group's backend), offsets for a kernel.

A leaf module (torch only), so that kernels (parallel.grouped_gemm_torch, models.attention) and collectives
anywhere can use it without importing the parallel context.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

ProcessGroup = Any  # torch.distributed.ProcessGroup


def group_device(group: ProcessGroup | None = None) -> torch.device:
    """The device a tensor collective over `group` (default: the world) takes: this process's CUDA device where the
    group's backend is NCCL alone (NCCL refuses host tensors: "No backend type associated with device type cpu"),
    else the host (gloo, or a "cpu:gloo,cuda:nccl" group). Small flags and counts on a model-parallel or world group
    are made there, so that one code path serves gloo on CPU and NCCL on GPU."""
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor (offsets, sizes) on `device` without a stream synchronisation: on CUDA, copied from
    pinned memory with non_blocking (a plain copy from pageable memory waits for the stream: once per layer, that
    keeps the host from running ahead of the GPU); elsewhere a plain `.to`."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


__all__ = ["group_device", "host_to_device"]
