"""Weight pushes by collective broadcast: trainer rank 0 -> every engine worker.

The group is separate from the trainer's world and from vLLM's own groups
(vLLM's `stateless_init_torch_distributed_process_group`, a TCPStore of its
own): rank 0 is the pushing trainer rank, ranks 1..W are the engine workers
(every worker of every engine or server, each engine's TP/PP workers in
order). Backend NCCL on GPU (engine workers on other GPUs than the trainer:
NCCL refuses two ranks on one GPU), gloo on CPU; the code is the same.

One bucket on the wire:
1. the trainer packs the bucket's tensors into one flat byte buffer
   (offsets aligned to 64 bytes so each tensor is a view of it again) and
   describes it in JSON: name, dtype, shape, offset per tensor;
2. it sends that JSON to every engine by RPC (`mrl_broadcast_receive`, on a
   thread started per engine and call: the workers block in the broadcast
   until rank 0 joins, so no fixed pool of threads may run them);
3. it broadcasts the buffer from rank 0; each worker unpacks views of its
   copy and stages them exactly like a bucket that came by RPC (manifest
   check, kept until the push commits).

The whole push is checked against the engine's manifest on the trainer before
the first bucket goes out (weight_sync.stream.check_announced), so a refused
push never reaches the workers. A failure during a broadcast (a worker died, an RPC
failed) leaves the group unusable: it is closed and the error is the engine's
(the engine restarts and the group is formed again).
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from datetime import timedelta
from typing import Any, Callable

import torch

from megatron_rl.weight_sync.buckets import Bucket, tensor_bytes
from megatron_rl.weight_sync.manifest import WeightPushError

ALIGN_BYTES = 64
"""Tensor offsets in a packed bucket are multiples of this (any dtype can view them)."""


class BroadcastError(RuntimeError):
    """A weight broadcast or the forming of its group failed; the group is closed."""


def resolve_backend(backend: str) -> str:
    """'auto' -> 'nccl' when CUDA is available, else 'gloo'; checks the name."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"weight broadcast backend {backend!r}: use 'nccl' (GPU), 'gloo' (CPU) or 'auto'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("weight broadcast backend 'nccl' needs CUDA, which this process does not have: use 'gloo'")
    return backend


def backend_device(backend: str) -> torch.device:
    """Where a backend's buffers live: the current CUDA device for NCCL, host memory for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


# ---- packing ---------------------------------------------------------------------------------------
def _aligned(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def describe_bucket(bucket: Bucket) -> dict:
    """JSON-able layout of a packed bucket: {'nbytes': total, 'tensors': [{name, dtype, shape, offset}]}."""
    entries, offset = [], 0
    for name, tensor in bucket:
        entries.append(
            {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape), "offset": offset}
        )
        offset = _aligned(offset + tensor_bytes(tensor))
    return {"nbytes": offset, "tensors": entries}


def check_layout(layout: dict) -> None:
    """Refuse (WeightPushError) a layout that is not what describe_bucket makes of its own entries: every dtype a
    torch dtype, every dimension >= 0, each tensor at the aligned end of the one before, nbytes the aligned end of
    the last. Run by an engine worker before it allocates or reads the bucket (the layout came over HTTP)."""
    offset = 0
    for entry in layout["tensors"]:
        name = entry.get("name")
        dtype = getattr(torch, str(entry["dtype"]), None)
        shape = [int(d) for d in entry["shape"]]
        if not isinstance(dtype, torch.dtype) or any(d < 0 for d in shape):
            raise WeightPushError(f"weight push refused: tensor {name!r} of a packed bucket has dtype {entry['dtype']!r} "
                                  f"and shape {shape}: not a tensor. Nothing was loaded.")
        if int(entry["offset"]) != offset:
            raise WeightPushError(f"weight push refused: tensor {name!r} starts at byte {entry['offset']} of its packed "
                                  f"bucket, where the tensors before it end at {offset}. Nothing was loaded.")
        numel = math.prod(shape)
        offset = _aligned(offset + numel * torch.empty(0, dtype=dtype).element_size())
    if int(layout["nbytes"]) != offset:
        raise WeightPushError(f"weight push refused: a packed bucket says {layout['nbytes']} bytes, its tensors take "
                              f"{offset}. Nothing was loaded.")


def pack_bucket(bucket: Bucket, layout: dict, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's bytes in one uint8 tensor on `device`, laid out as `layout` (describe_bucket) says.

    out: a uint8 buffer of at least layout['nbytes'] to pack into (reused across buckets: a fresh
    allocation per bucket costs page faults that took longer than the copy on CPU).
    """
    nbytes = int(layout["nbytes"])
    if out is not None and out.numel() >= nbytes:
        flat = out[:nbytes]
    else:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for (_, tensor), entry in zip(bucket, layout["tensors"]):
        nbytes = tensor_bytes(tensor)
        if nbytes:  # one copy, straight from the tensor as it is laid out (a strided view needs no contiguous copy)
            start = int(entry["offset"])
            flat[start : start + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
    return flat


def unpack_bucket(layout: dict, flat: torch.Tensor) -> Bucket:
    """Views of `flat` (named, typed and shaped as `layout` says): the inverse of pack_bucket."""
    if flat.dtype != torch.uint8 or flat.numel() != int(layout["nbytes"]):
        raise BroadcastError(
            f"packed bucket holds {flat.numel()} {flat.dtype} elements; its layout says {layout['nbytes']} bytes"
        )
    check_layout(layout)
    bucket: Bucket = []
    for entry in layout["tensors"]:
        dtype = getattr(torch, entry["dtype"])
        shape = [int(d) for d in entry["shape"]]
        numel = math.prod(shape)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        start = int(entry["offset"])
        bucket.append((entry["name"], flat[start : start + nbytes].view(dtype).view(shape)))
    return bucket


# ---- the group -------------------------------------------------------------------------------------
def open_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
               listen_socket: socket.socket | None = None):
    """Join the weight-broadcast group (blocks until all `world_size` ranks have joined).

    listen_socket (rank 0): an already listening socket for the group's TCPStore. Workers started
    before rank 0 gets here then queue in its backlog; without it a worker that connects first is
    refused and torch's TCPStore client retries only after a random back-off of up to minutes.
    """
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        host, int(port), int(rank), int(world_size), backend, timeout=timedelta(seconds=float(timeout_s)),
        listen_socket=listen_socket,
    )


def close_group(group: Any, linger_s: float) -> None:
    """Tear a group down without blocking the caller.

    Destroying a gloo group whose broadcast never completed (a peer died or never joined) blocks
    until that operation times out, abort() or not (measured: the full group timeout). So the last
    reference is handed to a daemon thread that keeps it until the group's operations have timed
    out; a process exiting meanwhile does not wait for it.
    """
    for method in ("abort", "shutdown"):
        try:
            getattr(group, method)()
            break
        except Exception:  # a broken group may refuse either; it is being dropped anyway
            continue

    def linger(held: list) -> None:
        time.sleep(linger_s + 5.0)
        held.clear()

    threading.Thread(target=linger, args=([group],), name="weight-broadcast-close", daemon=True).start()


def broadcast_from_root(group: Any, tensor: torch.Tensor, *, abort_if: Callable[[], BaseException | None] | None = None,
                        timeout_s: float = 600.0, waiting_for: Callable[[], list[str]] | None = None) -> None:
    """Broadcast `tensor` from group rank 0 in place on every rank.

    abort_if: polled while the broadcast runs; an exception it returns (e.g. a
    receiving RPC failed before its worker joined the broadcast) is raised
    instead of waiting for peers that will never arrive.
    waiting_for: on a timeout, the names of the peers still missing (for the error).
    """
    wait_work(start_broadcast(group, tensor), f"weight broadcast of {tensor.numel()} bytes", abort_if=abort_if,
              timeout_s=timeout_s, waiting_for=waiting_for)


def start_broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start broadcasting `tensor` from group rank 0 (in place on every rank); the work to wait on (wait_work)."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def wait_work(work: Any, what: str, *, abort_if: Callable[[], BaseException | None] | None = None,
              timeout_s: float = 600.0, waiting_for: Callable[[], list[str]] | None = None,
              deadline: float | None = None) -> None:
    """Wait for a collective's work, polling abort_if; BroadcastError after timeout_s (or at `deadline`,
    time.monotonic()) naming `what` and the peers still missing."""
    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    while not work.is_completed():
        failure = abort_if() if abort_if is not None else None
        if failure is not None:
            raise BroadcastError(f"weight broadcast abandoned: {failure}") from failure
        if time.monotonic() > deadline:
            missing = f"; still waiting for {', '.join(waiting_for())}" if waiting_for is not None else ""
            raise BroadcastError(f"{what} did not finish in {timeout_s:.0f} s{missing}")
        time.sleep(0.0005)
    work.wait()


def default_host(engine_hosts: list[str]) -> str:
    """The address engine workers reach this process at: loopback when every engine is local, else this host's."""
    local = {"127.0.0.1", "localhost", "::1", ""}
    if all(h in local for h in engine_hosts):
        return "127.0.0.1"
    return host_address()


def host_address() -> str:
    """This host's address as other hosts reach it (its hostname resolved)."""
    return socket.gethostbyname(socket.gethostname())


def listening_socket(host: str) -> socket.socket:
    """A TCP socket bound to a free port of `host` and already listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


class BroadcastSender:
    """Trainer end (rank 0) of the weight-broadcast group; see the module docstring.

    Each engine is given as two callables that make its workers do something
    (over RPC or HTTP) and return when they are done:
    `join(info_json)` joins the group, `receive(layout_json)` takes part in one
    bucket's broadcast and stages it. `names` (one per engine, e.g. its URL)
    are what errors call the engines; by default `engine 0`, `engine 1`, ...

    Every call runs on a thread of its own, started for it: the calls block
    until rank 0 joins the same rendezvous or broadcast, so a fixed pool of
    threads would be exhausted by as many engines as it has threads and rank 0
    would never get one (any number of engines works this way).
    """

    receive_method = "mrl_broadcast_receive"
    """The worker-extension method that takes part in one bucket's send (rollout.worker_ext)."""

    def __init__(self, backend: str = "auto", host: str = "127.0.0.1", timeout_s: float = 600.0):
        self.backend = resolve_backend(backend)
        self.host = host
        self.timeout_s = float(timeout_s)
        self.group: Any = None
        self.device = backend_device(self.backend)
        self._buffer: torch.Tensor | None = None  # the packing buffer, reused by every send (grows to the largest bucket)

    @property
    def connected(self) -> bool:
        return self.group is not None

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the packing buffer (about the largest bucket)."""
        return 0 if self._buffer is None else int(self._buffer.numel())

    def connect(self, joins: list[Callable[[str], Any]], workers_per_engine: list[int],
                names: list[str] | None = None) -> None:
        """Form the group: rank 0 here, then each engine's workers at consecutive ranks."""
        self.close()
        names = _engine_names(names, len(joins))
        if len(workers_per_engine) != len(joins):
            raise ValueError(f"{len(joins)} engines but {len(workers_per_engine)} worker counts")
        world_size = 1 + sum(workers_per_engine)
        listener = listening_socket(self.host)
        port = int(listener.getsockname()[1])
        messages, rank_offset = [], 1
        for workers in workers_per_engine:
            info = {"host": self.host, "port": port, "rank_offset": rank_offset, "world_size": world_size,
                    "backend": self.backend, "timeout_s": self.timeout_s, "trainer_gpu": gpu_uuid(self.device)}
            messages.append(json.dumps(info))
            rank_offset += workers
        joined = call_in_threads(joins, messages, "weight-broadcast-join")
        # The workers block in the rendezvous until this rank joins: wait on both at once, and
        # give up as soon as a worker's join call fails (it will never reach the rendezvous).
        (group_future,) = call_in_threads(
            [lambda _: open_group(self.host, port, 0, world_size, self.backend, self.timeout_s, listener)], [None],
            "weight-broadcast-open",
        )
        wait_for_engines([group_future, *joined], ["this trainer rank (rank 0)", *names], self.timeout_s,
                         what=f"forming the weight-broadcast group of {len(joins)} engine(s), {world_size} ranks")
        self.group = group_future.result()

    def send(self, bucket: Bucket, receives: list[Callable[[str], Any]], names: list[str] | None = None) -> list[Any]:
        """Broadcast one bucket to every engine; returns each engine's answer to its receive call."""
        if self.group is None:
            raise BroadcastError("the weight-broadcast group is not formed (connect first)")
        names = _engine_names(names, len(receives))
        layout = describe_bucket(bucket)
        if self._buffer is None or self._buffer.numel() < layout["nbytes"]:
            self._buffer = None  # free the old one first
            self._buffer = torch.empty(int(layout["nbytes"]), dtype=torch.uint8, device=self.device)
        flat = pack_bucket(bucket, layout, self.device, out=self._buffer)
        futures = call_in_threads(receives, [json.dumps(layout)] * len(receives), "weight-broadcast-receive")

        def failed_receive() -> BaseException | None:
            for name, future in zip(names, futures):
                if future.done() and future.exception() is not None:
                    return BroadcastError(f"{name} failed: {future.exception()}")
            return None

        what = f"a weight broadcast of {layout['nbytes']} bytes to {len(receives)} engine(s)"
        try:
            broadcast_from_root(self.group, flat, abort_if=failed_receive, timeout_s=self.timeout_s,
                                waiting_for=lambda: [n for n, f in zip(names, futures) if not f.done()])
            wait_for_engines(futures, names, self.timeout_s, what=what)
        except BaseException:
            self.close()
            raise
        return [f.result() for f in futures]

    def abandon(self) -> None:
        """The push broke: nothing to let go of here (a broken broadcast closed the group already)."""

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            close_group(group, self.timeout_s)

    def shutdown(self) -> None:
        self.close()
        self._buffer = None


def _engine_names(names: list[str] | None, count: int) -> list[str]:
    if names is None:
        return [f"engine {i}" for i in range(count)]
    if len(names) != count:
        raise ValueError(f"{count} engines but {len(names)} names")
    return [str(n) for n in names]


def call_in_threads(calls: list[Callable[[Any], Any]], arguments: list[Any], name: str) -> list[Future]:
    """Run calls[i](arguments[i]) each on a new daemon thread; a future per call.

    Daemon threads: a call stuck on a dead engine never keeps the process from exiting.
    """
    futures: list[Future] = []
    for index, (call, argument) in enumerate(zip(calls, arguments)):
        future: Future = Future()
        future.set_running_or_notify_cancel()

        def run(call=call, argument=argument, future=future) -> None:
            try:
                future.set_result(call(argument))
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(error)

        threading.Thread(target=run, name=f"{name}-{index}", daemon=True).start()
        futures.append(future)
    return futures


def all_results(futures: list[Future]) -> list:
    """Every call's result in order, once every call has ended; the first call's error, in order, if any failed
    (no call is left running behind a raised error)."""
    error = next((e for e in (f.exception() for f in futures) if e is not None), None)
    if error is not None:
        raise error
    return [f.result() for f in futures]


def wait_for_engines(futures: list[Future], names: list[str], timeout_s: float, *, what: str) -> None:
    """Wait for every call; at the first failure raise BroadcastError naming its engine (not after the others
    time out); after timeout_s name the engines that have not answered."""
    done, pending = wait(futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for name, future in zip(names, futures):
        if future in done and future.exception() is not None:
            error = future.exception()
            if isinstance(error, WeightPushError):  # the push's fault, not the engine's: keep its type
                error.add_note(f"refused by {name}")
                raise error
            raise BroadcastError(f"{what}: {name} failed: {type(error).__name__}: {error}") from error
    if pending:
        slow = [name for name, future in zip(names, futures) if future in pending]
        raise BroadcastError(
            f"{what}: no answer after {timeout_s:.0f} s from {', '.join(slow)} "
            f"({len(slow)} of {len(futures)}); a slow engine needs a larger rollout.request_timeout_s"
        )


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind `device` ('' for the host): the same in every process, unlike the device index."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def check_not_same_gpu(trainer_gpu: str, device: torch.device) -> None:
    """NCCL cannot put two ranks of one group on one GPU: say so before the rendezvous hangs or fails obscurely."""
    if trainer_gpu and device.type == "cuda" and gpu_uuid(device) == trainer_gpu:
        raise BroadcastError(
            f"the engine worker on {device} shares its GPU ({trainer_gpu}) with the pushing trainer rank, and NCCL "
            "refuses two ranks of one group on one GPU: set rollout.weight_transport=rpc (tensors by reference to a "
            "colocated engine) or rollout.weight_broadcast_backend=gloo"
        )
