"""Colocated rollout engines: one vLLM server per group of the trainer's own GPUs.

A colocated engine (rollout.engine=vllm) shares the trainer's GPUs. On a
cluster of several nodes one engine on rank 0 would leave every other node's
GPUs idle during generation, so the trainer starts `colocated_engines(...)`
engines, one per rollout.tensor_parallel x pipeline_parallel GPUs (as
`megatron-rl plan` counts them), or rollout.engines when set:

- engine i is hosted by trainer rank i * (world / engines): that rank starts a
  vLLM server (VLLMServer, its own process group) on its node, on its own GPU
  and the next TP x PP - 1 GPUs of the node (CUDA_VISIBLE_DEVICES), and keeps
  it alive: a server that dies is restarted by its host (`ServerSupervisor`);
- the hosts exchange the servers' URLs (all_gather over the trainer's world),
  and rank 0 drives them all through one VLLMServerEngine: prompts go round-robin;
  with CUDA every push goes by memory handles (rollout.weight_transport=ipc, the
  default there): each bucket is copied from rank 0 to every rank whose GPU
  holds a worker (`IpcRelay`, over the trainer's own group) and each worker maps
  its own GPU's copy (with rollout.weight_senders=owners each bucket goes from
  the rank that owns it instead, `OwnerIpcRelay`: no rank carries the model);
  otherwise one broadcast into the workers of every engine.

One engine (the default on CPU, and on a single GPU group) keeps the
in-process VLLMEngine instead.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config.core import replace
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.config.placement import host_ranks, worker_ranks
from megatron_rl.rollout.engine import EngineStartError
from megatron_rl.rollout.server_auth import ServerTokenError, run_token
from megatron_rl.rollout.server_engine import VLLMServerEngine
from megatron_rl.rollout.server_supervisor import VLLMServer
from megatron_rl.weight_sync.broadcast import host_address
from megatron_rl.weight_sync.ipc import IpcRelay
from megatron_rl.weight_sync.owner_ipc import OwnerIpcRelay

logger = logging.getLogger(__name__)


def engine_devices(local_rank: int, size: int, visible: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for an engine of `size` GPUs hosted by `local_rank`: its GPU and the next ones of `visible`."""
    chosen = visible[local_rank : local_rank + size]
    if len(chosen) < size:
        raise EngineStartError(
            f"local rank {local_rank} cannot host an engine of {size} GPUs: this node shows {len(visible)} GPUs "
            f"({','.join(visible)}); lower rollout.tensor_parallel x pipeline_parallel or rollout.engines"
        )
    return ",".join(chosen)


def visible_devices() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES names them (all of the node's when it is unset)."""
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    return names.split(",") if names else [str(i) for i in range(torch.cuda.device_count())]


class ServerSupervisor:
    """Keeps a VLLMServer this rank hosts alive: a daemon thread restarts it when its process exits."""

    def __init__(self, server: VLLMServer, poll_s: float = 1.0):
        self.server = server
        self.restarts = 0
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._watch, name=f"vllm-server-{server.port}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            if self.server.alive():
                continue
            logger.warning("the vLLM server at %s exited; restarting it", self.server.url)
            try:
                self.server.restart()
                self.restarts += 1
            except EngineStartError as error:  # the trainer's engine gives up after rollout.max_restarts
                logger.error("restarting the vLLM server at %s failed: %s", self.server.url, error)

    def stop(self, *, stop_server: bool = True) -> None:
        """Stop watching (and the server, unless stop_server=False)."""
        self._stop.set()
        if stop_server:
            self.server.stop()  # a restart under way then fails fast instead of loading
        self._thread.join()
        if stop_server:
            self.server.stop()  # in case the restart had just started a process


@dataclass
class ColocatedServers:
    """What one trainer rank holds of the colocated engines."""

    urls: list[str]
    """Every engine's URL, in engine order (the same on every rank)."""
    server: VLLMServer | None
    """The server this rank hosts (None on ranks that host none)."""
    supervisor: ServerSupervisor | None
    """Its restarter, on host ranks other than 0 (rank 0's engine restarts rank 0's server itself)."""
    relay: IpcRelay | None = None
    """rollout.weight_transport=ipc: shares each pushed bucket on this rank's device with the worker there (None on
    ranks without one, and for other transports)."""
    owner_relay: OwnerIpcRelay | None = None
    """rollout.weight_transport=ipc with weight_senders=owners: this rank's part in pushes where every owner sends
    its own buckets to the workers' devices (weight_sync.owner_ipc; every rank has one)."""
    token: str | None = None
    """The servers' token (rollout.server_auth): rank 0's, the same on every rank."""

    def engine(self, rollout: RolloutConfig) -> VLLMServerEngine:
        """Rank 0's engine over every server (its own restarted by the engine, the others by their hosts)."""
        from megatron_rl.config.placement import resolve_placement

        # the transport and backend colocated servers get (config.placement: gloo, engine 0 shares rank 0's GPU)
        rollout = resolve_placement(replace(rollout, engines=len(self.urls))).rollout_config(rollout)
        return VLLMServerEngine([self.server, *self.urls[1:]], rollout, relay=self.relay, token=self.token)

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
        elif self.server is not None:
            self.server.stop()


def start_colocated_servers(
    model_dir: str, rollout: RolloutConfig, engines: int, *, rank: int, world_size: int, local_rank: int,
    group: Any = None, object_group: Any = None, seed: int = 0, log_dir: str | None = None,
) -> ColocatedServers:
    """Collective over the trainer's world: each host rank starts its server; every rank gets all URLs (and, with
    rollout.weight_transport=ipc, the relay of the ranks whose devices hold workers: `group` is the trainer's
    world, `object_group` a gloo group over it).

    The servers listen on 127.0.0.1 when every rank runs on one host, else on
    this host's address. A host whose server fails to start makes every rank
    raise EngineStartError naming that rank and the server's log tail.
    """
    hosts = host_ranks(engines, world_size)
    names: list[Any] = [None] * world_size
    dist.all_gather_object(names, socket.gethostname(), group=group)
    address = "127.0.0.1" if len(set(names)) == 1 else host_address()
    token = _shared_token(rollout, rank, group)
    server, outcome = None, ("none", "")
    if rank in hosts:
        engine_index = hosts.index(rank)
        log_path = os.path.join(log_dir, f"vllm-engine{engine_index}.log") if log_dir else None
        try:
            env = {}
            if torch.cuda.is_available():
                size = rollout.tensor_parallel * rollout.pipeline_parallel
                env["CUDA_VISIBLE_DEVICES"] = engine_devices(local_rank, size, visible_devices())
            on_host = sum(names[r] == names[rank] for r in hosts)  # their threads share this host's CPUs
            server = VLLMServer(model_dir, rollout, host=address, seed=seed + engine_index, log_path=log_path, env=env,
                                token=token, engines_on_host=on_host)
            server.start()
            outcome = ("ok", server.url)
        except (EngineStartError, OSError) as error:
            outcome = ("error", f"{type(error).__name__}: {error}")
    outcomes: list[Any] = [None] * world_size
    dist.all_gather_object(outcomes, outcome, group=group)
    failed = [(r, message) for r, (status, message) in enumerate(outcomes) if status == "error"]
    if failed:
        if server is not None:
            server.stop()
        r, message = failed[0]
        raise EngineStartError(f"rank {r} could not start its colocated vLLM engine ({len(failed)} of {engines} failed): {message}")
    urls = [outcomes[r][1] for r in hosts]
    supervisor = ServerSupervisor(server) if server is not None and rank != 0 else None
    relay, owner_relay = None, None
    if rollout.weight_transport == "ipc":
        workers = rollout.tensor_parallel * rollout.pipeline_parallel
        relay = ipc_relay(engines, workers, rank=rank, world_size=world_size, group=group, object_group=object_group)
        if rollout.weight_senders == "owners":
            owner_relay = OwnerIpcRelay(rank=rank, engine_ranks=worker_ranks(engines, workers, world_size), group=group,
                                        object_group=object_group, timeout_s=rollout.request_timeout_s)
    return ColocatedServers(urls=urls, server=server, supervisor=supervisor, relay=relay, owner_relay=owner_relay,
                            token=token)


def _shared_token(rollout: RolloutConfig, rank: int, group: Any) -> str:
    """Collective: rank 0's token for the run's servers (rollout.server_auth) on every rank, or its error."""
    shared: list[Any] = [None]
    if rank == 0:
        try:
            shared[0] = run_token(rollout.server_token_file)
        except ServerTokenError as error:
            shared[0] = error
    dist.broadcast_object_list(shared, src=0, group=group)
    if isinstance(shared[0], ServerTokenError):
        raise shared[0]
    return shared[0]


def ipc_relay(engines: int, workers: int, *, rank: int, world_size: int, group: Any = None,
              object_group: Any = None) -> IpcRelay | None:
    """Collective over the world: the relay of the ranks whose devices hold the engines' workers (None on the
    others). Its groups are the world's when every rank holds one, else new groups of those ranks."""
    engine_ranks = worker_ranks(engines, workers, world_size)
    ranks = sorted({r for ranks in engine_ranks for r in ranks})
    if len(ranks) < world_size:  # every rank takes part in making a group, members or not
        group, object_group = dist.new_group(ranks), dist.new_group(ranks, backend="gloo")
    if rank not in ranks:
        return None
    return IpcRelay(rank=rank, ranks=ranks, engine_ranks=engine_ranks, group=group, object_group=object_group)

