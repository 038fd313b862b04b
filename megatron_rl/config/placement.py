"""Where rollout engines run and how weights reach them: every placement rule, written once.

Dependency-free (config validation, the planner and the launch scripts use it
without torch); the engines read their decisions from it (rollout/).

Seven settings interact: rollout.engine, server_urls, engines,
multiprocessing, weight_transport, weight_broadcast_backend (and the
trainer's world size and cluster, which set the engine count). They resolve
to one of four placements:

| placement          | when                                        | weights by                    |
| ------------------ | ------------------------------------------- | ----------------------------- |
| in_process         | engine=vllm, one engine, multiprocessing off | tensors by reference (rpc)   |
| engine_process     | engine=vllm, one engine, multiprocessing on  | ipc handles with CUDA, else gloo broadcast (or rpc bytes) |
| colocated_servers  | engine=vllm, engines > 1 (servers on ranks)  | ipc handles from every rank with CUDA, else gloo broadcast (or rpc) |
| remote_servers     | engine=vllm_server, server_urls             | broadcast, nccl on GPU (or rpc) |

multiprocessing unset = on when the trainer has several ranks (an engine in
the trainer's process would start its process groups on the trainer's
world). A broadcast into an engine that shares a trainer GPU (an engine
process, colocated engine 0) uses gloo: NCCL refuses two ranks of one group
on one GPU; with CUDA colocated engines get memory handles instead (ipc:
weight_sync.ipc, CUDA IPC from the trainer's own GPUs: an engine process from
rank 0's, colocated servers each worker from the rank on its GPU; on the host,
shared memory when asked for). Every engine kind drives the same push
protocol (rollout.push).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config.core import ConfigError, replace
from megatron_rl.config.schema import ClusterConfig, RolloutConfig

PlacementKind = Literal["in_process", "engine_process", "colocated_servers", "remote_servers"]


@dataclass(frozen=True)
class Placement:
    """The resolved placement of a run's rollout engines (see the module docstring)."""

    kind: PlacementKind
    engines: int
    """How many engines (servers, or 1 for an in-process engine or its own process)."""
    transport: Literal["rpc", "broadcast", "ipc"]
    broadcast_backend: Literal["auto", "nccl", "gloo"]
    multiprocessing: bool | None
    """The in-process engine's core runs in its own process (engine_process); None for servers (not theirs to set)."""

    def rollout_config(self, rollout: RolloutConfig) -> RolloutConfig:
        """`rollout` with every decision written out, so the engine reads no 'auto' or unset value."""
        return replace(rollout, multiprocessing=self.multiprocessing, weight_transport=self.transport,
                       weight_broadcast_backend=self.broadcast_backend)


def resolve_placement(rollout: RolloutConfig, *, world_size: int = 1, cluster: ClusterConfig | None = None) -> Placement:
    """The placement `rollout` asks for on `world_size` trainer ranks; ConfigError names a setting that does not fit."""
    if rollout.engine == "vllm_server":
        if not rollout.server_urls:
            raise ConfigError(
                "rollout.engine=vllm_server needs rollout.server_urls=[http://host:port, ...] (servers started with "
                "`megatron-rl serve`), or a launch by launch/slurm.sbatch with cluster.rollout_gpus, which starts them"
            )
        return Placement("remote_servers", len(rollout.server_urls), server_transport(rollout),
                         rollout.weight_broadcast_backend, None)
    engines = _colocated_count(rollout, cluster, world_size)
    if engines > 1:
        # every worker is on a trainer rank's GPU: memory handles from that rank with CUDA; a broadcast must go
        # through host memory (engine 0's first worker shares rank 0's GPU, which NCCL refuses)
        transport = rollout.weight_transport
        if transport == "auto":
            transport = "ipc" if _cuda_available() else "broadcast"
        backend = "gloo" if rollout.weight_broadcast_backend == "auto" else rollout.weight_broadcast_backend
        return Placement("colocated_servers", engines, transport, backend, None)  # type: ignore[arg-type]
    multiprocessing = world_size > 1 if rollout.multiprocessing is None else bool(rollout.multiprocessing)
    transport = rollout.weight_transport
    if transport == "auto":  # an engine process shares the trainer's GPU: memory handles with CUDA, no host copy
        transport = ("ipc" if _cuda_available() else "broadcast") if multiprocessing else "rpc"
    check_transport_reaches_engine(transport, multiprocessing)
    backend = "gloo" if rollout.weight_broadcast_backend == "auto" else rollout.weight_broadcast_backend
    kind: PlacementKind = "engine_process" if multiprocessing else "in_process"
    return Placement(kind, 1, transport, backend, multiprocessing)  # type: ignore[arg-type]


def check_rollout_section(rollout: RolloutConfig) -> None:
    """The placement rules the rollout section decides by itself (RolloutConfig.validate runs them at load time;
    the rest needs the trainer's world size and cluster: resolve_placement)."""
    if rollout.engine == "vllm" and rollout.multiprocessing is not None:
        check_transport_reaches_engine(rollout.weight_transport, bool(rollout.multiprocessing))
    if rollout.engine == "vllm_server":
        server_transport(rollout)  # refuses ipc: memory handles reach engines on the trainer's own devices only


def check_transport_reaches_engine(transport: str, multiprocessing: bool) -> None:
    """A broadcast or memory handles need the engine in a process of its own: in the trainer's it gets tensors by
    reference."""
    if transport in ("broadcast", "ipc") and not multiprocessing:
        raise ConfigError(
            f"rollout.weight_transport={transport} needs the engine in another process, but rollout.multiprocessing="
            "false keeps it in the trainer's (where it gets tensors by reference): set rollout.multiprocessing=true "
            "or rollout.weight_transport=rpc"
        )


def server_transport(rollout: RolloutConfig) -> Literal["rpc", "broadcast"]:
    """Remote servers take weights by broadcast unless rollout.weight_transport=rpc."""
    if rollout.weight_transport == "ipc":
        raise ConfigError(
            "rollout.weight_transport=ipc hands memory handles to engines on the trainer's own devices (rollout.engine"
            "=vllm: an engine process, or colocated servers); remote servers take weights by broadcast or rpc: set "
            "rollout.weight_transport=auto"
        )
    return "rpc" if rollout.weight_transport == "rpc" else "broadcast"


def _cuda_available() -> bool:
    """Whether this process sees a CUDA device (torch imported only here: the rules above need no torch)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _colocated_count(rollout: RolloutConfig, cluster: ClusterConfig | None, world_size: int) -> int:
    if cluster is None:
        return rollout.engines or 1
    return colocated_engines(rollout, cluster, world_size)


def colocated_engines(rollout: RolloutConfig, cluster: ClusterConfig, world_size: int) -> int:
    """How many engines a colocated run (rollout.engine=vllm) on `world_size` trainer ranks starts.

    rollout.engines when set, else one per TP x PP GPUs of the trainer on a GPU
    cluster and one on CPU. An engine larger than a node (TP x PP above
    gpus_per_node) is rank 0's single engine, spread over nodes by vLLM's own
    multi-node executor. ConfigError names the value when the engines cannot be
    placed: each is hosted by one rank (engines divides the world) and, on GPU,
    takes that rank's GPU and the next TP x PP - 1 of its node.
    """
    size = rollout.tensor_parallel * rollout.pipeline_parallel
    gpu = cluster.gpus_per_node > 0
    if gpu and cluster.rollout_gpus:
        raise ConfigError(
            f"rollout.engine=vllm runs on the trainer's own GPUs, but cluster.rollout_gpus={cluster.rollout_gpus} sets "
            "GPUs aside for rollout: serve them with `megatron-rl serve` and set rollout.engine=vllm_server, or set "
            "cluster.rollout_gpus=0"
        )
    engines = rollout.engines or (max(1, world_size // size) if gpu and size <= cluster.gpus_per_node else 1)
    if engines < 1 or world_size % engines:
        raise ConfigError(
            f"rollout.engines={engines} does not divide the {world_size} trainer ranks: each colocated engine is "
            "hosted by one rank and uses the GPUs of the ranks after it; choose a divisor of the trainer's world size"
        )
    if gpu and engines > 1:
        if cluster.gpus_per_node % size:  # also when an engine is larger than a node
            raise ConfigError(
                f"rollout.engines={engines}: one engine's rollout.tensor_parallel x pipeline_parallel = {size} GPUs do "
                f"not divide the {cluster.gpus_per_node} GPUs of a node, and engines hosted by trainer ranks stay inside "
                "a node: choose TP x PP dividing gpus_per_node, or rollout.engines=1 (one engine over several nodes)"
            )
        if world_size // engines < size:
            raise ConfigError(
                f"rollout.engines={engines} engines of rollout.tensor_parallel x pipeline_parallel = {size} GPUs need "
                f"{engines * size} GPUs, more than the trainer's {world_size}: lower rollout.engines (0 = one per "
                f"{size} GPUs)"
            )
    return engines


def host_ranks(engines: int, world_size: int) -> list[int]:
    """The trainer ranks that host the engines: the first rank of each equal share of the world."""
    return [i * (world_size // engines) for i in range(engines)]


def worker_ranks(engines: int, workers: int, world_size: int) -> list[list[int]]:
    """Per engine, the trainer rank on whose device each of its `workers` runs: worker j of the engine hosted by
    rank h is on rank h + j's GPU (rollout.colocated.engine_devices; colocated_engines checks they fit). On the
    host, where every rank's memory is the one host's, more workers than ranks in a share wrap around."""
    share = world_size // engines
    return [[host + j % share for j in range(workers)] for host in host_ranks(engines, world_size)]
