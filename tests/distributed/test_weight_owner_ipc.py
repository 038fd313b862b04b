"""Colocated pushes by memory handle without a funnel (weight_sync.owner_ipc): every owner's buckets reach the workers'
devices from the owner, not from rank 0.

Real processes over gloo: four trainer ranks (megatron-core's tiny Qwen3-MoE on
PP2 x EP2) and two colocated engines of two workers each, placed as
config.placement.worker_ranks puts two TP2 engines on four ranks (worker j of
the engine hosted by rank h on rank h + j's device). Each worker is a process
running the real worker extension (tests/worker_process.py: manifest check,
streaming load, abort and recovery). On the host a handle is shared memory
named by the process that made it, so the test reads from each handle which
trainer process shared it.

Checked against independent facts: every worker's tensors equal the funnel
export (models.export_hf_state_dict, itself checked against transformers'
checkpoint in test_models_dist) bit for bit; each worker maps only copies made
by the rank on its own device; each rank sources at most model / senders + 2
buckets (rank 0 its share only, where the funnel relay sourced the whole model)
and the owners' bytes add up to the model's packed bytes exactly once; each
engine gets one message per round; a push broken on trainer rank 2 midway leaves
every worker on its model directory's complete weights, every rank is told,
and the next push is exact.
"""

from __future__ import annotations

import base64
import json
import os
import re

import pytest
import torch
import torch.distributed as dist

from tests.distributed.harness import run_distributed
from tests.worker_process import WorkerProcess, load_state
from tests.extras import VLLM_EXTRA

pytestmark = pytest.mark.extra(VLLM_EXTRA, "vllm")  # the workers' sleep and wake (a broken push's recovery) are vLLM's

BUCKET_BYTES = 48 << 10
ENGINES, WORKERS = 2, 2
MAX_PARTS = 2
"""Buckets a slice shares at once (OwnerIpcRelay.max_parts): less than the senders of a round."""
BROKEN_RANK, BROKEN_ROUND = 2, 1


def _fault(rank: int, round_index: int) -> None:
    if rank == BROKEN_RANK and round_index == BROKEN_ROUND:
        raise RuntimeError(f"export failed on trainer rank {rank} in round {round_index}")


def _target(name: str, workers: list, record: dict):
    """An engine: each call runs on every worker (collective_rpc); each IPC message's handles are noted by the pid
    that made them (host memory: /torch_<pid>_... in the pickled handle), and its bucket count."""
    from megatron_rl.weight_sync.push import PushTarget

    def call_each(method: str, *args):
        if method == "mrl_ipc_receive":
            message = json.loads(args[0])
            record["messages"].append(len(message["buckets"]))
            for bucket in message["buckets"]:
                for worker, handle in enumerate(bucket["handles"]):
                    pids = re.findall(rb"/torch_(\d+)_", base64.b64decode(handle))
                    record["makers"][worker].add(int(pids[0]) if pids else None)
        return [worker.call(method, *args) for worker in workers]

    return PushTarget(name, lambda method, *args: call_each(method, *args)[0], lambda bucket: bucket, lambda: None,
                      call_each=call_each)


def _ranks(rank: int, world_size: int, model_dir: str) -> dict:
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.config.placement import worker_ranks
    from megatron_rl.models import build_model, load_hf_config, model_shape
    from megatron_rl.models.export import export_hf_state_dict
    from megatron_rl.models.export_owners import export_owned_weights
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.weight_sync import manifest_from_checkpoint
    from megatron_rl.weight_sync.owner_ipc import OwnerIpcRelay, owner_ipc_push
    from megatron_rl.weight_sync.stream import PushBrokenError

    ctx = init_parallel(ParallelConfig(pipeline_parallel=2, expert_parallel=2), shape=model_shape(load_hf_config(model_dir)))
    engine_ranks = worker_ranks(ENGINES, WORKERS, world_size)
    pids: list = [None] * world_size
    dist.all_gather_object(pids, os.getpid(), group=ctx.world_group)
    out: dict = {"pids": pids, "engine_ranks": engine_ranks, "pushes": []}
    workers = [[WorkerProcess(model_dir, "cpu", rank=j) for j in range(WORKERS)] for _ in range(ENGINES)] if rank == 0 else []
    records = [{"messages": [], "makers": [set() for _ in range(WORKERS)]} for _ in workers]
    targets = [_target(f"engine {i}", w, records[i]) for i, w in enumerate(workers)] if rank == 0 else None
    manifest = manifest_from_checkpoint(model_dir) if rank == 0 else None
    states = lambda: [[(w.call("mrl_weight_version"), w.call("state")) for w in e] for e in workers]  # noqa: E731
    relay = OwnerIpcRelay(rank=rank, engine_ranks=engine_ranks, group=ctx.world_group, object_group=ctx.world_group,
                          timeout_s=60.0, max_parts=MAX_PARTS)
    try:
        chunks = build_model(ModelConfig(path=model_dir), ctx)

        def push(version: int, fault=None) -> None:
            export = export_owned_weights(chunks, ctx, bucket_bytes=BUCKET_BYTES, fault=fault)
            try:
                result = owner_ipc_push(targets, export, version, relay=relay, rank=rank, trainer_group=ctx.world_group,
                                        manifest=manifest, repack_moe=False)
                error = None
            except PushBrokenError as raised:
                result, error = {}, str(raised)
            out["pushes"].append({"error": error, "senders": export.senders, "rounds": len(export.rounds),
                                  "sent": result.get("sent_bytes"), "received": result.get("received_bytes"),
                                  "peak_shared": relay.pool.peak_shared_bytes,
                                  "parts": [[(o, e) for o, e in parts] for parts in export.rounds]})

        with torch.no_grad():
            for chunk in chunks:  # weights of their own, the same on every replica (not the model directory's)
                for param in chunk.parameters():
                    param.mul_(-1.5)
        out["reference_1"] = export_hf_state_dict(chunks, ctx)
        push(1)
        if rank == 0:
            out["after_1"] = states()
        with torch.no_grad():
            for chunk in chunks:
                for param in chunk.parameters():
                    param.add_(0.25)
        out["reference_3"] = export_hf_state_dict(chunks, ctx)
        push(2, _fault)
        if rank == 0:
            out["after_broken"] = states()
        push(3)
        if rank == 0:
            out["after_3"] = states()
            out["records"] = [{"messages": r["messages"], "makers": [sorted(m, key=str) for m in r["makers"]]}
                              for r in records]
    finally:
        for engine in workers:
            for worker in engine:
                worker.stop()
        destroy_parallel(ctx)
    return out


def _packed_bytes(entries) -> int:
    """A bucket's bytes as weight_sync.broadcast packs them: each tensor at a 64-byte aligned offset."""
    offset = 0
    for _, shape, dtype in entries:
        numel = 1
        for d in shape:
            numel *= d
        offset = -(-(offset + numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()) // 64) * 64
    return offset


def test_every_owner_shares_its_own_buckets_with_every_workers_device_and_a_broken_push_recovers(tmp_path):
    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "qwen3_moe", "qwen3_moe", seed=7, with_tokenizer=False)
    results = run_distributed(_ranks, 4, str(model_dir), timeout=300)
    rank0, original = results[0], load_state(model_dir)
    pids, engine_ranks = rank0["pids"], rank0["engine_ranks"]
    assert engine_ranks == [[0, 1], [2, 3]]  # every rank's device holds one worker

    # every worker of both engines serves the pushed weights bit for bit
    for when, reference, version in (("after_1", rank0["reference_1"], 1), ("after_3", rank0["reference_3"], 3)):
        assert set(reference) == set(original)
        for engine in rank0[when]:
            for got, state in engine:
                assert got == version, when
                assert all(state[n].dtype == t.dtype and torch.equal(state[n], t) for n, t in reference.items()), when
    # worker j of engine i mapped only copies made by the process of the rank on its device
    for i, ranks in enumerate(engine_ranks):
        for j, rank in enumerate(ranks):
            assert rank0["records"][i]["makers"][j] == [pids[rank]], (i, j, rank0["records"][i]["makers"][j])

    # no funnel: each rank sources its own share; rank 0 only its own
    first = [r["pushes"][0] for r in results]
    senders, parts = first[0]["senders"], first[0]["parts"]
    assert len(senders) >= 2 and first[0]["rounds"] >= 2
    packed = {rank: sum(_packed_bytes(entries) for round_parts in parts for owner, entries in round_parts if owner == rank)
              for rank in range(4)}
    model_packed = sum(packed.values())
    model_bytes = sum(t.numel() * t.element_size() for t in rank0["reference_1"].values())
    assert model_bytes <= model_packed <= model_bytes + 64 * len(rank0["reference_1"])
    largest = max(_packed_bytes(entries) for round_parts in parts for _, entries in round_parts)
    limit = model_packed / len(senders) + 2 * largest
    for rank, push in enumerate(first):
        assert push["sent"] == packed[rank] <= limit, (rank, push["sent"], limit)
        assert push["received"] == model_packed - packed[rank]  # its worker needs the rest of the model, from the owners
    assert first[0]["sent"] < model_packed / 2  # the funnel relay sourced all of model_packed on rank 0
    # one message per engine per slice of MAX_PARTS of a round's buckets (batched), for each of pushes 1 and 3
    slices = [p[k : k + MAX_PARTS] for p in parts for k in range(0, len(p), MAX_PARTS)]
    assert max(len(p) for p in parts) > MAX_PARTS  # a round wider than a slice: the bound below is the slice's
    for record in rank0["records"]:
        assert record["messages"][: len(slices)] == [len(p) for p in slices]
    # buffers: a few slices' worth on each rank (not the round's, which grows with the senders; not the model)
    widest = max(sum(_packed_bytes(e) for _, e in piece) for piece in slices)
    for push in first:
        assert 0 < push["peak_shared"] <= 4 * widest < model_packed, (push["peak_shared"], widest, model_packed)

    # the push broken on rank 2: every rank told, every worker back on its model directory's weights
    broken = [r["pushes"][1]["error"] for r in results]
    assert all(e is not None and "broke midway" in e for e in broken), broken
    assert f"trainer rank {BROKEN_RANK}" in broken[BROKEN_RANK]
    for engine in rank0["after_broken"]:
        for version, state in engine:
            assert version == 0 and all(torch.equal(state[n], t) for n, t in original.items())
    assert all(r["pushes"][2]["error"] is None for r in results)
