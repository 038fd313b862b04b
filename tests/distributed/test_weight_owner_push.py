"""Weight pushes without a funnel: 4 trainer ranks, every owner broadcasting its own buckets into 2 engines.

Real processes over gloo: four trainer ranks (megatron-core's tiny Qwen3-MoE on
PP2 x EP2, then TP2 x EP2, in one launch) and two engines of two engine-worker
processes each, running the real worker extension (tests/worker_process.py:
manifest check, streaming load, abort and recovery) over a torch module. Rank 0
drives the engines by RPC (metadata only); every rank that owns parameters
broadcasts its own buckets in its own group with the four workers
(weight_sync.parallel, models.export_owners).

Checked against independent facts: every worker's tensors equal the funnel
export (models.export_hf_weights through rank 0, itself checked against
transformers' checkpoint in test_models_dist) bit for bit; the bytes each rank
sent to the engines and received from its peers are at most model / senders + 2
buckets, and the owners' bytes add up to the model exactly once; a push broken
on trainer rank 2 midway leaves every worker on its model directory's complete
weights (version 0), every rank is told, and the next push is exact.
"""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch

from tests.distributed.harness import _context, run_distributed
from tests.worker_process import TcpEngine, TcpWorkers, load_state
from tests.extras import VLLM_EXTRA

pytestmark = pytest.mark.extra(VLLM_EXTRA, "vllm")  # the weight groups form through vllm.distributed.utils; the sources are vLLM's weight-transfer ones

WORKERS = [2, 2]
"""Engines and their workers."""
BUCKET_BYTES = 48 << 10
LAYOUTS = {"pp2_ep2": {"pipeline_parallel": 2, "expert_parallel": 2},
           "tp2_ep2": {"tensor_parallel": 2, "expert_parallel": 2}}
MAX_PARTS = 2
"""Senders' buckets a worker takes at once: fewer than a round's senders (the push goes in slices)."""
BROKEN_RANK, BROKEN_ROUND = 2, 1
DELTA_FULL_EVERY = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("owner") / "qwen3_moe", "qwen3_moe", seed=7, with_tokenizer=False)
    workers = TcpWorkers(model_dir, WORKERS, _context())
    yield model_dir, workers.addresses
    workers.close()


def _fault(rank: int, round_index: int) -> None:
    if rank == BROKEN_RANK and round_index == BROKEN_ROUND:
        raise RuntimeError(f"export failed on trainer rank {rank} in round {round_index}")


def _push(chunks, ctx, targets, senders, manifest, rank: int, record: dict, version: int, fault=None, plan=None) -> None:
    """One owner-parallel push on this rank; what it moved (or the error that broke it) appended to record."""
    from megatron_rl.models.export_owners import export_owned_weights
    from megatron_rl.weight_sync.parallel import owner_parallel_push
    from megatron_rl.weight_sync.stream import PushBrokenError

    export = export_owned_weights(chunks, ctx, bucket_bytes=BUCKET_BYTES, fault=fault, plan=plan)
    begin, error = time.perf_counter(), None
    try:
        owner_parallel_push(targets, export, version, senders=senders, rank=rank, trainer_group=ctx.world_group,
                            manifest=manifest, workers_per_engine=WORKERS, repack_moe=False, max_parts=MAX_PARTS)
    except PushBrokenError as raised:
        error = str(raised)
    record["pushes"].append({"version": version, "error": error, "seconds": time.perf_counter() - begin,
                             "senders": export.senders, "rounds": len(export.rounds), "owned": export.stats.owned,
                             "peer_in": export.stats.peer_in, "peer_out": export.stats.peer_out})


def _small_step(chunks, step: int) -> None:
    """A training-like update the same on every replica: about 10% of each parameter's values move by 1e-3."""
    import zlib

    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                generator = torch.Generator().manual_seed(zlib.crc32(f"{name}:{step}".encode()))
                mask = torch.rand(param.shape, generator=generator) < 0.1
                param.add_(mask.to(param.dtype) * 1e-3)


def _delta_pushes(chunks, ctx, targets, engines, states, manifest, rank: int) -> dict:
    """Delta pushes after small steps (a full one every DELTA_FULL_EVERY), an engine restarted, one more each."""
    import logging

    from megatron_rl.models.export import export_hf_state_dict
    from megatron_rl.models.export_owners import export_owned_weights, owner_plan
    from megatron_rl.weight_sync.delta import DeltaEncoder
    from megatron_rl.weight_sync.parallel import OwnerSenders, owner_parallel_push

    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("megatron_rl.weight_sync.parallel").addHandler(handler)
    encoder, senders, out = DeltaEncoder(DELTA_FULL_EVERY), OwnerSenders("gloo", "127.0.0.1", timeout_s=60.0), {"pushes": []}
    plan = owner_plan(chunks, ctx, bucket_bytes=BUCKET_BYTES)  # as the pusher keeps it: made once, read at every push
    try:
        for version in range(10, 17):
            if version == 15 and rank == 0:
                engines[1].call_each("restart")
            _small_step(chunks, version)
            reference = export_hf_state_dict(chunks, ctx)
            export = export_owned_weights(chunks, ctx, bucket_bytes=BUCKET_BYTES, plan=plan)
            result = owner_parallel_push(targets, export, version, senders=senders, rank=rank, manifest=manifest,
                                         trainer_group=ctx.world_group, workers_per_engine=WORKERS, repack_moe=False,
                                         delta=encoder, max_parts=MAX_PARTS)
            out["pushes"].append({"delta": result["delta"], "wire_bytes": result["wire_bytes"]})
            if rank == 0 and version in (13, 16):
                out[f"reference_{version}"], out[f"after_{version}"] = reference, states()
    finally:
        senders.shutdown()
    out["logs"] = logs
    return out


def _vllm_source(chunks, ctx) -> dict:
    """Our shards through vLLM's WeightSource contract: metadata, held names, groups and what iteration yields."""
    from vllm.distributed.weight_transfer.base import layerwise_groups

    from megatron_rl.weight_sync.vllm_source import make_megatron_source

    source = make_megatron_source(chunks, ctx)
    meta = source.metadata()
    names = [m.name for m in meta]
    held = source.held_names()
    yielded, nones = {}, []
    for group, tensors in source.iter_groups():
        for name, tensor in zip(group, tensors):
            if tensor is None:
                nones.append(name)
            else:
                yielded[name] = tensor
    return {"meta": [(m.name, tuple(m.shape), str(m.dtype)) for m in meta], "held": sorted(held),
            "groups_ok": source.groups() == [g for g in layerwise_groups(names) if set(g) & held],
            "order_ok": names == [n for g in layerwise_groups(names) for n in g], "yielded": yielded, "nones": nones}


def _vllm_spread(chunks, ctx) -> dict:
    """The sources of vLLM's nccl_m2n and ipc engines (weight_sync.vllm_transfer): what each rank yields."""
    from megatron_rl.weight_sync.vllm_transfer import make_full_source, make_m2n_source

    m2n = make_m2n_source(chunks, ctx)
    blocks = dict(iter(m2n))
    full = make_full_source(chunks, ctx)
    return {"mesh": m2n.mesh().dims, "placements": {m.name: m.placements for m in m2n.metadata()},
            "order": list(blocks), "meta_order": [m.name for m in m2n.metadata()], "blocks": blocks,
            "full": dict(iter(full))}


def _ranks(rank: int, world_size: int, model_dir: str, addresses: list) -> dict:
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models import build_model, load_hf_config, model_shape
    from megatron_rl.models.export import export_hf_state_dict
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.weight_sync import manifest_from_checkpoint
    from megatron_rl.weight_sync.parallel import OwnerSenders

    engines = [TcpEngine(a) for a in addresses] if rank == 0 else []
    targets = [e.target(f"engine {i}") for i, e in enumerate(engines)] if rank == 0 else None
    manifest = manifest_from_checkpoint(model_dir) if rank == 0 else None
    states = lambda: [[(v, s) for v, s in zip(e.call_each("mrl_weight_version"), e.call_each("state"))] for e in engines]  # noqa: E731
    out = {}
    for case, layout in LAYOUTS.items():
        ctx = init_parallel(ParallelConfig(**layout), shape=model_shape(load_hf_config(model_dir)))
        senders = OwnerSenders("gloo", "127.0.0.1", timeout_s=60.0)
        record: dict = {"pushes": []}
        try:
            chunks = build_model(ModelConfig(path=model_dir), ctx)

            push = partial(_push, chunks, ctx, targets, senders, manifest, rank, record)
            with torch.no_grad():
                for chunk in chunks:  # weights of their own, the same on every replica (not the model directory's)
                    for param in chunk.parameters():
                        param.mul_(-1.5)
            reference = export_hf_state_dict(chunks, ctx)
            push(1)
            if rank == 0:
                record["reference_1"], record["after_1"] = reference, states()
            with torch.no_grad():
                for chunk in chunks:
                    for param in chunk.parameters():
                        param.add_(0.25)
            reference = export_hf_state_dict(chunks, ctx)
            push(2, _fault)
            if rank == 0:
                record["after_broken"] = states()
            push(3)
            if rank == 0:
                record["reference_3"], record["after_3"] = reference, states()
            if case == "tp2_ep2":  # rollout.weight_senders_max=2: ranks 0 and 2 send everything, the others hand them shards
                from megatron_rl.models.export_owners import owner_plan

                capped = owner_plan(chunks, ctx, bucket_bytes=BUCKET_BYTES, max_senders=2)
                with torch.no_grad():
                    for chunk in chunks:
                        for param in chunk.parameters():
                            param.add_(0.125)
                reference = export_hf_state_dict(chunks, ctx)
                push(4, plan=capped)
                if rank == 0:
                    record["reference_4"], record["after_4"] = reference, states()
            record["source"] = _vllm_source(chunks, ctx)
            record["spread"] = _vllm_spread(chunks, ctx)
            if case == "pp2_ep2":
                record["delta"] = _delta_pushes(chunks, ctx, targets, engines, states, manifest, rank)
        finally:
            senders.shutdown()
            destroy_parallel(ctx, keep_world=True)
        out[case] = record
    return out


_RESULTS: dict = {}


def _launch(setup) -> list:
    """One launch of the four ranks for both tests of this module."""
    if "ranks" not in _RESULTS:
        model_dir, addresses = setup
        _RESULTS["ranks"] = run_distributed(_ranks, 4, str(model_dir), addresses, timeout=300)
    return _RESULTS["ranks"]


def test_every_owner_sends_its_share_engines_load_bit_exact_and_a_broken_push_recovers(setup):
    model_dir, _ = setup
    results = _launch(setup)
    original = load_state(model_dir)
    for case in LAYOUTS:
        records = [r[case] for r in results]
        rank0 = records[0]
        reference = rank0["reference_1"]
        model_bytes = sum(t.numel() * t.element_size() for t in reference.values())
        assert set(reference) == set(original)
        # every worker of both engines holds the pushed weights bit for bit, version 1
        for when, ref, version in (("after_1", rank0["reference_1"], 1), ("after_3", rank0["reference_3"], 3)):
            for engine in rank0[when]:
                for got_version, state in engine:
                    assert got_version == version, (case, when)
                    assert set(state) == set(ref)
                    for name, tensor in ref.items():
                        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), (case, when, name)
        # no funnel: several senders (>= one per PP stage and per EP rank), each carrying its share
        first = [r["pushes"][0] for r in records]
        senders = first[0]["senders"]
        assert len(senders) > MAX_PARTS and first[0]["rounds"] >= 2, (case, senders)  # rounds go in slices
        assert sum(p["owned"] for p in first) == model_bytes  # every tensor sent once, by one owner
        limit = model_bytes / len(senders) + 2 * BUCKET_BYTES
        for rank, push in enumerate(first):
            assert push["owned"] <= limit and push["peer_in"] <= limit, (case, rank, push, limit)
            assert (push["owned"] > 0) == (rank in senders)
        assert max(p["owned"] for p in first) < model_bytes / 2 < model_bytes  # rank 0 is no funnel
        # the push broken on rank 2: every rank told, every worker on its model directory's complete weights
        broken = [r["pushes"][1]["error"] for r in records]
        assert all(e is not None and "broke midway" in e for e in broken), (case, broken)
        assert f"trainer rank {BROKEN_RANK}" in broken[BROKEN_RANK]
        for engine in rank0["after_broken"]:
            for version, state in engine:
                assert version == 0 and all(torch.equal(state[n], t) for n, t in original.items()), case
        assert all(r["pushes"][2]["error"] is None for r in records)
        if case == "tp2_ep2":  # two senders at most: exact, the model sent once, only by ranks 0 and 2
            for engine in rank0["after_4"]:
                for got_version, state in engine:
                    assert got_version == 4 and all(torch.equal(state[n], t) for n, t in rank0["reference_4"].items()), case
            capped = [r["pushes"][3] for r in records]
            assert capped[0]["senders"] == [0, 2] and capped[0]["error"] is None, capped[0]
            assert sum(p["owned"] for p in capped) == model_bytes
            assert capped[1]["owned"] == capped[3]["owned"] == 0 and capped[1]["peer_out"] > 0 and capped[3]["peer_out"] > 0


def test_delta_pushes_equal_full_ones_bit_for_bit_and_a_restarted_engine_gets_a_full_push(setup):
    """Runs in the launch of the test above (module-scoped results): the PP2 x EP2 case's delta pushes."""
    records = [r["pp2_ep2"]["delta"] for r in _launch(setup)]
    rank0 = records[0]
    # versions 10..16: full (no base), 3 deltas, full (every 4th), full (engine 1 restarted: refused, logged), delta
    assert [p["delta"] for p in rank0["pushes"]] == [False, True, True, True, False, False, True]
    assert any("v15 against v14 refused" in line and "None" in line for line in rank0["logs"]), rank0["logs"]
    for version in (13, 16):
        reference = rank0[f"reference_{version}"]
        for engine in rank0[f"after_{version}"]:
            for got, state in engine:
                assert got == version
                assert all(state[n].dtype == t.dtype and torch.equal(state[n], t) for n, t in reference.items()), version
    # about 10% of values changed: a delta moves 4-byte positions + 4-byte values of those, less than the tensors
    full = sum(r["pushes"][0]["wire_bytes"] for r in records)
    for index in (1, 2, 3, 6):
        delta = sum(r["pushes"][index]["wire_bytes"] for r in records)
        assert delta < 0.5 * full, (index, delta, full)


def test_vllm_weight_source_serves_our_shards_by_its_own_contract(setup):
    """vLLM's WeightSource (vllm.distributed.weight_transfer.base) over the PP2 x EP2 and TP2 x EP2 models: every rank
    describes the whole model in vLLM's layerwise order, ranks hold disjoint names covering it, groups are vLLM's
    layerwise_groups restricted to held names, and the tensors yielded equal the funnel export bit for bit."""
    for case in LAYOUTS:
        records = [r[case] for r in _launch(setup)]
        reference = records[0].get("reference_4", records[0]["reference_3"])  # the weights of the last push
        metas = [r["source"]["meta"] for r in records]
        assert all(m == metas[0] for m in metas)
        assert {n for n, _, _ in metas[0]} == set(reference)
        for name, shape, dtype in metas[0]:
            assert shape == tuple(reference[name].shape) and dtype == str(reference[name].dtype), (case, name)
        held = [set(r["source"]["held"]) for r in records]
        assert sum(len(h) for h in held) == len(reference) and set().union(*held) == set(reference), case
        assert sum(1 for h in held if h) >= 2, case  # no single sender
        for rank, record in enumerate(records):
            source = record["source"]
            assert source["order_ok"] and source["groups_ok"], (case, rank)
            assert set(source["yielded"]) == held[rank] and not set(source["nones"]) & held[rank], (case, rank)
            for name, tensor in source["yielded"].items():
                assert tensor.dtype == reference[name].dtype and torch.equal(tensor, reference[name]), (case, name)


def test_vllm_engines_sources_give_every_rank_its_row_block_or_the_whole_tensor(setup):
    """vLLM's nccl_m2n source: 4 trainer ranks on a (1, 4) mesh, rank r yields row block r of every tensor whose rows 4
    divides (placement (Replicate, Shard(0))), the whole tensor otherwise, in metadata order; the row blocks of the 4
    ranks put together are the funnel export bit for bit. vLLM's ipc source: every tensor whole on every rank."""
    for case in LAYOUTS:
        records = [r[case] for r in _launch(setup)]
        reference = records[0].get("reference_4", records[0]["reference_3"])  # the weights of the last push
        for rank, record in enumerate(records):
            spread = record["spread"]
            assert spread["mesh"] == (1, 4) and spread["order"] == spread["meta_order"], (case, rank)
            assert set(spread["full"]) == set(reference)
            for name, tensor in spread["full"].items():
                assert torch.equal(tensor, reference[name]), (case, rank, name)
        for name, tensor in reference.items():
            placement = records[0]["spread"]["placements"][name]
            blocks = [r["spread"]["blocks"][name] for r in records]
            if tensor.shape[0] % 4 == 0:
                assert placement == (-1, 0), (case, name)
                assert all(b.shape[0] == tensor.shape[0] // 4 for b in blocks)
                assert torch.equal(torch.cat(blocks), tensor), (case, name)
            else:
                assert placement is None and all(torch.equal(b, tensor) for b in blocks), (case, name)
