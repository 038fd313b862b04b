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
2. it sends that JSON to every engine by RPC (`mrl_broadcast_receive`, in a
   thread per engine: the workers block in the broadcast until rank 0 joins);
3. it broadcasts the buffer from rank 0; each worker unpacks views of its
   copy and stages them exactly like a bucket that came by RPC (manifest
   check, kept until the push commits).

The whole push is checked against the engine's manifest on the trainer before
the first bucket goes out (weight_sync.push.collect_push), so a refused push
never reaches the workers. A failure during a broadcast (a worker died, an RPC
failed) leaves the group unusable: it is closed and the error is the engine's
(the engine restarts and the group is formed again).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any, Callable

import torch

from megatron_rl.weight_sync.buckets import Bucket, tensor_bytes

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
        if nbytes:
            source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            flat[entry["offset"] : entry["offset"] + nbytes].copy_(source)
    return flat


def unpack_bucket(layout: dict, flat: torch.Tensor) -> Bucket:
    """Views of `flat` (named, typed and shaped as `layout` says): the inverse of pack_bucket."""
    if flat.dtype != torch.uint8 or flat.numel() != int(layout["nbytes"]):
        raise BroadcastError(
            f"packed bucket holds {flat.numel()} {flat.dtype} elements; its layout says {layout['nbytes']} bytes"
        )
    bucket: Bucket = []
    for entry in layout["tensors"]:
        dtype = getattr(torch, entry["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise BroadcastError(f"tensor {entry['name']!r}: unknown dtype {entry['dtype']!r} in a packed bucket")
        shape = [int(d) for d in entry["shape"]]
        numel = 1
        for d in shape:
            numel *= d
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
                        timeout_s: float = 600.0) -> None:
    """Broadcast `tensor` from group rank 0 in place on every rank.

    abort_if: polled while the broadcast runs; an exception it returns (e.g. a
    receiving RPC failed before its worker joined the broadcast) is raised
    instead of waiting for peers that will never arrive.
    """
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    work = group.broadcast([tensor], options)
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        failure = abort_if() if abort_if is not None else None
        if failure is not None:
            raise BroadcastError(f"weight broadcast abandoned: a receiving engine failed: {failure}") from failure
        if time.monotonic() > deadline:
            raise BroadcastError(f"weight broadcast of {tensor.numel()} bytes did not finish in {timeout_s:.0f} s")
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
    bucket's broadcast and stages it.
    """

    def __init__(self, backend: str = "auto", host: str = "127.0.0.1", timeout_s: float = 600.0):
        self.backend = resolve_backend(backend)
        self.host = host
        self.timeout_s = float(timeout_s)
        self.group: Any = None
        self.device = backend_device(self.backend)
        self._buffer: torch.Tensor | None = None  # the packing buffer, reused by every send (grows to the largest bucket)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="weight-broadcast")

    @property
    def connected(self) -> bool:
        return self.group is not None

    def connect(self, joins: list[Callable[[str], Any]], workers_per_engine: list[int]) -> None:
        """Form the group: rank 0 here, then each engine's workers at consecutive ranks."""
        self.close()
        world_size = 1 + sum(workers_per_engine)
        listener = listening_socket(self.host)
        port = int(listener.getsockname()[1])
        futures: list[Future] = []
        rank_offset = 1
        for join, workers in zip(joins, workers_per_engine):
            info = {"host": self.host, "port": port, "rank_offset": rank_offset, "world_size": world_size,
                    "backend": self.backend, "timeout_s": self.timeout_s, "trainer_gpu": _gpu_uuid(self.device)}
            futures.append(self._pool.submit(join, json.dumps(info)))
            rank_offset += workers
        try:
            # The workers block in the rendezvous until this rank joins: wait on both at once, and
            # give up as soon as a worker's join call fails (it will never reach the rendezvous).
            group_future = self._pool.submit(
                open_group, self.host, port, 0, world_size, self.backend, self.timeout_s, listener
            )
            _wait_all([group_future, *futures], self.timeout_s, what=f"forming the weight-broadcast group ({world_size} ranks)")
            self.group = group_future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise

    def send(self, bucket: Bucket, receives: list[Callable[[str], Any]]) -> list[Any]:
        """Broadcast one bucket to every engine; returns each engine's answer to its receive call."""
        if self.group is None:
            raise BroadcastError("the weight-broadcast group is not formed (connect first)")
        layout = describe_bucket(bucket)
        if self._buffer is None or self._buffer.numel() < layout["nbytes"]:
            self._buffer = None  # free the old one first
            self._buffer = torch.empty(int(layout["nbytes"]), dtype=torch.uint8, device=self.device)
        flat = pack_bucket(bucket, layout, self.device, out=self._buffer)
        message = json.dumps(layout)
        futures = [self._pool.submit(receive, message) for receive in receives]

        def failed_receive() -> BaseException | None:
            for future in futures:
                if future.done() and future.exception() is not None:
                    return future.exception()
            return None

        try:
            broadcast_from_root(self.group, flat, abort_if=failed_receive, timeout_s=self.timeout_s)
            _wait_all(futures, self.timeout_s, what="engines staging a broadcast bucket")
        except BaseException:
            self.close()
            raise
        return [f.result() for f in futures]

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            close_group(group, self.timeout_s)

    def shutdown(self) -> None:
        self.close()
        self._buffer = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def _wait_all(futures: list[Future], timeout_s: float, *, what: str) -> None:
    """Wait for every future; raise the first failure at once (not after the others time out)."""
    done, pending = wait(futures, timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for future in done:
        if future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
    if pending:
        raise BroadcastError(f"{what}: no answer after {timeout_s:.0f} s")


def _gpu_uuid(device: torch.device) -> str:
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def check_not_same_gpu(trainer_gpu: str, device: torch.device) -> None:
    """NCCL cannot put two ranks of one group on one GPU: say so before the rendezvous hangs or fails obscurely."""
    if trainer_gpu and device.type == "cuda" and _gpu_uuid(device) == trainer_gpu:
        raise BroadcastError(
            f"the engine worker on {device} shares its GPU ({trainer_gpu}) with the pushing trainer rank, and NCCL "
            "refuses two ranks of one group on one GPU: set rollout.weight_transport=rpc (tensors by reference to a "
            "colocated engine) or rollout.weight_broadcast_backend=gloo"
        )
