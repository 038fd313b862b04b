"""Weights by memory handle into engines whose workers sit on several trainer ranks' devices (weight_sync.ipc.IpcRelay).

Two real trainer processes over gloo; three engine-worker processes running
the real worker extension (tests/worker_process.py): engine A has two
workers (its worker j on rank j's device, as a TP=2 colocated server hosted
by rank 0), engine B one worker on rank 1's device. Rank 0 drives
weight_sync.push's one protocol; rank 1 only iterates its export, as every
trainer rank does. On the host the handles are shared memory named by the
producing process, so the test reads from each handle which process made it:
worker j of an engine must map the copy of the rank on its device.

Checked against independent facts: every worker's parameters equal the
pushed checkpoint bit for bit; each handle names the process of the rank
the placement says; each rank holds a few buffers at a time, bounded by the
bucket size, not the model; a push broken midway brings every worker back to
its model directory without rank 1 hanging, and the next push is exact.
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_rl.weight_sync.push import PushTarget, stream_push
from megatron_rl.weight_sync import WeightStream, bucketize, manifest_from_checkpoint
from megatron_rl.weight_sync.ipc import IpcRelay, IpcSender
from megatron_rl.weight_sync.stream import PushBrokenError, entries_of
from tests.distributed.harness import run_distributed
from tests.unit.test_weight_ipc import BUCKET_BYTES, make_model_dir
from tests.worker_process import WorkerProcess, load_state
from tests.extras import VLLM_EXTRA

pytestmark = pytest.mark.extra(VLLM_EXTRA, "vllm")  # the workers' sleep and wake (a broken push's recovery) are vLLM's

ENGINE_RANKS = [[0, 1], [1]]
"""Worker j of engine i is on trainer rank ENGINE_RANKS[i][j]'s device."""


def _export(state: dict[str, torch.Tensor] | None, buckets: int, tamper_at: int | None = None) -> WeightStream:
    """What export_hf_weights yields: the buckets on rank 0 (`state`), one empty list per bucket elsewhere."""
    if state is None:
        return WeightStream([], iter([[] for _ in range(buckets)]))
    chunks = list(bucketize(state.items(), BUCKET_BYTES))

    def make():
        for index, bucket in enumerate(chunks):
            copies = [(name, tensor.clone()) for name, tensor in bucket]
            if index == tamper_at:
                copies[0] = (copies[0][0], torch.zeros(3))
            yield copies

    return WeightStream(entries_of(chunks), make())


def _target(name: str, workers: list[WorkerProcess], handle_makers: list[list[int]]) -> PushTarget:
    """An engine as the push sees it: each call runs on every worker (collective_rpc); the handles each worker
    gets are noted (the pid in each shared-memory name) before it is called."""

    def call_each(method: str, *args):
        if method == "mrl_ipc_receive":
            message = json.loads(args[0])
            for worker, handle in enumerate(message["handles"]):
                names = re.findall(rb"/torch_(\d+)_", base64.b64decode(handle))  # host memory: the maker's pid
                handle_makers[worker].append(int(names[0]) if names else None)
        return [worker.call(method, *args) for worker in workers]

    return PushTarget(name, lambda method, *args: call_each(method, *args)[0], lambda bucket: bucket, lambda: None,
                      call_each=call_each)


def _push(relay: IpcRelay, rank: int, targets, state, model_dir: Path, version: int, buckets: int,
          tamper_at: int | None = None):
    """One push: rank 0 through stream_push, the other rank draining its export; every rank closes the relay."""
    try:
        if rank == 0:
            stream = relay.wrap(_export(state, buckets, tamper_at))
            return stream_push(targets, stream, version, manifest=manifest_from_checkpoint(model_dir),
                               sender=lambda: IpcSender(relay=relay, timeout_s=60), repack_moe=False)
        for _ in relay.wrap(_export(None, buckets)):
            pass
        return None
    finally:
        dist.barrier(group=relay.object_group)  # rank 0's push (commit or abort) is over before any buffer goes
        relay.close()


def _relay_ranks(rank: int, world_size: int, root: str, device_type: str = "cpu") -> dict:
    """One trainer rank; device_type cuda: rank r on GPU r (NCCL moves the buckets), each worker on its rank's GPU."""
    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    objects = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    first, second = Path(root) / "a", Path(root) / "b"
    target = load_state(second)
    buckets = len(list(bucketize(target.items(), BUCKET_BYTES)))
    relay = IpcRelay(rank=rank, ranks=[0, 1], engine_ranks=ENGINE_RANKS, group=dist.group.WORLD,
                     object_group=objects, device=device)
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid(), group=objects)
    out: dict = {"pids": pids}
    workers = []
    if rank == 0:
        workers = [[WorkerProcess(first, f"cuda:{r}" if cuda else "cpu", rank=j) for j, r in enumerate(ranks)]
                   for ranks in ENGINE_RANKS]
    try:
        makers = [[[] for _ in ranks] for ranks in ENGINE_RANKS]
        targets = [_target(f"engine {i}", w, makers[i]) for i, w in enumerate(workers)]
        result = _push(relay, rank, targets, target, first, 1, buckets)
        out["peak_shared_bytes"] = relay.pool.peak_shared_bytes
        if rank == 0:
            out["makers"] = makers
            out["commits"] = result.commits
            out["states"] = [[w.call("state") for w in engine] for engine in workers]
        # broken midway at bucket 5: every worker back on its model directory; rank 1 does not hang
        try:
            _push(relay, rank, targets, target, first, 2, buckets, tamper_at=5)
            out["broken"] = None
        except PushBrokenError as error:
            out["broken"] = str(error)
        if rank == 0:
            out["after_broken"] = [[(w.call("mrl_weight_version"), w.call("state")) for w in e] for e in workers]
        _push(relay, rank, targets, target, first, 3, buckets)
        if rank == 0:
            out["final"] = [[(w.call("mrl_weight_version"), w.call("state")) for w in e] for e in workers]
    finally:
        for engine in workers:
            for worker in engine:
                worker.stop()
        dist.destroy_process_group()
    return out


def test_each_worker_maps_the_copy_on_its_own_ranks_device_and_loads_bit_exact(tmp_path):
    check_relay(tmp_path, "cpu")


def check_relay(tmp_path: Path, device_type: str) -> None:
    """The relay on host memory, or on two GPUs (tests/gpu/test_weight_ipc_gpu.py), checked as the module says."""
    first, second = make_model_dir(tmp_path / "a", 0), make_model_dir(tmp_path / "b", 1)
    rank0, rank1 = run_distributed(_relay_ranks, 2, str(tmp_path), device_type, timeout=240, cuda=device_type == "cuda")
    target, original = load_state(second), load_state(first)
    pids = rank0["pids"]

    # every worker of both engines now serves the pushed checkpoint, bit for bit
    for engine in rank0["states"]:
        for state in engine:
            assert set(state) == set(target)
            assert all(state[n].dtype == t.dtype and torch.equal(state[n], t) for n, t in target.items())
    assert [c["version"] for c in rank0["commits"]] == [1, 1]
    # worker j of engine i mapped the copy made by the process of rank ENGINE_RANKS[i][j], every bucket (on GPUs
    # each worker checks the GPU behind its handle is its own: a wrong one fails the push)
    buckets = list(bucketize(target.items(), BUCKET_BYTES))
    for i, ranks in enumerate(ENGINE_RANKS):
        for j, rank in enumerate(ranks):
            makers = rank0["makers"][i][j]
            if device_type == "cpu":
                assert makers[: len(buckets)] == [pids[rank]] * len(buckets), (i, j, makers)
    # each rank held a few shared buckets at a time (released ones written again), not the model
    model_bytes = sum(t.numel() * t.element_size() for t in target.values())
    largest = max(sum(t.numel() * t.element_size() + 64 for _, t in b) for b in buckets)
    assert len(buckets) >= 10
    for out in (rank0, rank1):
        assert 0 < out["peak_shared_bytes"] <= 4 * largest < model_bytes / 2, out["peak_shared_bytes"]

    # the broken push: the error says so on rank 0, and every worker is back on its model directory
    assert "broke midway" in rank0["broken"] and rank1["broken"] is None
    for engine in rank0["after_broken"]:
        for version, state in engine:
            assert version == 0 and all(torch.equal(state[n], t) for n, t in original.items())
    for engine in rank0["final"]:
        for version, state in engine:
            assert version == 3 and all(torch.equal(state[n], t) for n, t in target.items())
