"""Sparse-delta encoding (weight_sync.delta) on hand-made tensors, and its config keys."""

import pytest
import torch

from megatron_rl.config import ConfigError, RLConfig, load_config
from megatron_rl.weight_sync.delta import DeltaEncoder, DeltaHolder
from megatron_rl.weight_sync.manifest import WeightPushError


def _bucket(a, b):
    return [("a", a), ("b", b)]


def test_changed_positions_travel_sparse_unless_not_smaller_and_the_worker_rebuilds_the_bits():
    a = torch.arange(100, dtype=torch.bfloat16)
    b = torch.ones(4, dtype=torch.bfloat16)
    encoder, holder = DeltaEncoder(full_every=10), DeltaHolder()
    wire, meta = encoder.encode(_bucket(a, b), delta=False)  # the first push: dense
    assert [n for n, _ in wire] == ["a", "b"] and holder.decode(wire, meta, None)[0][1].equal(a)
    encoder.commit(1, delta=False)
    holder.commit(1)
    a2, b2 = a.clone(), b.clone() * 2
    a2[[3, 50]] = -1  # 2 of 100 changed: 2 x (4 + 2) = 12 bytes < 200 dense
    b2_bytes_dense = 4 * 2  # all 4 of b changed: 4 x 6 = 24 bytes >= 8 dense -> dense
    assert encoder.wants_delta()
    wire, meta = encoder.encode(_bucket(a2, b2), delta=True)
    names = {n: t for n, t in wire}
    assert meta["a"]["kind"] == "sparse" and names["a#idx"].tolist() == [3, 50] and names["a#val"].tolist() == [-1, -1]
    assert meta["b"]["kind"] == "dense" and names["b"].numel() * 2 == b2_bytes_dense
    rebuilt = dict(holder.decode(wire, meta, 1))
    assert torch.equal(rebuilt["a"], a2) and torch.equal(rebuilt["b"], b2)
    # a wrong value is caught by the checksum; a delta against another base is refused
    names["a#val"][0] = 7
    with pytest.raises(WeightPushError, match="checksum"):
        holder.decode(list(names.items()), meta, 1)
    with pytest.raises(WeightPushError, match="against version 5 refused"):
        holder.decode(wire, meta, 5)
    with pytest.raises(WeightPushError, match="holds no copy"):
        DeltaHolder().decode(wire, meta, 1)


def test_a_full_push_every_n_versions():
    encoder = DeltaEncoder(full_every=3)
    kinds = []
    for version in range(1, 8):
        delta = encoder.wants_delta()
        kinds.append(delta)
        encoder.encode([("a", torch.zeros(2))], delta)
        encoder.commit(version, delta)
    assert kinds == [False, True, True, False, True, True, False]
    encoder.reset()
    assert not encoder.wants_delta()


def test_config_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  weight_delta: true\n")
    with pytest.raises(ConfigError, match="weight_delta=true needs rollout.weight_senders=owners"):
        load_config(RLConfig, path)
    with pytest.raises(ConfigError, match="weight_delta_full_every=0"):
        load_config(RLConfig, path, ["rollout.weight_senders=owners", "rollout.weight_delta_full_every=0"])
    cfg = load_config(RLConfig, path, ["rollout.weight_senders=owners"])
    assert cfg.rollout.weight_delta and cfg.rollout.weight_delta_full_every == 10
    with pytest.raises(ConfigError, match="weight_senders=owners with rollout.weight_transport=vllm_nccl_m2n"):
        load_config(RLConfig, path, ["rollout.weight_senders=owners", "rollout.weight_transport=vllm_nccl_m2n"])
    # rollout.weight_senders_max caps the owner senders: refused without them, and below 0
    no_delta = "rollout.weight_delta=false"
    with pytest.raises(ConfigError, match="weight_senders_max=4 caps the owner ranks.*set rollout.weight_senders=owners"):
        load_config(RLConfig, path, [no_delta, "rollout.weight_senders_max=4"])
    with pytest.raises(ConfigError, match="weight_senders_max=-1: must be >= 0"):
        load_config(RLConfig, path, ["rollout.weight_senders=owners", "rollout.weight_senders_max=-1"])
    assert load_config(RLConfig, path, ["rollout.weight_senders=owners", "rollout.weight_senders_max=4"]).rollout.weight_senders_max == 4


def test_the_base_is_a_host_copy_not_the_pushed_tensor():
    """What the sender keeps between pushes is its own copy in host memory (pinned beside a GPU: tests/gpu), so a
    later in-place change of the pushed tensor (the trainer's next step) does not change the base."""
    a = torch.arange(8, dtype=torch.float32)
    encoder = DeltaEncoder(full_every=5)
    encoder.encode([("a", a)], delta=False)
    encoder.commit(1, delta=False)
    a[2] = 100.0  # the next step writes the same buffer
    assert encoder.held["a"].device.type == "cpu" and encoder.held["a"][2] == 2.0
    wire, meta = encoder.encode([("a", a)], delta=True)
    assert meta["a"]["kind"] == "sparse" and dict(wire)["a#idx"].tolist() == [2]
