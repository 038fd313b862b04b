"""Where rollout engines run and how weights reach them: decided in one place.

Seven settings interact: rollout.engine, server_urls, engines,
multiprocessing, weight_transport, weight_broadcast_backend (and the
trainer's world size and cluster, which set the engine count). They resolve
to one of four placements:

| placement          | when                                        | weights by                    |
| ------------------ | ------------------------------------------- | ----------------------------- |
| in_process         | engine=vllm, one engine, multiprocessing off | tensors by reference (rpc)   |
| engine_process     | engine=vllm, one engine, multiprocessing on  | gloo broadcast (or rpc bytes) |
| colocated_servers  | engine=vllm, engines > 1 (servers on ranks)  | gloo broadcast (or rpc)       |
| remote_servers     | engine=vllm_server, server_urls             | broadcast, nccl on GPU (or rpc) |

multiprocessing unset = on when the trainer has several ranks (an engine in
the trainer's process would start its process groups on the trainer's
world). A broadcast into an engine that shares a trainer GPU (an engine
process, colocated engine 0) uses gloo: NCCL refuses two ranks of one group
on one GPU. Every engine kind drives the same push protocol (rollout.push).
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
    transport: Literal["rpc", "broadcast"]
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
        # engine 0's first worker shares rank 0's GPU, which NCCL refuses: go through host memory
        backend = "gloo" if rollout.weight_broadcast_backend == "auto" else rollout.weight_broadcast_backend
        return Placement("colocated_servers", engines, server_transport(rollout), backend, None)
    multiprocessing = world_size > 1 if rollout.multiprocessing is None else bool(rollout.multiprocessing)
    transport = rollout.weight_transport
    if transport == "auto":
        transport = "broadcast" if multiprocessing else "rpc"
    if transport == "broadcast" and not multiprocessing:
        raise ConfigError(
            "rollout.weight_transport=broadcast needs the engine in another process, but rollout.multiprocessing="
            "false keeps it in the trainer's (where it gets tensors by reference): set rollout.multiprocessing=true "
            "or rollout.weight_transport=rpc"
        )
    backend = "gloo" if rollout.weight_broadcast_backend == "auto" else rollout.weight_broadcast_backend
    kind: PlacementKind = "engine_process" if multiprocessing else "in_process"
    return Placement(kind, 1, transport, backend, multiprocessing)  # type: ignore[arg-type]


def server_transport(rollout: RolloutConfig) -> Literal["rpc", "broadcast"]:
    """Servers (colocated or remote) take weights by broadcast unless rollout.weight_transport=rpc."""
    return "rpc" if rollout.weight_transport == "rpc" else "broadcast"


def _colocated_count(rollout: RolloutConfig, cluster: ClusterConfig | None, world_size: int) -> int:
    if cluster is None:
        return rollout.engines or 1
    from megatron_rl.plan.launch import colocated_engines

    return colocated_engines(rollout, cluster, world_size)
