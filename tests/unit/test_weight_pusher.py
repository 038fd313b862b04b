"""WeightPusher's path by vLLM's own engines (rollout.weight_transport=vllm_*), on one rank with fakes.

The transfer itself needs CUDA (tests/gpu/test_vllm_transfer_gpu.py); here: vLLM's trainer engines are made at the
first push and checked against the engines' manifest before any tensor moves, a refused or broken push drops them
(made again at the next push), and the engine is told the version only once the push is in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.config import RolloutConfig
from megatron_rl.config.placement import Placement
from megatron_rl.weight_sync import pusher as pusher_module
from megatron_rl.weight_sync.manifest import WeightManifest, WeightPushError
from megatron_rl.weight_sync.pusher import WeightPusher
from megatron_rl.weight_sync.stream import PushBrokenError

MANIFEST = WeightManifest(shapes={"model.embed_tokens.weight": (8, 4), "lm_head.weight": (8, 4)})
FITS = [("model.embed_tokens.weight", (8, 4), "float32"), ("lm_head.weight", (8, 4), "float32")]


@dataclass
class FakeTransfer:
    """What start_for_run returns: the announced entries, a send that may break, a shutdown."""

    entries: list
    breaks: bool = False
    sent: list[int] = field(default_factory=list)
    shut_down: bool = False

    def send(self, version: int) -> None:
        if self.breaks:
            raise PushBrokenError(f"weight push v{version} broke (test)", [None])
        self.sent.append(version)

    def shutdown(self) -> None:
        self.shut_down = True


class FakeEngine:
    """Rank 0's engine as the pusher sees it: its manifest, its clients, the engine's end of a vLLM push."""

    manifest = MANIFEST

    def __init__(self):
        self.weight_version = 0

    def weight_sync_clients(self) -> list:
        return ["client"]

    def vllm_push(self, send, version: int) -> None:
        send(version)
        self.weight_version = version


def _pusher(monkeypatch, transfers: list[FakeTransfer]) -> tuple[WeightPusher, FakeEngine, list[FakeTransfer]]:
    started: list[FakeTransfer] = []

    def start_for_run(transport, rollout, ctx, model_chunks, *, engines, clients, share, host):
        assert (transport, engines, clients, host) == ("vllm_nccl_m2n", 1, ["client"], "127.0.0.1")
        started.append(transfers[len(started)])
        return started[-1]

    monkeypatch.setattr(pusher_module, "start_for_run", start_for_run)
    ctx = SimpleNamespace(rank=0, world_size=1, world_group=None, host_group=None, device=torch.device("cpu"))
    rollout = RolloutConfig(engine="vllm_server", server_urls=["http://127.0.0.1:8000"])
    engine = FakeEngine()
    placement = Placement("remote_servers", 1, "vllm_nccl_m2n", "auto", None)
    return WeightPusher(rollout, ctx, [], engine, placement=placement), engine, started


def test_vllm_engines_are_made_once_and_each_push_sends_its_version(monkeypatch):
    pusher, engine, started = _pusher(monkeypatch, [FakeTransfer(FITS)])
    assert pusher.push(1) == {} and pusher.push(2) == {}
    assert len(started) == 1 and started[0].sent == [1, 2] and engine.weight_version == 2
    pusher.close()
    assert started[0].shut_down


def test_a_push_the_manifest_refuses_moves_nothing_and_drops_the_engines(monkeypatch):
    wrong = [("model.embed_tokens.weight", (8, 5), "float32"), ("lm_head.weight", (8, 4), "float32")]
    pusher, engine, started = _pusher(monkeypatch, [FakeTransfer(wrong), FakeTransfer(FITS)])
    with pytest.raises(WeightPushError, match="model.embed_tokens.weight"):
        pusher.push(1)
    assert started[0].sent == [] and started[0].shut_down and engine.weight_version == 0
    pusher.push(1)  # made again, and checked again
    assert len(started) == 2 and started[1].sent == [1] and engine.weight_version == 1


def test_a_broken_push_drops_the_engines_and_the_next_push_makes_them_again(monkeypatch):
    pusher, engine, started = _pusher(monkeypatch, [FakeTransfer(FITS, breaks=True), FakeTransfer(FITS)])
    with pytest.raises(PushBrokenError, match="v1 broke"):
        pusher.push(1)
    assert started[0].shut_down and engine.weight_version == 0
    pusher.push(2)
    assert len(started) == 2 and started[1].sent == [2] and engine.weight_version == 2
