"""The environment of the processes an engine starts: where its worker runs, its threads, torch's compiler, the stop
signals a job sends every process, and the process that owns them."""

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


STOP_SIGNALS_OF_A_JOB = frozenset({"SIGTERM", "SIGUSR1"})
"""What a cluster sends every process of a job before it ends it: Slurm's warning before the time limit (USR1, which
srun passes on to each process of its step) and its TERM at a requeue, a pre-emption or a scancel (to every process of
the job); torchrun passes both on to each rank's process group, which holds the rank's engine core."""


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """SIGTERM and SIGUSR1 blocked in this thread while it starts an engine's processes, which keep them blocked (a
    signal mask survives fork and exec, and vLLM's handlers only run once a signal is delivered): the engine core and
    its workers then outlive a job's stop signals (STOP_SIGNALS_OF_A_JOB), so the trainer's step in progress, and the
    save after it at the step boundary, still have their engine. Without this, vLLM's own TERM handler ends the core
    and the step restarts the engine: slower than Slurm's KillWait under load, and samples the uninterrupted run never
    drew. The engine is ended by SIGINT instead (`interrupt`: vLLM's handler treats it as TERM), and by `watch_owner`
    if its owner dies without closing it. This process loses nothing: a signal goes to another of its threads, or
    waits, pending, until the mask is restored.

    multiprocessing's resource tracker is started first: its start unblocks SIGTERM (and SIGINT) in the starting
    thread instead of restoring the mask (multiprocessing.resource_tracker, CPython 3.11), which would undo this block
    at vLLM's first spawn."""
    import signal
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    blocked = {getattr(signal, name) for name in STOP_SIGNALS_OF_A_JOB}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def started_with_stop_signals_blocked() -> bool:
    """Whether this process was started inside stop_signals_blocked (a server the trainer supervises): its own
    engine core must then start inside it too, past the resource tracker's unblocking."""
    import signal

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    return all(getattr(signal, name) in blocked for name in STOP_SIGNALS_OF_A_JOB)


def interrupt(processes) -> None:
    """SIGINT to each of an engine's processes (multiprocessing.Process) still running: vLLM's graceful shutdown, which
    the TERM of its own shutdown cannot start while stop_signals_blocked holds (it would wait 5 s, then SIGKILL)."""
    import signal

    for process in processes:
        if process.pid is not None and process.is_alive():
            try:
                os.kill(process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass


OWNER_ENV = "MEGATRON_RL_ENGINE_OWNER"
"""pid:start-time of the process that started an engine's processes (owner_environment, watch_owner)."""


def _started(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def owner_environment() -> dict[str, str]:
    """The variable that makes this process the owner of the engine processes it starts (watch_owner)."""
    return {OWNER_ENV: f"{os.getpid()}:{_started(os.getpid())!r}"}


_watched: list[int] = []


def watch_owner(interval_s: float = 1.0) -> bool:
    """In an engine's worker (inside its core, a process of its own below the core, or below the trainer for an
    in-process engine of several workers): once the process that started the engine (OWNER_ENV) is gone, SIGKILL
    the core (a worker's parent that is not the owner) and this process. A core blocks the stop signals
    (stop_signals_blocked), so a trainer killed without closing its engine (SIGKILL, the out-of-memory killer) would
    otherwise leave it running, holding its memory, when torchrun restarts the rank. Once per process; False where no
    owner is named (an engine in the trainer's own process, a server started by hand)."""
    value = os.environ.get(OWNER_ENV, "")
    if _watched or ":" not in value:
        return False
    pid_text, _, started = value.partition(":")
    owner = int(pid_text)
    parent = os.getppid()
    core = None if parent == owner else (parent, _started(parent))  # a worker below the core: the core is its parent
    _watched.append(owner)

    def watch() -> None:
        import signal
        import time

        while repr(_started(owner)) == started:
            time.sleep(interval_s)
        if core is not None and _started(core[0]) == core[1]:
            os.kill(core[0], signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    import threading

    threading.Thread(target=watch, name="megatron-rl-owner-watch", daemon=True).start()
    return True


def watching_owner() -> bool:
    """Whether this process watches the process that started its engine (watch_owner)."""
    return bool(_watched)
