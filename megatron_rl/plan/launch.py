"""Where the trainer's processes and its colocated rollout engines run: what the launch scripts ask of a preset.

Needs only the preset (no model): `megatron-rl plan --launch-env` prints it for
launch/torchrun.sh and launch/slurm.sbatch, which must start fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.core import ConfigError, load_config
from megatron_rl.config.placement import colocated_engines, host_ranks  # noqa: F401  (placement's home; the planner's names)
from megatron_rl.config.schema import RLConfig


@dataclass(kw_only=True, frozen=True)
class LaunchShape:
    """How many trainer processes run where (what torchrun is given)."""

    nodes: int
    """Nodes running trainer processes."""
    procs_per_node: int
    """Trainer processes on each of them."""

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node


def launch_shape(cfg: RLConfig) -> LaunchShape:
    """Trainer nodes and processes per node; ConfigError when rollout GPUs break a uniform layout."""
    c = cfg.cluster
    if c.nodes < 1:
        raise ConfigError(f"cluster.nodes={c.nodes}: must be >= 1")
    if c.gpus_per_node < 0:
        raise ConfigError(f"cluster.gpus_per_node={c.gpus_per_node}: must be >= 0 (0 = CPU run)")
    if c.gpus_per_node == 0:
        if c.rollout_gpus:
            raise ConfigError(f"cluster.rollout_gpus={c.rollout_gpus} on a CPU cluster (gpus_per_node=0): set it to 0")
        if c.nodes != 1:
            raise ConfigError(f"cluster.nodes={c.nodes} with gpus_per_node=0: CPU runs use one node")
        if c.cpu_processes < 1:
            raise ConfigError(f"cluster.cpu_processes={c.cpu_processes}: must be >= 1")
        return LaunchShape(nodes=1, procs_per_node=c.cpu_processes)
    total = c.nodes * c.gpus_per_node
    if not 0 <= c.rollout_gpus < total:
        raise ConfigError(
            f"cluster.rollout_gpus={c.rollout_gpus} of {c.nodes} x {c.gpus_per_node} = {total} GPUs: "
            f"keep it between 0 (engine colocated with the trainer) and {total - 1}"
        )
    if c.nodes == 1:
        return LaunchShape(nodes=1, procs_per_node=c.gpus_per_node - c.rollout_gpus)
    if c.rollout_gpus % c.gpus_per_node:
        raise ConfigError(
            f"cluster.rollout_gpus={c.rollout_gpus} is not a whole number of {c.gpus_per_node}-GPU nodes: on "
            "several nodes the engine gets whole nodes, so that every trainer node runs the same number of "
            f"processes (torchrun needs that); use a multiple of {c.gpus_per_node}"
        )
    return LaunchShape(nodes=c.nodes - c.rollout_gpus // c.gpus_per_node, procs_per_node=c.gpus_per_node)


@dataclass(kw_only=True, frozen=True)
class RolloutServers:
    """The vLLM servers launch/slurm.sbatch starts on the nodes cluster.rollout_gpus sets aside."""

    nodes: int
    """Rollout nodes (after the trainer's in the allocation); 0 = the script starts no servers."""
    per_node: int
    """Servers on each rollout node."""
    gpus_each: int
    """GPUs of one server (rollout.tensor_parallel x pipeline_parallel), the node's next ones."""


def rollout_servers(cfg: RLConfig) -> RolloutServers:
    """Servers to start: with rollout.engine=vllm_server, GPUs set aside on whole nodes and no server_urls given."""
    c, r = cfg.cluster, cfg.rollout
    if r.engine != "vllm_server" or r.server_urls or c.gpus_per_node == 0 or c.rollout_gpus == 0:
        return RolloutServers(nodes=0, per_node=0, gpus_each=0)
    launch_shape(cfg)  # whole rollout nodes
    if c.nodes == 1:
        raise ConfigError(
            f"cluster.rollout_gpus={c.rollout_gpus} on one node: launch/slurm.sbatch starts servers on whole nodes; "
            "start them on this node with `megatron-rl serve` (CUDA_VISIBLE_DEVICES) and give rollout.server_urls"
        )
    size = r.tensor_parallel * r.pipeline_parallel
    if c.gpus_per_node % size:  # also when a server is larger than a node
        raise ConfigError(
            f"one server's rollout.tensor_parallel x pipeline_parallel = {size} GPUs do not divide the "
            f"{c.gpus_per_node} GPUs of a node: the launch script starts servers inside a node; start servers "
            "spanning nodes yourself (vLLM's --nnodes) and give rollout.server_urls"
        )
    return RolloutServers(nodes=c.rollout_gpus // c.gpus_per_node, per_node=c.gpus_per_node // size, gpus_each=size)


def server_urls_override(cfg: RLConfig, hosts: list[str], port: int) -> str:
    """The trainer's override naming the servers the launch script starts on `hosts` (ports port, port + 1, ...)."""
    servers = rollout_servers(cfg)
    if len(hosts) != servers.nodes:
        raise ConfigError(f"{len(hosts)} rollout host(s) given ({','.join(hosts)}) for {servers.nodes} rollout node(s)")
    urls = [f"http://{host}:{port + j}" for host in hosts for j in range(servers.per_node)]
    return f"rollout.server_urls=[{', '.join(urls)}]"


def launch_env(config_path: str, overrides: list[str] | None = None) -> str:
    """Shell assignments for the launch scripts: trainer nodes and processes per node, rollout servers, torchrun's
    restarts and the run directory (where torchrun's own log goes)."""
    cfg = load_config(RLConfig, config_path, overrides)
    shape, servers = launch_shape(cfg), rollout_servers(cfg)
    return (
        f"NNODES={shape.nodes}\nNPROC_PER_NODE={shape.procs_per_node}\n"
        f"ROLLOUT_NODES={servers.nodes}\nSERVERS_PER_NODE={servers.per_node}\nGPUS_PER_SERVER={servers.gpus_each}\n"
        f"MAX_RESTARTS={cfg.cluster.max_restarts}\nLOG_DIR={cfg.logging.dir}\n"
    )
