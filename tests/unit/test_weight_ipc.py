"""Weight pushes by memory handle (weight_sync.ipc) between two real processes, host shared memory here.

The receiving process runs the real worker extension (rollout.worker_ext:
mrl_begin_push, mrl_ipc_receive, the streaming load, mrl_commit_push,
mrl_abort_push) over a model runner whose reload copies each tensor into a
torch module's parameters, as vLLM's load does; the push is driven by
weight_sync.push's one protocol. tests/gpu/test_weight_ipc_gpu.py runs the same
with CUDA IPC handles on one GPU; tests/e2e/test_weight_ipc.py with the real
vLLM engine.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from megatron_rl.config import ConfigError, RolloutConfig
from megatron_rl.rollout import resolve_placement
from megatron_rl.weight_sync.push import PushTarget, stream_push
from megatron_rl.weight_sync import WeightStream, bucketize, manifest_from_checkpoint
from megatron_rl.weight_sync.ipc import IpcSender, export_handle, shared_buffer
from megatron_rl.weight_sync.ipc_receive import IpcError, import_handle
from megatron_rl.weight_sync.ipc_reference import (
    SharedMemoryFullError, allow_by_reference, describe_references, open_references, share_host_memory, storage_view,
)
from megatron_rl.weight_sync.stream import PushBrokenError, entries_of
from tests.worker_process import WorkerProcess, load_state

LAYERS = 24
BUCKET_BYTES = 2 << 10


def make_model_dir(path: Path, seed: int) -> Path:
    """A safetensors checkpoint of LAYERS small layers of mixed dtypes (the names are what a manifest needs)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    state = {"embed.weight": torch.randn(32, 16, generator=g)}
    for i in range(LAYERS):
        state[f"layers.{i}.proj.weight"] = torch.randn(16, 16, generator=g)
        state[f"layers.{i}.norm.weight"] = torch.randn(16, generator=g).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    return path


def stream_of(state: dict[str, torch.Tensor], device: str, tamper_at: int | None = None) -> WeightStream:
    """`state` announced, then bucket by bucket as fresh copies on `device` (what the export yields)."""
    buckets = list(bucketize(state.items(), BUCKET_BYTES))

    def make():
        for index, bucket in enumerate(buckets):
            copies = [(name, tensor.to(device, copy=True)) for name, tensor in bucket]
            if index == tamper_at:
                copies[0] = (copies[0][0], torch.zeros(3, device=device))
            yield copies

    return WeightStream(entries_of(buckets), make())


def push_by_handles(worker: WorkerProcess, model_dir: Path, stream: WeightStream, version: int, device: str,
                    batch_buckets: int = 1, answers: list | None = None, pool=None):
    """One push through weight_sync.push's protocol with memory handles; returns (result, the sender). answers: gets
    the worker's answer to each mrl_ipc_receive call; pool: an earlier push's buffers to write again."""
    senders: list[IpcSender] = []

    def sender() -> IpcSender:
        senders.append(IpcSender(torch.device(device), timeout_s=120, batch_buckets=batch_buckets, pool=pool))
        return senders[-1]

    messages = []

    def call(method, *args):
        if method == "mrl_ipc_receive":
            message = json.loads(args[0])  # (on a thread of the sender's, while the next bucket is written)
            for entry in message.get("buckets", [message]):
                messages.append(entry)
                if entry["layout"]["tensors"]:  # (a bucket all by reference has no buffer)
                    assert senders[0].pool.holds(entry["bucket_id"]), entry["bucket_id"]  # kept for the workers
            answer = worker.call(method, *args)
            if answers is not None:
                answers.append(answer)
            return answer
        return worker.call(method, *args)

    target = PushTarget("worker", call, lambda bucket: bucket, lambda: None)
    result = stream_push([target], stream, version, manifest=manifest_from_checkpoint(model_dir), sender=sender,
                         repack_moe=False)
    # each bucket is named by the id its buffer is kept under, counting from 0 in every push
    assert [m["bucket_id"] for m in messages] == list(range(len(messages)))
    return result, senders[0]


def check_push_by_handles(tmp_path: Path, device: str) -> None:
    """A push of another checkpoint: the worker's parameters equal it bit for bit, and the trainer held a few
    shared buckets at a time, each released once the worker's loading was past it."""
    first, second = make_model_dir(tmp_path / "a", 0), make_model_dir(tmp_path / "b", 1)
    target = load_state(second)
    worker = WorkerProcess(first, device)
    try:
        assert not any(torch.equal(target[n], t) for n, t in worker.call("state").items())
        answers: list = []
        result, sender = push_by_handles(worker, first, stream_of(target, device), 1, device, answers=answers)
        state = worker.call("state")
        assert set(state) == set(target)
        for name, tensor in target.items():
            assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
        assert result.commits[0]["version"] == 1 and worker.call("mrl_weight_version") == 1
        model_bytes = sum(t.numel() * t.element_size() for t in target.values())
        buckets = list(bucketize(target.items(), BUCKET_BYTES))
        largest = max(sum(t.numel() * t.element_size() + 64 for _, t in b) for b in buckets)
        assert len(buckets) >= 10
        # shared buffers allocated at once (released ones are written again): bucket k being loaded, k+1 being
        # written while k's call is answered, k-1 whose release that answer brings (the worker answers once its
        # loading is past k's first tensor, so nothing of k-1 is held then)
        assert 0 < result.buffer_bytes == sender.pool.peak_shared_bytes <= 3 * largest < model_bytes / 3
        assert sender.pool.alive_buckets <= 2  # every earlier bucket was acknowledged during the push
        # one call per bucket, and the worker mapped each buffer once: a bucket written into a released buffer
        # found the worker's mapping of it (no new IPC open / page faults per bucket)
        assert len(answers) == len(buckets) and sender.messages == len(buckets)
        assert sum(a["mapped"] for a in answers) == sender.pool.allocations <= 3 < len(buckets)
        sender.abandon()
        assert sender.pool.shared_bytes == 0
        # a second push (its bucket ids count from 0 again) is not confused with the first one's buckets
        original = load_state(first)
        push_by_handles(worker, first, stream_of(original, device), 2, device)
        state = worker.call("state")
        assert all(torch.equal(state[name], tensor) for name, tensor in original.items())
        # batched: the handles of 3 buckets in one call (ceil(buckets / 3) calls), the same weights arrive; the
        # pushing side holds up to 3 more buckets at once
        answers = []
        result, sender = push_by_handles(worker, first, stream_of(target, device), 3, device, 3, answers)
        state = worker.call("state")
        assert all(state[n].dtype == t.dtype and torch.equal(state[n], t) for n, t in target.items())
        assert len(answers) == sender.messages == -(-len(buckets) // 3)
        assert sum(a["staged"] for a in answers) == len(target) and result.commits[0]["version"] == 3
        assert 0 < result.buffer_bytes <= (3 + 4) * largest < model_bytes
        # the next push writes the same buffers again (an engine keeps them across pushes): none is made, and on
        # the host the worker still maps them all (CUDA mappings go when a push ends: they hold the trainer's GPU)
        allocations, answers = sender.pool.allocations, []
        push_by_handles(worker, first, stream_of(original, device), 4, device, answers=answers, pool=sender.pool)
        state = worker.call("state")
        assert all(torch.equal(state[name], tensor) for name, tensor in original.items())
        assert sender.pool.allocations == allocations
        mapped = sum(a["mapped"] for a in answers)
        assert mapped == 0 if device == "cpu" else 0 < mapped <= allocations
    finally:
        worker.stop()


def test_a_push_by_shared_memory_handles_loads_bit_exact_with_a_few_buckets_alive(tmp_path):
    check_push_by_handles(tmp_path, "cpu")


def test_a_push_broken_midway_by_handles_restores_the_model_directory(tmp_path):
    first, second = make_model_dir(tmp_path / "a", 0), make_model_dir(tmp_path / "b", 1)
    worker = WorkerProcess(first)
    try:
        with pytest.raises(PushBrokenError, match="broke midway.*came as"):
            push_by_handles(worker, first, stream_of(load_state(second), "cpu", tamper_at=5), 2, "cpu")
        assert worker.call("mrl_weight_version") == 0  # the first buckets were loaded, then the directory again
        state, original = worker.call("state"), load_state(first)
        assert all(torch.equal(state[name], tensor) for name, tensor in original.items())
    finally:
        worker.stop()


def check_push_by_reference(tmp_path: Path, device: str) -> None:
    """The trainer's tensors let go by reference (`allow_by_reference`: its parameters) reach the worker with no
    buffer written: the worker copies straight from them, bit-exact; tensors not let go (a TP gather's results)
    still go through buffers. On the host they move into shared memory once and the next push maps nothing
    anew; on a GPU nothing moves and the worker maps them again at every push (its CUDA mappings go at the end)."""
    first, second = make_model_dir(tmp_path / "a", 0), make_model_dir(tmp_path / "b", 1)
    target = {n: t.to(device) for n, t in load_state(second).items()}
    original = {n: t.to(device) for n, t in load_state(first).items()}
    model_bytes = sum(t.numel() * t.element_size() for t in target.values())
    moved = model_bytes if device == "cpu" else 0
    assert allow_by_reference(list(target.values())) == moved and allow_by_reference(list(target.values())) == 0
    views = {name: tensor.view(tensor.shape) for name, tensor in target.items()}  # views keep their storage
    addresses = {name: tensor.untyped_storage().data_ptr() for name, tensor in target.items()}
    buckets = list(bucketize(views.items(), BUCKET_BYTES))
    worker = WorkerProcess(first, device)
    try:
        for version in (1, 2):
            answers: list = []
            stream = WeightStream(entries_of(buckets), (list(b) for b in buckets))
            result, sender = push_by_handles(worker, first, stream, version, device, answers=answers)
            state = worker.call("state")
            assert all(state[n].dtype == t.dtype and torch.equal(state[n].to(device), t) for n, t in target.items())
            assert sender.pool.allocations == 0 and result.buffer_bytes == 0  # nothing was copied on this side
            # each tensor has a storage of its own: mapped once, in the first push only (on a GPU at every push)
            assert sum(a["mapped"] for a in answers) == (len(target) if version == 1 or device != "cpu" else 0)
            # the handles name the tensors' own memory: a push copies none of it elsewhere
            assert {n: t.untyped_storage().data_ptr() for n, t in target.items()} == addresses
        # half the tensors fresh copies (not let go by reference): those go through buffers, the rest by reference
        mixed = {n: (t.clone() if i % 2 else t) for i, (n, t) in enumerate(original.items())}
        allow_by_reference([t for i, t in enumerate(original.values()) if i % 2 == 0])
        result, sender = push_by_handles(worker, first, WeightStream(entries_of([list(mixed.items())]),
                                         bucketize(mixed.items(), BUCKET_BYTES)), 3, device)
        state = worker.call("state")
        assert all(torch.equal(state[n].to(device), t) for n, t in original.items()) and sender.pool.allocations > 0
    finally:
        worker.stop()


def test_host_tensors_in_shared_memory_go_by_reference_and_load_bit_exact(tmp_path):
    check_push_by_reference(tmp_path, "cpu")


def test_references_are_viewed_on_the_device_of_their_storage():
    """A push from a GPU describes its parameters' CUDA storages and the worker opens views of the mapped ones:
    each view is made on its storage's device (torch refuses to set a storage of another device than the tensor's).
    The meta device takes CUDA's place here: the same calls, no memory; tests/gpu runs the push itself."""
    base = torch.empty(6, 4, dtype=torch.bfloat16, device="meta")
    bucket = [("q", base[:2]), ("k_t", base[2:].t())]  # a slice and a strided view of one storage
    entries, storages = describe_references(bucket)
    assert len(storages) == 1
    whole = storage_view(storages[0])
    assert whole.device.type == "meta" and whole.dtype == torch.uint8 and whole.numel() == 6 * 4 * 2
    for (name, want), (got_name, got) in zip(bucket, open_references(entries, storages)):
        assert got_name == name and got.device == want.device and got.dtype == want.dtype
        assert got.shape == want.shape and got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset()


def test_shared_memory_too_small_for_the_weights_is_refused_before_moving_anything(monkeypatch):
    import os

    from megatron_rl.weight_sync import ipc_reference

    class Small:
        f_bavail, f_frsize = 16, 4096  # 64 KiB free

    monkeypatch.setattr(ipc_reference.os, "statvfs", lambda path: Small())
    tensor = torch.zeros(1 << 16)  # 256 KiB
    with pytest.raises(SharedMemoryFullError, match=r"262144 bytes.*has 65536 bytes free.*--shm-size"):
        share_host_memory([tensor])
    assert not tensor.is_shared() and os.path.isdir(ipc_reference.SHM_DIR)


def test_a_handle_naming_anything_but_a_tensor_is_refused():
    import os

    with pytest.raises(IpcError, match="names posix.system.*refused"):
        import_handle(pickle.dumps((os.system, ("true",))))
    flat = shared_buffer(100, torch.device("cpu"))[:100]
    flat.copy_(torch.arange(100, dtype=torch.uint8))
    assert flat.is_shared() and torch.equal(import_handle(export_handle(flat)), torch.arange(100, dtype=torch.uint8))


def test_ipc_transport_placement():
    explicit = resolve_placement(RolloutConfig(multiprocessing=True, weight_transport="ipc"))
    assert (explicit.kind, explicit.transport) == ("engine_process", "ipc")
    auto = resolve_placement(RolloutConfig(multiprocessing=True))
    assert auto.transport == ("ipc" if torch.cuda.is_available() else "broadcast")  # same GPU: handles with CUDA
    with pytest.raises(ConfigError, match="weight_transport=ipc needs the engine in another process"):
        resolve_placement(RolloutConfig(multiprocessing=False, weight_transport="ipc"))
    with pytest.raises(ConfigError, match="weight_transport=ipc hands memory handles to engines on the trainer's own"):
        resolve_placement(RolloutConfig(engine="vllm_server", server_urls=["http://a:1"], weight_transport="ipc"))
    colocated = resolve_placement(RolloutConfig(engines=2, weight_transport="ipc"), world_size=2)
    assert (colocated.kind, colocated.transport) == ("colocated_servers", "ipc")  # each rank's device, its worker
    auto = resolve_placement(RolloutConfig(engines=2), world_size=2)
    assert auto.transport == ("ipc" if torch.cuda.is_available() else "broadcast")


def test_auto_picks_ipc_for_an_engine_process_when_cuda_is_there(monkeypatch):
    from megatron_rl.config import placement

    # CUDA without vLLM's weight-transfer engines (with them auto picks vllm_ipc: tests/unit/test_vllm_transfer.py)
    monkeypatch.setattr(placement, "_platform_facts", lambda: placement.TransportFacts(cuda=True))
    assert resolve_placement(RolloutConfig(multiprocessing=True)).transport == "ipc"
    assert resolve_placement(RolloutConfig(multiprocessing=False)).transport == "rpc"  # in-process: references
    assert resolve_placement(RolloutConfig(engines=2), world_size=2).transport == "ipc"  # colocated servers too
    remote = RolloutConfig(engine="vllm_server", server_urls=["http://a:1"])
    assert resolve_placement(remote).transport == "broadcast"  # servers on GPUs of their own

