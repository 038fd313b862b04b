"""The four engine placements a rollout config resolves to, and the settings that do not fit, by hand."""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError, RolloutConfig, placement
from megatron_rl.config.schema import ClusterConfig
from megatron_rl.rollout import make_engine, resolve_placement


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
def test_each_placement_and_its_transport(cuda, monkeypatch):
    """Both platforms on any machine: whether CUDA is present is faked (it decides auto's transport)."""
    monkeypatch.setattr(placement, "_platform_facts", lambda: placement.TransportFacts(cuda=cuda))  # no vLLM engines
    shared = "ipc" if cuda else "broadcast"  # an engine on the trainer's GPU takes memory handles; on CPU a broadcast
    single = resolve_placement(RolloutConfig())
    assert (single.kind, single.engines, single.transport, single.multiprocessing) == ("in_process", 1, "rpc", False)
    ranks = resolve_placement(RolloutConfig(), world_size=2)  # unset multiprocessing: own process with 2 ranks
    assert (ranks.kind, ranks.transport, ranks.broadcast_backend) == ("engine_process", shared, "gloo")
    by_bytes = resolve_placement(RolloutConfig(multiprocessing=True, weight_transport="rpc"))
    assert (by_bytes.kind, by_bytes.transport) == ("engine_process", "rpc")
    colocated = resolve_placement(RolloutConfig(engines=4), world_size=8)
    assert (colocated.kind, colocated.engines, colocated.transport, colocated.broadcast_backend) == (
        "colocated_servers", 4, shared, "gloo")  # engine 0 shares rank 0's GPU: never nccl by default
    remote = resolve_placement(RolloutConfig(engine="vllm_server", server_urls=["http://a:1", "http://b:1"]))
    assert (remote.kind, remote.engines, remote.transport, remote.broadcast_backend) == (
        "remote_servers", 2, "broadcast", "auto")  # auto: nccl where the trainer has CUDA
    written = ranks.rollout_config(RolloutConfig())
    assert (written.multiprocessing, written.weight_transport, written.weight_broadcast_backend) == (True, shared, "gloo")


def test_engine_count_comes_from_the_cluster_like_the_planner():
    cluster = ClusterConfig(gpus_per_node=8, nodes=1)
    placement = resolve_placement(RolloutConfig(tensor_parallel=2), world_size=8, cluster=cluster)
    assert (placement.kind, placement.engines) == ("colocated_servers", 4)  # 8 GPUs / TP2


def test_settings_that_do_not_fit_are_named():
    with pytest.raises(ConfigError, match="multiprocessing=true or rollout.weight_transport=rpc"):
        resolve_placement(RolloutConfig(weight_transport="broadcast", multiprocessing=False))
    with pytest.raises(ConfigError, match="rollout.server_urls="):
        resolve_placement(RolloutConfig(engine="vllm_server"))
    with pytest.raises(ConfigError, match="rollout.engines=3: colocated engines"):
        make_engine("unused", RolloutConfig(engines=3))
