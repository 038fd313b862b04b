"""Run a function on N real processes, torchrun-style, and collect what each rank returns.

    from tests.distributed.harness import run_distributed

    def _worker(rank, world_size, layout):       # module top level: it is pickled by name
        ctx = init_parallel(ParallelConfig(**layout), ...)
        ...
        return {"loss": 1.23}                    # anything picklable

    def test_something():
        results = run_distributed(_worker, 2, {"tensor_parallel": 2}, timeout=120)

Each rank is a separate process with the torchrun variables set (MASTER_ADDR,
MASTER_PORT on a free port (megatron_rl.ports), RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and
runs ``fn(rank, world_size, *args)``. Return values come back through a
temporary directory, in rank order. If a rank raises, its traceback is
re-raised here (naming the rank) and the other ranks are killed at once; if the
timeout passes, every rank is killed and the ranks still running are named.
If rank 0 cannot bind MASTER_PORT because another process took it after it
was chosen, the launch starts again on another port (3 tries): nothing has run.

Start-up is cheap: processes are forked from a forkserver that has already
imported torch, megatron-core and megatron_rl (and applied the CPU
compatibility layer), so each launch costs milliseconds instead of ~6 s of
imports per rank. The forkserver is a clean process (no torch threads, no
process groups), so forking it is safe; ranks are non-daemonic so they may
start their own helpers (dist_checkpointing's Manager), and each runs in its
own process group so that killing a rank kills its helpers too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from megatron_rl.ports import free_port

DEFAULT_TIMEOUT = 180.0
PRELOAD = ["tests.distributed._preload"]


class DistributedTestError(RuntimeError):
    """A rank raised, died or timed out; the message names the rank(s) and carries the traceback."""


class _StorePortTaken(DistributedTestError):
    """Rank 0 could not bind MASTER_PORT: another process took the port after it was chosen. The launch is retried."""


LAUNCH_ATTEMPTS = 3


def _store_port_taken(text: str, port: int) -> bool:
    """Whether a rank's traceback is rank 0's store failing to bind MASTER_PORT (torch's TCPStore message)."""
    return "EADDRINUSE" in text and f"port: {port}," in text


_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        method = os.environ.get("MEGATRON_RL_TEST_START_METHOD", "forkserver")
        ctx = mp.get_context(method)
        if method == "forkserver":
            # Python 3.11's forkserver ignores the parent's sys.path when it imports the
            # preload modules: put the repository root on PYTHONPATH, which it inherits.
            root = str(Path(__file__).resolve().parents[2])
            paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if root not in paths:
                os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in paths if p])
            ctx.set_forkserver_preload(list(PRELOAD))
            _start_forkserver_without_cuda()
        _CTX = ctx
    return _CTX


def _start_forkserver_without_cuda() -> None:
    """Start the forkserver with no CUDA device visible, so neither it nor a rank forked from it touches a GPU.

    The ranks run on the CPU over gloo on purpose (the distributed tests compare layouts against a single-rank
    reference on gloo, as on the CPU machines); on a GPU machine their ranks would otherwise share one GPU, which
    NCCL refuses, and a forkserver that asked CUDA anything would hand its children a CUDA context they cannot use.
    Tests that need a GPU per rank pass cuda=True (fresh interpreters, see run_distributed).
    """
    from multiprocessing import forkserver

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _write(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        pickle.dump(payload, fh)
    os.replace(tmp, path)


def _rank_main(fn: Callable, rank: int, world_size: int, args: tuple, env: dict, out_dir: str, threads: int) -> None:
    try:
        os.setsid()  # own process group: the parent kills the rank with its helpers
    except OSError:
        pass
    # The parent's environment at launch time (not the forkserver's, which is older) + rank variables.
    os.environ.clear()
    os.environ.update(env)
    out = Path(out_dir) / f"rank{rank}.pkl"
    try:
        import torch

        torch.set_num_threads(threads)
        result = fn(rank, world_size, *args)
        try:
            _write(out, ("ok", result))
        except Exception as exc:  # noqa: BLE001 - unpicklable result
            _write(out, ("error", (time.time(), f"rank {rank} returned an unpicklable value: {exc!r}")))
            os._exit(1)
    except BaseException:  # noqa: BLE001
        # The failure time lets the parent name the rank that failed first (its peers
        # then fail too, with "connection closed" errors that only echo it).
        _write(out, ("error", (time.time(), traceback.format_exc())))
        # Exit at once: the peers are killed by the parent, no teardown that could wait on them.
        os._exit(1)


def _kill(procs: Sequence[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                proc.kill()
    for proc in procs:
        proc.join(timeout=5)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
    threads_per_rank: int | None = None,
    cuda: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the results by rank.

    fn must be importable (defined at a module's top level) and return a
    picklable value. Each rank sees this process's environment at call time,
    plus the torchrun variables, plus ``env``; it runs with
    ``threads_per_rank`` torch threads (default: the cores this process may run on / world_size, at least 1).
    Raises DistributedTestError naming the first rank that failed (with its
    traceback) or the ranks still running at the timeout; all processes are
    killed in both cases. Set MEGATRON_RL_TEST_START_METHOD=spawn to start
    ranks as fresh interpreters instead (slower, for debugging the forkserver).

    Ranks run on the CPU (gloo) even where GPUs are present: no CUDA device is visible to
    them (CUDA_VISIBLE_DEVICES=''). cuda=True gives them the GPUs (fresh interpreters:
    a forked CUDA context is unusable); the caller skips, saying so, when there are fewer
    GPUs than ranks.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("spawn") if cuda else _context()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = threads_per_rank or max(1, cores // world_size)
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        try:
            return _launch(ctx, fn, world_size, args, timeout, env, threads, cuda, free_port())
        except _StorePortTaken:
            # Nothing ran yet: rank 0 failed in its rendezvous, before any rank could do work.
            if attempt == LAUNCH_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def _launch(
    ctx: Any, fn: Callable, world_size: int, args: tuple, timeout: float, env: dict | None, threads: int, cuda: bool, port: int
) -> list[Any]:
    procs: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="mrl-dist-") as out_dir:
        try:
            for rank in range(world_size):
                rank_env = {
                    **os.environ,
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world_size),
                    "OMP_NUM_THREADS": str(threads),
                    **({} if cuda else {"CUDA_VISIBLE_DEVICES": ""}),
                    **(env or {}),
                }
                proc = ctx.Process(
                    target=_rank_main,
                    args=(fn, rank, world_size, args, rank_env, out_dir, threads),
                    name=f"rank{rank}",
                    daemon=False,
                )
                proc.start()
                procs.append(proc)
            name = getattr(fn, "__qualname__", repr(fn))
            return _wait(procs, Path(out_dir), world_size, timeout, name, port)
        finally:
            _kill(procs)


def _read(path: Path) -> Any:
    with open(path, "rb") as fh:
        return pickle.load(fh)


FAILURE_GRACE_S = 1.0


def _raise_first_failure(procs: list[Any], out_dir: Path, world_size: int, name: str, port: int) -> None:
    """Raise for the rank that failed first, after giving its peers a moment to report too.

    When one rank raises and exits, its peers fail in their next collective with
    errors that only say the connection closed; reporting whichever file the
    polling loop happened to read first would often name an echo, not the cause.
    """
    deadline = time.monotonic() + FAILURE_GRACE_S
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        time.sleep(0.02)
    exitcodes = [p.exitcode for p in procs]  # before the kill: None = still running
    _kill(procs)
    failures, silent = [], []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.pkl"
        if path.exists():
            status, value = _read(path)
            if status == "error":
                failed_at, text = value
                failures.append((failed_at, rank, text))
        elif exitcodes[rank] is not None:
            silent.append(f"rank {rank} exited with code {exitcodes[rank]} without a result")
    failures.sort()
    _, rank, text = failures[0]
    if rank == 0 and _store_port_taken(text, port):
        raise _StorePortTaken(f"{name}: rank 0 could not bind MASTER_PORT={port}, taken by another process:\n{text}")
    others = [r for _, r, _ in failures[1:]]
    notes = ([f"ranks {others} failed after it"] if others else []) + silent
    also = f" ({'; '.join(notes)})" if notes else ""
    raise DistributedTestError(f"{name}: rank {rank} of {world_size} failed{also}:\n{text}")


def _wait(procs: list[Any], out_dir: Path, world_size: int, timeout: float, name: str, port: int) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    while True:
        for rank, proc in enumerate(procs):
            if rank in results:
                continue
            path = out_dir / f"rank{rank}.pkl"
            if path.exists():
                status, value = _read(path)
                if status == "error":
                    _raise_first_failure(procs, out_dir, world_size, name, port)
                results[rank] = value
            elif proc.exitcode is not None:
                if path.exists():
                    continue  # written between the two checks: read it next round
                _kill(procs)
                raise DistributedTestError(
                    f"{name}: rank {rank} of {world_size} exited with code {proc.exitcode} without a result "
                    "(killed, or crashed outside Python)"
                )
        if len(results) == world_size:
            for proc in procs:
                proc.join(timeout=max(1.0, deadline - time.monotonic()))
            return [results[r] for r in range(world_size)]
        if time.monotonic() > deadline:
            running = [r for r in range(world_size) if r not in results]
            _kill(procs)
            raise DistributedTestError(
                f"{name}: timed out after {timeout:.0f}s; ranks still running: {running} (all ranks killed)"
            )
        time.sleep(0.02)
