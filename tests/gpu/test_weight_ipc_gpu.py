"""On CUDA GPUs: weights by CUDA IPC handle from the pushing process into an engine worker's process.

On one GPU, one engine process; on two, the relay of colocated servers
(tests/distributed/test_weight_ipc_relay.py, which runs it on host memory).

No vLLM here (its CUDA build is not installed on the GPU machine): the worker
process runs the real worker extension (rebuild from the handle, the streaming
load) over a model runner that copies into a torch module's parameters on the
same GPU, as in tests/unit/test_weight_ipc.py, which runs this on host memory.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_weight_ipc_relay import check_relay
from tests.unit.test_weight_ipc import (
    check_push_by_handles, check_push_by_reference, make_model_dir, push_by_handles, stream_of,
)
from tests.worker_process import WorkerProcess, load_state


@pytest.mark.gpu
def test_a_push_by_cuda_ipc_handles_loads_bit_exact_with_a_few_buckets_alive(tmp_path):
    torch.cuda.set_device(0)
    check_push_by_handles(tmp_path, "cuda:0")


@pytest.mark.gpu
def test_the_trainers_own_gpu_tensors_go_by_reference_and_load_bit_exact(tmp_path):
    # CUDA IPC handles of the parameters' own blocks: no buffer, one copy (the worker's), as on the host
    torch.cuda.set_device(0)
    check_push_by_reference(tmp_path, "cuda:0")


@pytest.mark.gpu
def test_a_handle_from_another_gpu_is_refused_with_the_fix(tmp_path, monkeypatch):
    import megatron_rl.weight_sync.ipc as ipc

    model_dir = make_model_dir(tmp_path / "a", 0)
    worker = WorkerProcess(model_dir, "cuda:0")
    try:
        monkeypatch.setattr(ipc, "gpu_uuid", lambda device: "GPU-not-this-one")  # the trainer's side says another GPU
        with pytest.raises(Exception, match="not on the GPU that shared its weights.*weight_transport=broadcast"):
            push_by_handles(worker, model_dir, stream_of(load_state(model_dir), "cuda:0"), 1, "cuda:0")
        state = worker.call("state")
        assert all(torch.equal(state[n], t) for n, t in load_state(model_dir).items())  # nothing was loaded
    finally:
        worker.stop()


@pytest.mark.gpu
def test_colocated_servers_relay_each_bucket_to_every_gpu_and_each_worker_maps_its_own(tmp_path):
    # two trainer ranks on GPUs 0 and 1 (NCCL between them), engine workers on both: IpcRelay as on the host
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (the relay copies each bucket from one GPU to the other)")
    check_relay(tmp_path, "cuda")


@pytest.mark.gpu
def test_a_delta_sender_keeps_its_base_off_the_device():
    """weight_sync.delta on CUDA tensors: the base is pinned host memory (no device memory between pushes), the wire
    stays on the device, and the worker's copy rebuilds the bits."""
    from megatron_rl.weight_sync.delta import DeltaEncoder, DeltaHolder

    a = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
    encoder, holder = DeltaEncoder(full_every=5), DeltaHolder()
    wire, meta = encoder.encode([("a", a)], delta=False)
    holder.decode(wire, meta, None)
    encoder.commit(1, delta=False)
    holder.commit(1)
    assert encoder.held["a"].device.type == "cpu" and encoder.held["a"].is_pinned()
    b = a.clone()
    b[::4096] += 1
    wire, meta = encoder.encode([("a", b)], delta=True)
    assert meta["a"]["kind"] == "sparse" and all(t.device.type == "cuda" for _, t in wire)
    assert torch.equal(dict(holder.decode(wire, meta, 1))["a"].cuda(), b)
