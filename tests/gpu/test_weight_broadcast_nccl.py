"""On CUDA GPUs: the weight broadcast over NCCL (the GPU backend) moves buckets bit-exactly.

NCCL refuses two ranks of one group on one GPU, so the transfer itself needs
two GPUs; with one, the check that says so (instead of hanging) is tested.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.weight_sync.broadcast import BroadcastError, BroadcastSender, check_not_same_gpu
from tests.extras import VLLM_EXTRA
from tests.unit.test_weight_broadcast import _bucket, _Worker


@pytest.mark.gpu
def test_engine_worker_on_the_trainer_gpu_is_refused_with_the_fix():
    device = torch.device("cuda", 0)
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    with pytest.raises(BroadcastError, match="weight_transport=rpc.*weight_broadcast_backend=gloo"):
        check_not_same_gpu(uuid, device)
    check_not_same_gpu("", device)  # gloo: nothing to check


@pytest.mark.gpu
@pytest.mark.extra(VLLM_EXTRA, "vllm")  # the group forms through vllm.distributed.utils
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_broadcast_reaches_a_worker_on_another_gpu_bit_exact():
    torch.cuda.set_device(0)
    worker = _Worker("cuda:1")
    sender = BroadcastSender("nccl", "127.0.0.1", timeout_s=120)
    try:
        sender.connect([lambda info: worker.call("join", info)], [1])
        g = torch.Generator(device="cuda").manual_seed(0)
        buckets = [
            [("w", torch.randn(1 << 20, device="cuda", generator=g).to(torch.bfloat16))],
            [(n, t.cuda()) for n, t in _bucket()],
        ]
        for bucket in buckets:
            (received,) = sender.send(bucket, [lambda layout: worker.call("receive", layout)])
            for (_, sent), (_, got) in zip(bucket, received):
                assert got.dtype == sent.dtype and torch.equal(got, sent.cpu())
    finally:
        sender.shutdown()
        worker.stop()
