"""The environment of the processes an engine starts: where its worker runs, its threads, torch's compiler, and the
stop warning a job sends every process."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

def worker_in_engine_core(config) -> bool:
    """Whether an engine whose core runs in a process of its own (a server; rollout.multiprocessing) should run its
    one worker inside that core process: vLLM's "uni" executor, two interpreters instead of three.

    For a world of one worker (tensor_parallel x pipeline_parallel = 1) vLLM picks the uni executor, but its CPU
    platform replaces it with a spawned worker process (the mp executor) unless VLLM_ENABLE_V1_MULTIPROCESSING=0:
    one more interpreter that imports vLLM: 6-7 s of a 17-24 s start on 2 cores (bench/engine_start.py). On GPU
    platforms vLLM's own choice already is the uni executor, so this says False there."""
    if config.tensor_parallel * config.pipeline_parallel != 1:
        return False
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM here (a dry run on a login node): the engine's own start reports it
        return False
    return current_platform.is_cpu()


def compiles_nothing(config) -> bool:
    """Whether the engine runs with nothing torch.compile'd: on a CPU platform with rollout.enforce_eager (the default).

    enforce_eager keeps vLLM from compiling the model, but vLLM still torch.compile's helpers of its sampler (the rank
    of each sampled token among the vocabulary's logprobs, vllm.v1.sample.ops.logprobs) with inductor. On a CPU that
    needs a C++ compiler and costs every engine start 2.0-2.4 s at its first generation on a 2-core machine (dynamo,
    inductor's cache, and its instruction-set probes, each a child interpreter; 0.06 s eager) for one comparison over
    the vocabulary. There they run eagerly:
    COMPILE_OFF in the environment of an engine's own processes, torch's compiler off in the process of an in-process
    engine while it runs (the actor compiles nothing on CPU either: models.kernels.use_megatron_jit). On GPUs vLLM
    keeps its compiled kernels."""
    if not config.enforce_eager:
        return False
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


COMPILE_OFF = {"TORCH_COMPILE_DISABLE": "1"}
"""torch's compiler off in a process from its start (torch reads it at import)."""


def engine_core_worker_threads(engines: int = 1) -> int:
    """The OpenMP threads of a worker inside its engine core on CPU (worker_in_engine_core), one of `engines` such
    engines on this host's CPUs: the CPUs this process may run on, less one per engine, shared among them. vLLM's
    own CPU executor keeps one CPU per worker for the process that feeds its core (the API server, or the LLM
    client's output processing) and the core's scheduler when it spawns the worker (vllm.utils.ompmultiprocessing);
    inside the core, torch's default of every CPU has the model's threads contend with that process for the same
    cores (bench/engine_start.py). Where the platform has no CPU affinity (macOS), every CPU counts."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, (cpus - engines) // max(1, engines))


def engine_core_environment(config, engines: int = 1) -> dict[str, str]:
    """What the environment of an engine core process that runs its worker inside it needs, one of `engines` on
    this host: OMP_NUM_THREADS of engine_core_worker_threads(engines). Empty where the worker has a process of its
    own, or where OMP_NUM_THREADS is set (the user's, or torchrun's 1 for each of several ranks: it stands)."""
    if "OMP_NUM_THREADS" in os.environ or not worker_in_engine_core(config):
        return {}
    return {"OMP_NUM_THREADS": str(engine_core_worker_threads(engines))}


@contextmanager
def environment_set(variables: dict[str, str]) -> Iterator[None]:
    """This process's environment with `variables` set, as it was again afterwards: for a child process that
    reads them at its start (vLLM spawns its engine core while vllm.LLM is built)."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def stop_warning_blocked() -> Iterator[None]:
    """SIGUSR1 blocked in this thread while it starts child processes, which keep it blocked (a signal mask survives
    fork and exec): vLLM's engine core then outlives a stop warning sent to every process of a job (Slurm's srun passes
    USR1 on to every process of its step; USR1's default action ends a process). This process loses nothing: the
    warning goes to another of its threads, or waits, pending, until the mask is restored."""
    import signal

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
