"""vLLM's own weight-transfer engines as rollout.weight_transport: vllm_nccl_m2n and vllm_ipc.

vLLM 0.32's trainer-side API (vllm.distributed.weight_transfer): a
`TrainerWeightTransferEngine` made on every trainer rank by
`WeightTransferTrainerFactory.trainer_init(init_info, client=, source=)`,
`send_weights()` per push, `shutdown()`. Rank 0 drives the engines' control
plane through a `VLLMWeightSyncClient` (the servers' /init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update routes, which
VLLM_SERVER_DEV_MODE=1 opens; an in-process `vllm.LLM` has the same methods).
The engines must be started with the matching weight-transfer config
(`engine_args`, `server_args`).

vllm_nccl_m2n (remote servers): every trainer rank joins one NCCL communicator
with a server's workers and sends its own slice of every tensor (vLLM's
nccl_m2n engine reshards it into each worker's own shard). Our owner plan
makes each HF tensor on one rank (weight_sync.vllm_source); m2n needs one mesh
for the whole trainer side, so the owner scatters the tensor's rows over the
mesh's shard axis first: mesh (T / s, s) over the T trainer ranks, s = the
largest divisor of T up to 16 (m2n's fan-in limit into a replicated
destination, MAX_SOURCE_SHARDS), rank r holds row block r mod s. A tensor
whose first dimension s does not divide goes whole to every rank (REPLICATED).
Bytes out of a trainer rank: about model / s; with several servers each gets
its own communicator and the export runs once per server.

vllm_ipc (engines on the trainer's GPUs): vLLM's ipc engine hands each worker
a CUDA IPC handle of a full HF tensor on its own GPU, so every rank holds each
tensor for a moment (the owner broadcasts it), packed into buffers of
rollout.weight_bucket_mb.

Failures become our errors: a failed start is TransferStartError, a failed push
PushBrokenError, each naming the transport and the fallback (megatron_rl's own
transport). Neither transfer has run here (no GPU): the adapter is tested on
CPU up to the NCCL/CUDA calls (tests/unit/test_vllm_transfer.py), the transfer
in tests/gpu/test_vllm_transfer_gpu.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.config.placement import VLLM_ENGINE_OF
from megatron_rl.ports import free_port
from megatron_rl.weight_sync.stream import PushBrokenError
from megatron_rl.weight_sync.vllm_source import make_megatron_source

logger = logging.getLogger(__name__)


class TransferStartError(RuntimeError):
    """vLLM's weight-transfer engine did not start; the message names the transport and the fallback to set."""

MAX_SOURCE_SHARDS = 16
"""nccl_m2n's fan-in of source shards into one replicated destination (vllm m2n_common.MAX_SOURCE_SHARDS)."""
REPLICATE = -1
"""m2n's placement code of a replicating mesh axis (vllm m2n_common.REPLICATE)."""


# ---- what the engines need ---------------------------------------------------------------------
def engine_args(transport: str) -> dict[str, Any]:
    """Keyword arguments of vllm.LLM for `transport` (empty for our own transports)."""
    if transport not in VLLM_ENGINE_OF:
        return {}
    return {"weight_transfer_config": {"backend": VLLM_ENGINE_OF[transport]}}


def server_args(transport: str) -> list[str]:
    """Command-line arguments of a vLLM server for `transport` (empty for our own transports)."""
    if transport not in VLLM_ENGINE_OF:
        return []
    return ["--weight-transfer-config", json.dumps({"backend": VLLM_ENGINE_OF[transport]})]


def server_env(transport: str) -> dict[str, str]:
    """Environment of a vLLM server for `transport`: over HTTP vLLM's client pickles the IPC handles, which the
    server reads only with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (its workers are on the trainer's own GPUs)."""
    return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if transport == "vllm_ipc" else {}


def fallback_of(transport: str) -> str:
    """Our own transport to set when vLLM's engine fails."""
    return "broadcast" if transport == "vllm_nccl_m2n" else "ipc"


# ---- the trainer-side layout of nccl_m2n ---------------------------------------------------------
def m2n_slices(trainer_ranks: int) -> int:
    """s: the largest divisor of the trainer's world size up to MAX_SOURCE_SHARDS (see the module docstring)."""
    return max(d for d in range(1, min(trainer_ranks, MAX_SOURCE_SHARDS) + 1) if trainer_ranks % d == 0)


def m2n_mesh_dims(trainer_ranks: int) -> tuple[int, int]:
    """The trainer mesh: axis 0 replicates (T / s), axis 1 shards rows (s); rank r is at (r // s, r % s)."""
    slices = m2n_slices(trainer_ranks)
    return trainer_ranks // slices, slices


def m2n_placement(shape: tuple[int, ...], slices: int) -> tuple[int, int] | None:
    """Rows over the mesh's shard axis, or None (REPLICATED: every rank holds it whole) when s does not divide them."""
    if slices > 1 and shape and shape[0] % slices == 0:
        return REPLICATE, 0
    return None


def row_block(tensor: torch.Tensor, rank: int, slices: int) -> torch.Tensor:
    """The rows rank `rank` holds of `tensor` in the m2n layout (block rank mod s)."""
    return tensor.chunk(slices, dim=0)[rank % slices]


@dataclass
class _Spread:
    """Hands each HF tensor from its owner to every rank: whole (broadcast) or its row block (scatter). Collective
    over the default group (the trainer's world), in metadata order on every rank."""

    source: Any
    """weight_sync.vllm_source's MegatronSource."""
    rank: int
    world_size: int
    device: torch.device
    slices: int = 1
    """Row blocks per tensor (1: every rank gets tensors whole)."""
    sent: int = field(default=0, init=False)
    """Bytes this rank held as sender or receiver, summed over the pushes (for tests and logs)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from vllm.distributed.weight_transfer.base import layerwise_groups

        meta = {m.name: m for m in self.source.metadata()}
        for group in layerwise_groups(list(meta)):
            made = self.source.make_group(group)
            for name in group:
                yield name, self._local(name, meta[name], made.pop(name, None))

    def _local(self, name: str, meta: Any, full: torch.Tensor | None) -> torch.Tensor:
        owner = self.source.owner_of(name)
        shape = tuple(meta.shape)
        if self.world_size == 1:
            return full
        if m2n_placement(shape, self.slices) is None:
            out = full.contiguous() if self.rank == owner else torch.empty(shape, dtype=meta.dtype, device=self.device)
            dist.broadcast(out, src=owner)
            self.sent += out.numel() * out.element_size()
            return out
        block = (shape[0] // self.slices, *shape[1:])
        out = torch.empty(block, dtype=meta.dtype, device=self.device)
        pieces = [row_block(full, r, self.slices).contiguous() for r in range(self.world_size)] if self.rank == owner else None
        dist.scatter(out, pieces, src=owner)
        self.sent += out.numel() * out.element_size()
        return out


def make_m2n_source(model_chunks: list, ctx, *, wire_dtype: torch.dtype | None = None):
    """Our shards as vLLM's `M2NWeightSource`: each rank yields its row block of every HF tensor (module docstring)."""
    from vllm.distributed.weight_transfer.m2n_common import M2NMesh, M2NParamMeta
    from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource

    megatron = make_megatron_source(model_chunks, ctx, wire_dtype=wire_dtype)
    slices = m2n_slices(ctx.world_size)

    class MegatronM2NSource(M2NWeightSource):
        """Metadata of the whole model with each tensor's trainer placement; iteration spreads and yields row blocks."""

        def __init__(self) -> None:
            self.spread = _Spread(megatron, ctx.rank, ctx.world_size, ctx.device, slices)

        def mesh(self):
            return M2NMesh(m2n_mesh_dims(ctx.world_size), 0)

        def metadata(self):
            return [M2NParamMeta(m.name, m.dtype, tuple(m.shape), m2n_placement(tuple(m.shape), slices))
                    for m in megatron.metadata()]

        def __iter__(self):
            return iter(self.spread)

    return MegatronM2NSource()


def make_full_source(model_chunks: list, ctx, *, wire_dtype: torch.dtype | None = None):
    """Our shards as a vLLM `WeightSource` that yields every HF tensor whole on every rank (vLLM's ipc engine: each
    rank's GPU serves the workers on it)."""
    from vllm.distributed.weight_transfer.base import WeightSource

    megatron = make_megatron_source(model_chunks, ctx, wire_dtype=wire_dtype)

    class MegatronFullSource(WeightSource):
        def __init__(self) -> None:
            self.spread = _Spread(megatron, ctx.rank, ctx.world_size, ctx.device, 1)

        def metadata(self):
            return megatron.metadata()

        def __iter__(self):
            return iter(self.spread)

    return MegatronFullSource()


# ---- trainer init, push, shutdown ----------------------------------------------------------------
class FanOutClient:
    """One VLLMWeightSyncClient over several engines: each call goes to every one, in order."""

    def __init__(self, clients: list[Any]):
        self.clients = clients

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        for client in self.clients:
            client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        for client in self.clients:
            client.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        for client in self.clients:
            client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        for client in self.clients:
            client.finish_weight_update(weight_version)


class LLMClient:
    """An in-process `vllm.LLM` as a VLLMWeightSyncClient (its RL methods take the init and update infos wrapped)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


class NoClient:
    """The client of trainer ranks other than 0: vLLM's engines call the control plane on rank 0 only."""

    def _refuse(self, *args: Any) -> None:
        raise RuntimeError("only trainer rank 0 drives the engines' weight-transfer control plane")

    init_weight_transfer_engine = start_weight_update = update_weights = finish_weight_update = _refuse


def m2n_init_info(*, rank: int, trainer_ranks: int, workers: int, address: str, port: int, engine_pp: int = 1):
    """vLLM's M2NTrainerInitInfo for one engine of `workers` workers: trainer ranks [0, T), workers after them;
    the destination mesh shards over the workers when the engine has no pipeline stages (else vLLM's flat default)."""
    from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo

    return M2NTrainerInitInfo(rank=rank, master_address=address, master_port=port, world_size=trainer_ranks + workers,
                              num_trainer_ranks=trainer_ranks, dst_mesh_dims=(1, workers) if engine_pp == 1 else None)


def ipc_init_info(*, rank: int, bucket_bytes: int):
    """vLLM's IPCTrainerInitInfo: packed buffers of one bucket (memory bounded like our own pushes)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    return IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=int(bucket_bytes))


@dataclass
class VllmTransfer:
    """vLLM's trainer-side engines of one run (one per server for nccl_m2n, one for every engine for ipc)."""

    transport: str
    engines: list[Any]
    entries: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)
    """(HF name, full shape, wire dtype) of every tensor a push sends: what the engines' manifest is checked against
    (weight_sync.stream.check_announced) before the first push."""

    def send(self, version: int) -> None:
        """One push, on every trainer rank (a collective); PushBrokenError names the transport and the fallback."""
        try:
            for engine in self.engines:
                engine.send_weights()
        except Exception as error:  # noqa: BLE001 - vLLM's engines raise many types; all mean the push broke
            raise PushBrokenError(
                f"weight push v{version} by rollout.weight_transport={self.transport} (vLLM's "
                f"{VLLM_ENGINE_OF[self.transport]} engine) broke ({type(error).__name__}: {error}); the engines' weights "
                f"are pushed again; if it keeps failing set rollout.weight_transport={fallback_of(self.transport)} "
                "(megatron_rl's own transport)", [None] * len(self.engines)) from error

    def shutdown(self) -> None:
        for engine in self.engines:
            try:
                engine.shutdown()
            except Exception as error:  # noqa: BLE001 - shutting down: say it, go on
                logger.warning("%s: vLLM's engine did not shut down cleanly: %s", self.transport, error)


def start_transfer(transport: str, make_source: Callable[[], Any], init_infos: list[Any], clients: list[Any]) -> VllmTransfer:
    """vLLM's trainer engines on this rank (every rank calls it, with the same init infos but its own rank):
    one per (init info, client) pair. TransferStartError names the transport and the fallback."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    engines: list[Any] = []
    entries: list[tuple[str, tuple[int, ...], str]] = []
    try:
        for init_info, client in zip(init_infos, clients, strict=True):
            source = make_source()
            entries = entries or [(m.name, tuple(m.shape), str(m.dtype).removeprefix("torch.")) for m in source.metadata()]
            engines.append(WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source))
    except Exception as error:  # noqa: BLE001 - vLLM's rendezvous raises many types
        VllmTransfer(transport, engines).shutdown()
        raise TransferStartError(
            f"rollout.weight_transport={transport}: vLLM's {VLLM_ENGINE_OF[transport]} engine did not start "
            f"({type(error).__name__}: {error}); set rollout.weight_transport={fallback_of(transport)} "
            "(megatron_rl's own transport) or auto"
        ) from error
    logger.info("weight push by vLLM's %s engine (%d engine(s))", VLLM_ENGINE_OF[transport], len(engines))
    return VllmTransfer(transport, engines, entries)


def wire_dtype(engine_dtype: str, device: torch.device) -> torch.dtype | None:
    """The dtype tensors travel in: the engine's (rollout.dtype; auto = bf16 on GPUs), None = as exported (CPU)."""
    if engine_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return getattr(torch, engine_dtype)


def start_for_run(transport: str, rollout: Any, ctx, model_chunks: list, *, engines: int, clients: list[Any] | None,
                  share: Callable[[Any], Any], host: str) -> VllmTransfer:
    """vLLM's trainer engines for a run, on every trainer rank (a collective).

    rollout: the resolved RolloutConfig; engines: how many engines (servers) the run has; clients: rank 0's engine
    clients (WeightSyncedEngine.weight_sync_clients), None elsewhere; share(obj): rank 0's obj on every rank;
    host: where the engines' workers reach trainer rank 0 (nccl_m2n's rendezvous).
    """
    dtype = wire_dtype(rollout.dtype, ctx.device)
    bucket_bytes = int(rollout.weight_bucket_mb * (1 << 20))
    if transport == "vllm_ipc":  # one engine instance drives every engine: each worker takes its own GPU's handle
        client = FanOutClient(clients) if clients else NoClient()
        return start_transfer(transport, lambda: make_full_source(model_chunks, ctx, wire_dtype=dtype),
                              [ipc_init_info(rank=ctx.rank, bucket_bytes=bucket_bytes)], [client])
    # on this host's every address: trainer rank 0 hosts nccl_m2n's rendezvous there
    ports = share([free_port("") for _ in range(engines)] if ctx.rank == 0 else None)
    workers = rollout.tensor_parallel * rollout.pipeline_parallel
    infos = [m2n_init_info(rank=ctx.rank, trainer_ranks=ctx.world_size, workers=workers, address=host, port=port,
                           engine_pp=rollout.pipeline_parallel) for port in ports]
    return start_transfer(transport, lambda: make_m2n_source(model_chunks, ctx, wire_dtype=dtype), infos,
                          clients if clients else [NoClient()] * engines)
