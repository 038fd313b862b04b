"""Where the trainer's processes run: what the launch scripts ask of a preset.

Needs only the preset (no model): `megatron-rl plan --launch-env` prints it for
launch/torchrun.sh and launch/slurm.sbatch, which must start fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.core import ConfigError, load_config
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


def launch_env(config_path: str, overrides: list[str] | None = None) -> str:
    """Shell assignments for the launch scripts: trainer nodes and processes per node."""
    shape = launch_shape(load_config(RLConfig, config_path, overrides))
    return f"NNODES={shape.nodes}\nNPROC_PER_NODE={shape.procs_per_node}\n"
