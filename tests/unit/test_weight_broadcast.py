"""Weight broadcast without an engine: packing by hand-worked offsets, and real gloo groups across processes.

The receiving processes below do what an engine worker's `mrl_broadcast_join`
and `mrl_broadcast_receive` do (open_group, broadcast_from_root,
unpack_bucket), driven over a pipe; the engine tests run the real worker
extension inside vLLM.
"""

from __future__ import annotations

import json
import multiprocessing
import time

import pytest
import torch

from megatron_rl.config import ConfigError, RolloutConfig
from megatron_rl.weight_sync.broadcast import (
    BroadcastError,
    BroadcastSender,
    broadcast_from_root,
    close_group,
    describe_bucket,
    open_group,
    pack_bucket,
    resolve_backend,
    unpack_bucket,
)
from tests.extras import VLLM_EXTRA

needs_vllm = pytest.mark.extra(VLLM_EXTRA, "vllm")  # the group forms through vllm.distributed.utils (open_group)


def _bucket() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("a", torch.randn(3)),  # 12 bytes at 0
        ("b", torch.randn(5, 2).to(torch.bfloat16).t()),  # 20 bytes at 64 (non-contiguous input)
        ("c", torch.tensor(-7, dtype=torch.int64)),  # 0-d, 8 bytes at 128
        ("d", torch.zeros(0, dtype=torch.bool)),  # empty, 0 bytes at 192
        ("e", torch.tensor([1.5, -2.25], dtype=torch.float64)),  # 16 bytes at 192
    ]


def test_layout_offsets_are_64_byte_aligned():
    layout = describe_bucket(_bucket())
    assert [t["offset"] for t in layout["tensors"]] == [0, 64, 128, 192, 192]
    assert layout["nbytes"] == 256
    assert [t["dtype"] for t in layout["tensors"]] == ["float32", "bfloat16", "int64", "bool", "float64"]
    assert [t["shape"] for t in layout["tensors"]] == [[3], [2, 5], [], [0], [2]]
    assert json.loads(json.dumps(layout)) == layout  # travels as JSON text


def test_pack_then_unpack_is_bit_exact():
    bucket = _bucket()
    layout = describe_bucket(bucket)
    flat = pack_bucket(bucket, layout, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == 256
    out = unpack_bucket(layout, flat.clone())
    assert [n for n, _ in out] == [n for n, _ in bucket]
    for (_, sent), (_, got) in zip(bucket, out):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)


def test_unpack_rejects_a_buffer_of_the_wrong_size():
    layout = describe_bucket(_bucket())
    with pytest.raises(BroadcastError, match="255.*256 bytes"):
        unpack_bucket(layout, torch.zeros(255, dtype=torch.uint8))


def test_a_layout_that_is_not_its_entries_arithmetic_is_refused_before_any_byte_is_read():
    """A layout comes over HTTP: an engine worker re-derives every offset and the size from the entries (hand-worked
    in test_layout_offsets_are_64_byte_aligned) before it allocates or views anything."""
    import copy

    from megatron_rl.weight_sync.broadcast import check_layout
    from megatron_rl.weight_sync.manifest import WeightPushError

    layout = describe_bucket(_bucket())
    check_layout(layout)
    tampered = []
    for change in (lambda t: t["tensors"][1].update(offset=8),  # overlaps the first tensor
                   lambda t: t["tensors"][4].update(offset=-64),  # before the buffer
                   lambda t: t.update(nbytes=1 << 40),  # a buffer far larger than its tensors
                   lambda t: t["tensors"][0].update(shape=[-3]),
                   lambda t: t["tensors"][2].update(dtype="Tensor")):
        bad = copy.deepcopy(layout)
        change(bad)
        tampered.append(bad)
    messages = []
    for bad in tampered:
        with pytest.raises(WeightPushError) as refused:
            check_layout(bad)
        messages.append(str(refused.value))
    assert "tensor 'b' starts at byte 8 of its packed bucket, where the tensors before it end at 64" in messages[0]
    assert "tensor 'e' starts at byte -64" in messages[1]
    assert f"says {1 << 40} bytes, its tensors take 256" in messages[2]
    assert "tensor 'a'" in messages[3] and "tensor 'c'" in messages[4]
    with pytest.raises(WeightPushError, match="starts at byte 8"):
        unpack_bucket(tampered[0], torch.zeros(256, dtype=torch.uint8))


def test_a_weight_of_another_kind_of_dtype_is_refused_by_the_worker_side_check():
    from megatron_rl.weight_sync.manifest import PushValidator, WeightManifest, WeightPushError

    manifest = WeightManifest(shapes={"w": (2, 3), "steps": (1,)}, dtypes={"w": "F32", "steps": "I64"})
    PushValidator(manifest).check_bucket([("w", torch.zeros(2, 3, dtype=torch.bfloat16)), ("steps", torch.zeros(1, dtype=torch.int64))])
    with pytest.raises(WeightPushError, match=r"'w' comes as int32 but the engine's checkpoint holds F32"):
        PushValidator(manifest).check_bucket([("w", torch.zeros(2, 3, dtype=torch.int32))])
    with pytest.raises(WeightPushError, match=r"'steps' comes as float32 but the engine's checkpoint holds I64"):
        PushValidator(manifest).check_bucket([("steps", torch.zeros(1))])


def test_backend_names_are_checked():
    assert resolve_backend("gloo") == "gloo"
    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    with pytest.raises(ValueError, match="'mpi'.*nccl.*gloo"):
        resolve_backend("mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA.*use 'gloo'"):
            resolve_backend("nccl")


def test_broadcast_with_an_in_process_engine_is_a_config_error():
    with pytest.raises(ConfigError, match="multiprocessing=true or rollout.weight_transport=rpc"):
        RolloutConfig(weight_transport="broadcast", multiprocessing=False).validate()
    RolloutConfig(weight_transport="broadcast", multiprocessing=True).validate()
    RolloutConfig(engine="vllm_server", server_urls=["http://h:1"], weight_transport="broadcast").validate()


# ---- real groups across processes ------------------------------------------------------------------
def _receiver(conn, device: str) -> None:
    """A stand-in for one engine worker's side of the protocol, over a pipe."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    group = None
    while True:
        command, argument = conn.recv()
        try:
            if command == "join":
                info = json.loads(argument)
                if group is not None:
                    close_group(group, 60)
                group = open_group(info["host"], info["port"], info["rank_offset"], info["world_size"], info["backend"], 60)
                conn.send(("ok", info["rank_offset"]))
            elif command == "receive":
                layout = json.loads(argument)
                flat = torch.empty(layout["nbytes"], dtype=torch.uint8, device=device)
                broadcast_from_root(group, flat, timeout_s=60)
                conn.send(("ok", [(n, t.cpu().clone()) for n, t in unpack_bucket(layout, flat)]))
            elif command == "fail":
                raise RuntimeError("worker refused the bucket")
            else:
                conn.send(("ok", None))
                return
        except Exception as error:  # sent back to the test, which checks it
            conn.send(("error", f"{type(error).__name__}: {error}"))


class _Worker:
    def __init__(self, device: str = "cpu"):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_receiver, args=(child, device), daemon=True)
        self.process.start()
        self.fail_next = False

    def call(self, command: str, argument: str):
        if command == "receive" and self.fail_next:
            self.fail_next = False
            command = "fail"
        self.conn.send((command, argument))
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def stop(self):
        try:
            self.conn.send(("stop", ""))
        except OSError:  # the process is gone already
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@pytest.fixture(scope="module")
def workers():
    pair = [_Worker(), _Worker()]
    yield pair
    for worker in pair:
        worker.stop()


@needs_vllm
def test_buckets_reach_every_worker_bit_exact(workers):
    sender = BroadcastSender("gloo", "127.0.0.1", timeout_s=60)
    try:
        sender.connect([lambda info, w=w: w.call("join", info) for w in workers], [1, 1])
        torch.manual_seed(1)
        buckets = [
            [("x.weight", torch.randn(64, 33)), ("x.bias", torch.randn(33).to(torch.bfloat16))],
            [("y", torch.arange(10, dtype=torch.int32))],
            _bucket(),
        ]
        for bucket in buckets:
            answers = sender.send(bucket, [lambda layout, w=w: w.call("receive", layout) for w in workers])
            assert len(answers) == 2
            for received in answers:
                assert [n for n, _ in received] == [n for n, _ in bucket]
                for (_, sent), (_, got) in zip(bucket, received):
                    assert got.dtype == sent.dtype and torch.equal(got, sent)
    finally:
        sender.shutdown()


@needs_vllm
def test_a_failed_receive_ends_the_broadcast_at_once_and_the_group_forms_again(workers):
    worker = workers[0]
    sender = BroadcastSender("gloo", "127.0.0.1", timeout_s=60)
    try:
        sender.connect([lambda info: worker.call("join", info)], [1])
        worker.fail_next = True
        big = [("w", torch.randn(4 << 20))]  # 16 MB: more than loopback buffers hold, so rank 0 waits for the peer
        begin = time.monotonic()
        with pytest.raises((BroadcastError, RuntimeError), match="refused the bucket"):
            sender.send(big, [lambda layout: worker.call("receive", layout)])
        assert time.monotonic() - begin < 30  # not the 60 s group timeout
        assert not sender.connected  # a broken group is closed, not reused
        sender.connect([lambda info: worker.call("join", info)], [1])
        (received,) = sender.send(big, [lambda layout: worker.call("receive", layout)])
        assert torch.equal(received[0][1], big[0][1])
    finally:
        sender.shutdown()


def test_all_results_waits_for_every_call_and_raises_the_first_error_in_order():
    import threading

    from megatron_rl.weight_sync.broadcast import all_results, call_in_threads

    release, ended = threading.Event(), []

    def call(i: int) -> int:
        if i == 0:
            release.wait(5)  # the slow first call: its error must still be the one raised, after it ended
            ended.append(i)
            raise ValueError("first")
        ended.append(i)
        if i == 2:
            release.set()
            raise KeyError("third")
        return i * 10

    with pytest.raises(ValueError, match="first"):
        all_results(call_in_threads([call] * 3, [0, 1, 2], "test"))
    assert sorted(ended) == [0, 1, 2]
    assert all_results(call_in_threads([lambda i: i * 10] * 3, [0, 1, 2], "test")) == [0, 10, 20]
