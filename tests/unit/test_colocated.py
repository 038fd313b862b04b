"""Colocated engines: how many, which ranks host them, which GPUs they get, and a failed start on every rank.

The engines themselves (real vLLM servers hosted by trainer ranks) run in
tests/e2e/test_train_parallel.py (its colocated cases) and tests/e2e/test_vllm_server.py.
"""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.config.schema import ClusterConfig, RolloutConfig
from megatron_rl.plan.launch import colocated_engines, host_ranks
from megatron_rl.rollout import EngineStartError
from megatron_rl.rollout.colocated import engine_devices
from tests.distributed.harness import run_distributed

GPU_NODES = ClusterConfig(nodes=4, gpus_per_node=8)
CPU = ClusterConfig(cpu_processes=2)


@pytest.mark.parametrize(
    "rollout, cluster, world, engines",
    [
        (RolloutConfig(tensor_parallel=4), GPU_NODES, 32, 8),  # one per 4 GPUs
        (RolloutConfig(tensor_parallel=8), GPU_NODES, 32, 4),  # one per node
        (RolloutConfig(tensor_parallel=2, pipeline_parallel=2), GPU_NODES, 32, 8),
        (RolloutConfig(tensor_parallel=4, engines=2), GPU_NODES, 32, 2),  # fewer than the GPUs allow
        (RolloutConfig(tensor_parallel=8, pipeline_parallel=2), GPU_NODES, 32, 1),  # spans nodes: rank 0's only
        (RolloutConfig(), CPU, 2, 1),  # CPU: one unless asked
        (RolloutConfig(engines=2), CPU, 2, 2),
    ],
)
def test_engine_count(rollout, cluster, world, engines):
    assert colocated_engines(rollout, cluster, world) == engines


@pytest.mark.parametrize(
    "rollout, cluster, world, message",
    [
        (RolloutConfig(engines=3), GPU_NODES, 32, r"rollout.engines=3 does not divide the 32 trainer ranks"),
        (RolloutConfig(tensor_parallel=4, engines=16), GPU_NODES, 32, r"need 64 GPUs, more than the trainer's 32"),
        (RolloutConfig(tensor_parallel=3, engines=2), ClusterConfig(nodes=1, gpus_per_node=8), 8, r"= 3 GPUs do not divide the 8"),
        (RolloutConfig(tensor_parallel=8, pipeline_parallel=2, engines=2), GPU_NODES, 32, r"rollout.engines=1 \(one engine over"),
        (RolloutConfig(), ClusterConfig(nodes=2, gpus_per_node=8, rollout_gpus=8), 8, r"cluster.rollout_gpus=8 sets GPUs aside"),
        (RolloutConfig(engines=4), CPU, 2, r"rollout.engines=4 does not divide the 2"),
    ],
)
def test_impossible_engine_placements_are_named(rollout, cluster, world, message):
    with pytest.raises(ConfigError, match=message):
        colocated_engines(rollout, cluster, world)


def test_negative_engine_count_is_a_config_error():
    with pytest.raises(ConfigError, match=r"rollout.engines=-1: must be >= 0"):
        RolloutConfig(engines=-1).validate()


def test_hosts_and_their_gpus():
    assert host_ranks(8, 32) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert host_ranks(2, 2) == [0, 1]
    assert host_ranks(1, 16) == [0]
    # local rank 4 of a node hosts a TP 4 engine on the node's GPUs 4-7, as CUDA_VISIBLE_DEVICES names them
    assert engine_devices(4, 4, [str(i) for i in range(8)]) == "4,5,6,7"
    assert engine_devices(4, 4, ["3", "2", "1", "0", "7", "6", "5", "4"]) == "7,6,5,4"
    with pytest.raises(EngineStartError, match=r"local rank 6 cannot host an engine of 4 GPUs: this node shows 8"):
        engine_devices(6, 4, [str(i) for i in range(8)])


def _start_in_missing_dir(rank: int, world_size: int, model_dir: str) -> str:
    import torch.distributed as dist

    from megatron_rl.rollout.colocated import start_colocated_servers

    dist.init_process_group("gloo")
    try:
        start_colocated_servers(model_dir, RolloutConfig(engines=2), 2, rank=rank, world_size=world_size, local_rank=rank)
    except EngineStartError as error:
        return str(error)
    finally:
        dist.destroy_process_group()
    return "started"


def test_a_failed_start_is_an_error_on_every_rank(tmp_path):
    # Both hosts fail (no config.json); every rank learns it from the all-gather instead of waiting
    # in the next collective, and the message names the rank, the count and the cause.
    messages = run_distributed(_start_in_missing_dir, 2, str(tmp_path / "no-model"), timeout=60)
    for message in messages:
        assert "rank 0 could not start its colocated vLLM engine (2 of 2 failed)" in message
        assert "no-model: not an HF model directory (no config.json)" in message
