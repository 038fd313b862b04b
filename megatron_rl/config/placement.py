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

On CUDA, with a vLLM build whose trainer-side weight-transfer engines are
registered (vllm.distributed.weight_transfer), auto prefers vLLM's own
engines (weight_sync.vllm_transfer): vllm_nccl_m2n for remote servers (every
trainer rank sends its own slice over NCCL; needs NCCL and the nccl.m2n
runtime), vllm_ipc for engines on the trainer's GPUs (an engine process or
colocated servers). `choose_transport` makes that choice from the platform
facts (config.transport.TransportFacts, detected there) and says why.

multiprocessing unset = on when the trainer has several ranks (an engine in
the trainer's process would start its process groups on the trainer's
world). A broadcast into an engine that shares a trainer GPU (an engine
process, colocated engine 0) uses gloo: NCCL refuses two ranks of one group
on one GPU; with CUDA colocated engines get memory handles instead (ipc:
weight_sync.ipc, CUDA IPC from the trainer's own GPUs: an engine process from
rank 0's, colocated servers each worker from the rank on its GPU; on the host,
shared memory when asked for). Every engine kind drives the same push
protocol (weight_sync.push).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config.core import ConfigError, replace
from megatron_rl.config.schema import ClusterConfig, RolloutConfig
from megatron_rl.config.transport import (
    VLLM_ENGINE_OF,
    Transport,
    TransportFacts,
    check_transport_reaches_engine,
    server_transport,
    transport_facts,
)

PlacementKind = Literal["in_process", "engine_process", "colocated_servers", "remote_servers"]
@dataclass(frozen=True)
class TransportChoice:
    """The transport a placement uses and why (the start-up line)."""

    transport: Transport
    reason: str


@dataclass(frozen=True)
class Placement:
    """The resolved placement of a run's rollout engines (see the module docstring)."""

    kind: PlacementKind
    engines: int
    """How many engines (servers, or 1 for an in-process engine or its own process)."""
    transport: Transport
    broadcast_backend: Literal["auto", "nccl", "gloo"]
    multiprocessing: bool | None
    """The in-process engine's core runs in its own process (engine_process); None for servers (not theirs to set)."""
    reason: str = ""
    """Why this transport (rollout.weight_transport=auto: what the platform offered), for the start-up log line."""

    def rollout_config(self, rollout: RolloutConfig) -> RolloutConfig:
        """`rollout` with every decision written out, so the engine reads no 'auto' or unset value."""
        return replace(rollout, multiprocessing=self.multiprocessing, weight_transport=self.transport,
                       weight_broadcast_backend=self.broadcast_backend)


def resolve_placement(rollout: RolloutConfig, *, world_size: int = 1, cluster: ClusterConfig | None = None,
                      facts: TransportFacts | None = None) -> Placement:
    """The placement `rollout` asks for on `world_size` trainer ranks; ConfigError names a setting that does not fit.
    facts: the platform (None: this process's, config.transport.transport_facts)."""
    facts = facts if facts is not None else _platform_facts()
    if rollout.engine == "vllm_server":
        if not rollout.server_urls:
            raise ConfigError(
                "rollout.engine=vllm_server needs rollout.server_urls=[http://host:port, ...] (servers started with "
                "`megatron-rl serve`), or a launch by launch/slurm.sbatch with cluster.rollout_gpus, which starts them"
            )
        choice = choose_transport(rollout, "remote_servers", facts)
        return Placement("remote_servers", len(rollout.server_urls), choice.transport,
                         rollout.weight_broadcast_backend, None, choice.reason)
    engines = _colocated_count(rollout, cluster, world_size)
    every_rank_hosts = engines * rollout.tensor_parallel * rollout.pipeline_parallel >= world_size
    if engines > 1:
        # every worker is on a trainer rank's GPU: memory handles from that rank with CUDA; a broadcast must go
        # through host memory (engine 0's first worker shares rank 0's GPU, which NCCL refuses)
        choice = choose_transport(rollout, "colocated_servers", facts, every_rank_hosts=every_rank_hosts)
        backend = "gloo" if rollout.weight_broadcast_backend == "auto" else rollout.weight_broadcast_backend
        return Placement("colocated_servers", engines, choice.transport, backend, None, choice.reason)
    multiprocessing = world_size > 1 if rollout.multiprocessing is None else bool(rollout.multiprocessing)
    kind: PlacementKind = "engine_process" if multiprocessing else "in_process"
    choice = choose_transport(rollout, kind, facts, every_rank_hosts=every_rank_hosts)
    check_transport_reaches_engine(choice.transport, multiprocessing)
    backend = "gloo" if rollout.weight_broadcast_backend == "auto" else rollout.weight_broadcast_backend
    return Placement(kind, 1, choice.transport, backend, multiprocessing, choice.reason)


def choose_transport(rollout: RolloutConfig, kind: PlacementKind, facts: TransportFacts, *,
                     every_rank_hosts: bool = True) -> TransportChoice:
    """rollout.weight_transport for engines placed as `kind` on a platform with `facts` (a pure function).

    auto: remote servers -> vllm_nccl_m2n when CUDA, NCCL, vLLM's nccl_m2n engine and its runtime are all there,
    else broadcast; engines on the trainer's GPUs (an engine process, colocated servers) -> vllm_ipc with CUDA and
    vLLM's ipc engine where every trainer rank's GPU hosts an engine worker (`every_rank_hosts`: vLLM's ipc engine
    hands every tensor whole to every rank of the world), else ipc with CUDA (its relay runs in the hosting ranks'
    group), else broadcast; an engine in the trainer's process -> rpc. An explicit vllm_* value that cannot work
    here is a ConfigError naming what is missing and the value to set instead.
    """
    asked = rollout.weight_transport
    if asked in VLLM_ENGINE_OF:
        _check_vllm_transport(asked, kind, facts)
        if asked == "vllm_ipc" and not every_rank_hosts:
            raise ConfigError(
                "rollout.weight_transport=vllm_ipc with engines on only some trainer GPUs (rollout.engines x TP "
                f"{rollout.tensor_parallel} x PP {rollout.pipeline_parallel} < the world): vLLM's ipc engine hands every tensor "
                "whole to every trainer rank, the whole model into each GPU that hosts no worker; set "
                "rollout.weight_transport=ipc (or auto), whose relay runs among the hosting ranks"
            )
        return TransportChoice(asked, f"rollout.weight_transport={asked} (vLLM's {VLLM_ENGINE_OF[asked]} engine)")
    if kind == "remote_servers":
        transport = server_transport(rollout.weight_transport)
        if asked != "auto":
            return TransportChoice(transport, f"rollout.weight_transport={asked}")
        missing = facts.missing_for("vllm_nccl_m2n")
        if not missing:
            return TransportChoice("vllm_nccl_m2n", "auto: CUDA, NCCL and vLLM's nccl_m2n engine are available "
                                                    "(every trainer rank sends its own slice)")
        return TransportChoice(transport, f"auto: broadcast, not vllm_nccl_m2n ({'; '.join(missing)})")
    if asked != "auto":
        return TransportChoice(asked, f"rollout.weight_transport={asked}")  # type: ignore[arg-type]
    if kind == "in_process":
        return TransportChoice("rpc", "auto: the engine is in the trainer's process (tensors by reference)")
    missing = facts.missing_for("vllm_ipc")
    if not missing and not every_rank_hosts:
        return TransportChoice("ipc", "auto: megatron_rl's ipc, not vllm_ipc (the engines' workers are on only some "
                                      "trainer GPUs: vLLM's ipc engine would hand every tensor to every rank)")
    if not missing:
        return TransportChoice("vllm_ipc", "auto: CUDA and vLLM's ipc engine are available (engines on the trainer's GPUs)")
    if facts.cuda:
        return TransportChoice("ipc", f"auto: megatron_rl's ipc, not vllm_ipc ({'; '.join(missing)})")
    return TransportChoice("broadcast", "auto: broadcast over gloo (no CUDA: no memory handles, no vLLM engines)")


def _check_vllm_transport(transport: str, kind: PlacementKind, facts: TransportFacts) -> None:
    """ConfigError unless vLLM's engine behind `transport` can serve engines placed as `kind` on this platform."""
    if transport == "vllm_nccl_m2n" and kind != "remote_servers":
        raise ConfigError(
            f"rollout.weight_transport=vllm_nccl_m2n sends over NCCL to servers on GPUs of their own, but these engines "
            f"({kind}) share the trainer's GPUs (NCCL refuses two ranks on one GPU): set rollout.weight_transport="
            "vllm_ipc or auto"
        )
    if transport == "vllm_ipc" and kind not in ("engine_process", "colocated_servers"):
        raise ConfigError(
            f"rollout.weight_transport=vllm_ipc hands memory handles to engines on the trainer's own GPUs (an engine "
            f"process or colocated servers), not to {kind.replace('_', ' ')}: set rollout.weight_transport="
            + ("vllm_nccl_m2n or auto" if kind == "remote_servers" else "rpc or auto")
        )
    missing = facts.missing_for(transport)
    if missing:
        fallback = "broadcast" if transport == "vllm_nccl_m2n" else ("ipc" if facts.cuda else "broadcast")
        raise ConfigError(
            f"rollout.weight_transport={transport} cannot run here: {'; '.join(missing)}. Set rollout.weight_transport="
            f"{fallback} (megatron_rl's own transport) or auto (picks what the platform offers)"
        )


def _platform_facts() -> TransportFacts:
    """This process's TransportFacts (config.transport.transport_facts; tests replace this to fake a platform)."""
    return transport_facts()


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
