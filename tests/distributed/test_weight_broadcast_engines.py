"""16 engines' worth of engine workers in one weight-broadcast group over real gloo.

Each worker process runs the worker extension vLLM's workers run
(megatron_rl.rollout.worker_ext.RolloutWorkerExtension): its join, receive,
begin / commit methods, called over a pipe the way collective_rpc calls them.
What it reads from vLLM's Worker is given by a small host object: its rank,
the model directory (for the manifest) and `reload_weights` (which here keeps
the tensors it is given, so the test can compare them with what was sent).
The real vLLM engines run the same code in tests/e2e.

Engines: 15 with one worker and one with two (TP=2), 17 workers, 18 ranks:
more than any fixed pool of threads the sender once had (8 engines hung).
Workers are forked from a forkserver that imported torch and vLLM's group
helper once, so the 17 processes cost one import.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.weight_sync.broadcast import BroadcastError, BroadcastSender
from tests.extras import VLLM_EXTRA

pytestmark = pytest.mark.extra(VLLM_EXTRA, "vllm")  # the engines' workers join through vllm.distributed.utils

WORKERS_PER_ENGINE = [1] * 15 + [2]
TIMEOUT_S = 60.0


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=generator),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(12, 8, generator=generator).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.rand(8, generator=generator),
        "model.norm.weight": torch.rand(8, generator=generator),
    }


class _Runner:
    """The part of vLLM's model runner a push touches: the model directory and reload_weights."""

    def __init__(self, model_dir: str):
        self.model_config = type("ModelConfig", (), {"model": model_dir})()
        self.loaded: dict[str, torch.Tensor] = {}

    def get_model(self):
        import torch

        return torch.nn.Module()  # no fused-MoE layers to re-pack

    def reload_weights(self, weights_iterator=None, weights_path: str | None = None, is_checkpoint_format: bool = True) -> None:
        if weights_iterator is None:  # like vLLM: the weights of a model directory
            from safetensors.torch import load_file

            weights_iterator = load_file(str(Path(weights_path) / "model.safetensors")).items()
        self.loaded = {name: tensor.clone() for name, tensor in weights_iterator}


def _serve(conn, rank: int, model_dir: str) -> None:
    """One engine worker: the worker extension on a host object, its methods called by name over a pipe."""
    from megatron_rl.rollout.worker_ext import RolloutWorkerExtension

    class WorkerHost(RolloutWorkerExtension):
        def __init__(self):
            self.rank = rank
            self.model_runner = _Runner(model_dir)

        def loaded(self) -> dict[str, torch.Tensor]:
            return self.model_runner.loaded

        def receive_after(self, delay_s: float, layout: str) -> int:
            time.sleep(delay_s)  # a slow engine: its RPC reaches the worker late
            return self.mrl_broadcast_receive(layout)

    host = WorkerHost()
    while True:
        method, args = conn.recv()
        if method == "stop":
            return
        try:
            conn.send(("ok", getattr(host, method)(*args)))
        except Exception as error:  # sent back to the caller like an RPC error
            conn.send(("error", f"{type(error).__name__}: {error}"))


class _Engine:
    """An engine: its workers; a call runs on all of them at once and returns the first one's answer."""

    def __init__(self, context, first_rank_of: list[int], model_dir: str):
        self.pipes, self.processes = [], []
        for rank in first_rank_of:
            parent, child = context.Pipe()
            process = context.Process(target=_serve, args=(child, rank, model_dir), daemon=True)
            process.start()
            self.pipes.append(parent)
            self.processes.append(process)
        self.lock = threading.Lock()

    def call(self, method: str, *args):
        with self.lock:  # one call at a time per engine, as collective_rpc does
            for pipe in self.pipes:
                pipe.send((method, args))
            answers = [pipe.recv() for pipe in self.pipes]
        for status, value in answers:
            if status != "ok":
                raise RuntimeError(value)
        return answers[0][1]

    def stop(self) -> None:
        for process in self.processes:  # workers may still wait in a rendezvous: no clean exit to wait for
            process.kill()
            process.join()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model_dir = Path(tmp_path_factory.mktemp("manifest"))
    save_file({n: t.contiguous() for n, t in _state().items()}, str(model_dir / "model.safetensors"))
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "vllm.distributed.utils", "megatron_rl.rollout.worker_ext"])
    started = [_Engine(context, list(range(workers)), str(model_dir)) for workers in WORKERS_PER_ENGINE]
    yield started
    for engine in started:
        engine.stop()


def _joins(engines):
    return [lambda info, e=e: e.call("mrl_broadcast_join", info) for e in engines]


def test_sixteen_engines_form_a_group_take_every_bucket_and_a_failed_or_slow_engine_is_named(engines):
    """One launch, four cases: form + push, a slow engine named, the group formed again, a dead engine named."""
    state = _state()
    names = [f"engine {i}" for i in range(len(engines))]
    sender = BroadcastSender("gloo", "127.0.0.1", timeout_s=TIMEOUT_S)
    try:
        # 1. the group forms with every worker; each worker gets every tensor bit-exact
        sender.connect(_joins(engines), WORKERS_PER_ENGINE, names)
        for engine in engines:
            engine.call("mrl_begin_push", 1)
        buckets = [[(n, state[n]) for n in list(state)[:2]], [(n, state[n]) for n in list(state)[2:]]]
        receives = [lambda layout, e=e: e.call("mrl_broadcast_receive", layout) for e in engines]
        for bucket in buckets:
            assert sender.send(bucket, receives, names) == [len(bucket)] * len(engines)
        for engine in engines:
            assert engine.call("mrl_commit_push", False)["version"] == 1
            for pipe in engine.pipes:  # every worker of the TP=2 engine too, not only the first
                pipe.send(("loaded", ()))
                status, loaded = pipe.recv()
                assert status == "ok" and list(loaded) == list(state)
                for name, tensor in state.items():
                    assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)

        # 2. a slow engine: its receive answers after the sender's deadline, and the error names it
        sender.timeout_s = 3.0
        slow = [lambda layout, e=e, i=i: e.call("receive_after", 6.0 if i == 11 else 0.0, layout)
                for i, e in enumerate(engines)]
        for engine in engines:
            engine.call("mrl_begin_push", 2)
        with pytest.raises(BroadcastError, match=r"no answer after 3 s from .*\((\d+) of 16\)") as raised:
            sender.send(buckets[0], slow, names)
        # gloo relays a broadcast along a tree: the engines named are the slow one and any it relays to
        named = str(raised.value).split("from ")[1].split(" (")[0].split(", ")
        assert "engine 11" in named and len(named) < 16
        assert not sender.connected  # a broken group is closed, not reused

        # 3. the group forms again on the same workers and carries a bucket
        sender.timeout_s = TIMEOUT_S
        sender.connect(_joins(engines), WORKERS_PER_ENGINE, names)
        for engine in engines:
            engine.call("mrl_begin_push", 3)
        assert sender.send(buckets[1], receives, names) == [len(buckets[1])] * len(engines)

        # 4. a dead engine: forming the group fails at once, naming it (not after the group timeout)
        engines[9].processes[0].kill()
        engines[9].processes[0].join()
        begin = time.monotonic()
        with pytest.raises(BroadcastError, match="engine 9 failed"):
            sender.connect(_joins(engines), WORKERS_PER_ENGINE, names)
        assert time.monotonic() - begin < TIMEOUT_S / 3
    finally:
        sender.shutdown()
