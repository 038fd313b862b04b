"""Routing replay (R2, R3) and routing-drift metrics on every layout.

Per layout, three actors train the same batch for one RL step of two
optimizer steps (Adam, lr 0.05: the router weights change a lot after the
first), with megatron's distributed optimizer:

* no replay: the experts used in the second mini-batch's forward differ from
  the old policy's (recorded in prepare_batch) -> routing/drift > 0 per layer;
* R2: the forward replays the recorded experts -> the experts the MoE layers
  actually used (their routing_map, seen by a forward hook) equal the
  recorded ones on every token: routing/drift == 0 exactly, while the
  routers' own top-k has moved (routing/drift_own > 0);
* R3: random "engine" routes are replayed in the old-policy forward and in
  training: drift == 0, the engine-vs-trainer metric is large, and the
  replayed forward's logprobs equal the single rank's (the conversion to each
  rank's local tokens, sequence-parallel slice and local layers is right).

Every layout gets the step as the trainer gives it: rank 0 holds the batch and
`actor.distribute` sends each rank its DP rank's rows (R3's engine routes packed
without padding, as the trainer's step batch holds them; padded on the one-rank
reference).

The routes recorded on every layout equal the single rank's (gathered for the
assertion only); each rank holds only the routes its routers computed (its DP
rows, sequence-parallel / CP tokens and pipeline stage's layers: the bytes
measured per rank shrink with the split), and training replays them there. The
same holds with packed microbatches (THD, a 48-token budget) on one rank, TP2,
CP2 and TP2xPP2xEP2, and for a DeepSeek-V3 model whose first two layers are dense (MoE
layer l of the routes is decoder layer l + 2; PP2's first stage holds no
router), with a sigmoid router, expert bias and group-limited top-k.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed

B, T, NUM_EXPERTS, TOPK, MOE_LAYERS = 8, 24, 8, 2, 2
MODES = ("none", "R2", "R3")
WORLD1 = {"single": {}, "single/packed": {}}
WORLD2 = {
    "TP2": {"tensor_parallel": 2, "expert_tensor_parallel": 2},
    "TP2/packed": {"tensor_parallel": 2, "expert_tensor_parallel": 2},
    "PP2": {"pipeline_parallel": 2},
    "EP2": {"expert_parallel": 2},
    "DP2": {},
    "CP2/packed": {"context_parallel": 2},
}
WORLD4 = {
    "TP2xEP2": {"tensor_parallel": 2, "expert_parallel": 2},
    "TP2xPP2xEP2": {"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 2},
    "TP2xPP2xEP2/packed": {"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 2},
}
# old_logprobs=forward: the old-policy forward records every row's routes (the subject here); the first mini-batch
# taking its own (train.old_logprobs=auto) is tests/distributed/test_old_logprobs.py's
PADDED = {"micro_batch_size": 2, "mini_batches_per_step": 2, "old_logprobs": "forward"}
PACKED = {"pack_sequences": True, "max_tokens_per_microbatch": 48, "mini_batches_per_step": 2, "old_logprobs": "forward"}

# DeepSeek-V3 with two dense layers first: MoE layer l of the routes is decoder layer l + 2.
DENSE_FIRST_WORLD1 = {"single": {}}
DENSE_FIRST_WORLD2 = {"PP2": WORLD2["PP2"], "EP2": WORLD2["EP2"]}
DENSE_FIRST_WORLD4 = {"TP2xEP2": WORLD4["TP2xEP2"]}


def make_batch(engine_routes: bool, packed: bool = False):
    """packed: the engine routes as the trainer's step batch holds them (PackedRoutes: each row's real positions
    back to back, no padding)."""
    from megatron_rl.actor import PackedRoutes, TrainBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([24, 20, 17, 12, 22, 9, 15, 24])
    prompts = torch.tensor([5, 4, 6, 3, 8, 2, 4, 4])
    positions = torch.arange(T)
    routes = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range(B * T * MOE_LAYERS)])
    routes = routes.reshape(B, T, MOE_LAYERS, TOPK).to(torch.int16)
    if packed and engine_routes:
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        routes = PackedRoutes(torch.cat([routes[b, : lengths[b]] for b in range(B)]), offsets)
    return TrainBatch(
        tokens=torch.randint(0, 256, (B, T), generator=g),
        response_mask=(positions[None] >= prompts[:, None]) & (positions[None] < lengths[:, None]),
        advantages=torch.randn(B, generator=g),
        prompt_lengths=prompts,
        sequence_lengths=lengths,
        routed_experts=routes if engine_routes else None,
    )


def _runs(rank: int, world_size: int, runs: list) -> list:
    """Several (model_dir, cases) runs in one launch (+ the split transport's check on four ranks)."""
    out = [_worker(rank, world_size, *run) for run in runs]
    return out + [_split_transport(rank, runs[0][0])] if world_size == 4 else out


PART_BYTES = 20_000
"""What the split transport's check gives each rank of its own (R3: the routes it replays)."""


def _split_transport(rank: int, model_dir: str) -> list | None:
    """actor.distribute's split (R3: each rank's cut of the routes) on DP2 x TP2, through distribute.scatter_shares:
    the leader of each share group (ranks 0 and 2) broadcasts the common share and sends each rank its own fields
    (here its rank as policy_version and PART_BYTES of ref_logprobs filled with it). Per rank: what it got, and the
    bytes it received."""
    import pickle

    import torch.distributed as dist

    from megatron_rl.actor.distribute import scatter_shares
    from megatron_rl.config import ParallelConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(timeout_s=120, tensor_parallel=2), shape=model_shape(load_hf_config(model_dir)))
    try:
        def split(share):
            rows = share.batch_size
            parts = {r: {"policy_version": r, "ref_logprobs": torch.full((rows, PART_BYTES // 4 // rows), float(r))}
                     for r in dist.get_process_group_ranks(ctx.share_group)}
            return share.replace(advantages=share.advantages + 1.0), parts

        whole = make_batch(False)
        share, received = scatter_shares(whole if rank == 0 else None, ctx, lambda _: [[0, 1, 2, 3], [4, 5, 6, 7]], split=split)
        common = len(pickle.dumps(share.replace(policy_version=None, ref_logprobs=None)))
        mine = {"rank": rank, "leader": ctx.dp_leaders[ctx.dp_rank], "policy_version": share.policy_version,
                "ref_logprobs": sorted(set(share.ref_logprobs.flatten().tolist())), "received": received, "common": common,
                "rows": share.row_ids.tolist(), "advantages_plus_one": torch.equal(share.advantages, whole.advantages[share.row_ids] + 1)}
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        return everyone if rank == 0 else None
    finally:
        destroy_parallel(ctx, keep_world=True)


def _worker(rank: int, world_size: int, model_dir: str, cases: dict) -> dict | None:
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    shape = model_shape(load_hf_config(model_dir))
    out = {}
    for name, layout in cases.items():
        ctx = init_parallel(ParallelConfig(timeout_s=120, **layout), shape=shape)
        try:
            case = {}
            for mode in MODES:
                actor = Actor(
                    ctx,
                    model=ModelConfig(path=model_dir),
                    optimizer=OptimizerConfig(lr=0.05, clip_grad=0.0),
                    train=TrainConfig(**(PACKED if name.endswith("/packed") else PADDED)),
                    algorithm=AlgorithmConfig(loss="grpo", routing_replay=mode),
                )
                try:
                    # As the trainer runs it: rank 0 holds the step, actor.distribute sends each rank its rows.
                    # R3's routes: padded [B, T, L, K] on the one-rank reference, packed as the trainer's elsewhere
                    batch = make_batch(engine_routes=mode == "R3", packed=name != "single") if rank == 0 else None
                    share = actor.distribute(batch)
                    batch, prepare_metrics = actor.prepare_batch(share)
                    train_metrics = actor.train_step(batch)
                    case[mode] = {
                        "prepare": prepare_metrics,
                        "train": train_metrics,
                        "old_logprobs": _whole(batch.old_logprobs, batch, ctx, fill=0.0),
                        "old_routes": _whole(_share_routes(actor, batch), batch, ctx, fill=-1),
                        "held": _held_routes(ctx, batch.old_routed_experts),
                    }
                finally:
                    actor.close()
            out[name] = case
        finally:
            destroy_parallel(ctx, keep_world=True)
    return out if rank == 0 else None


def _share_routes(actor, batch):
    """The share's [B_share, T_share, L, K] routes, gathered over its model-parallel and CP ranks for the
    assertions only (training replays them where they were recorded)."""
    from megatron_rl.actor.routing import RankRoutes

    routes = batch.old_routed_experts
    return routes.gather(actor.route_groups(batch)) if isinstance(routes, RankRoutes) else routes


def _whole(values: torch.Tensor, share, ctx, *, fill) -> torch.Tensor:
    """A share's per-row values ([B_share, T_share, ...]) placed into the step's [B, T, ...] (gathered from every rank)."""
    import torch.distributed as dist

    parts = [(share.row_ids, values)]
    if ctx.world_size > 1:
        parts = [None] * ctx.world_size
        dist.all_gather_object(parts, (share.row_ids, values))
    whole = torch.full((B, T, *values.shape[2:]), fill, dtype=values.dtype)
    for rows, part in parts:
        whole[rows, : part.shape[1]] = part
    return whole


def _held_routes(ctx, routes) -> dict | None:
    """What each rank holds of the recorded routes: tokens, local MoE layers, bytes (world-gathered on rank 0)."""
    import torch.distributed as dist

    from megatron_rl.actor.routing import RankRoutes

    if not isinstance(routes, RankRoutes):
        return None
    mine = {"tokens": routes.keys.numel(), "layers": len(routes.layer_ids), "bytes": routes.nbytes,
            "token_split": (ctx.tp_size if ctx.sequence_parallel else 1) * ctx.cp_size * ctx.dp_size, "pp": ctx.pp_size}
    if ctx.world_size == 1:
        return {"ranks": [mine]}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("replay") / "moe", "qwen3_moe", seed=5, with_tokenizer=False))


@pytest.fixture(scope="module")
def dense_first_dir(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    # DeepSeek-V3 with two leading dense layers: layers 2 and 3 are MoE layers 0 and 1 of the routes
    # (PP2's first stage has no router at all); sigmoid router with expert bias and 2 expert groups.
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("replay") / "mla", "deepseek_v3", seed=5, with_tokenizer=False,
                                   init_std=0.1, num_hidden_layers=4, first_k_dense_replace=2))


@pytest.fixture(scope="module")
def both_world1(model_dir, dense_first_dir):
    return run_distributed(_runs, 1, [(model_dir, WORLD1), (dense_first_dir, DENSE_FIRST_WORLD1)], timeout=300)[0]


@pytest.fixture(scope="module")
def world1(both_world1):
    return both_world1[0]


@pytest.fixture(scope="module")
def dense_first_single(both_world1):
    return both_world1[1]["single"]


@pytest.fixture(scope="module")
def single(world1):
    return world1["single"]


def _layer_values(metrics: dict, prefix: str) -> list[float]:
    return [metrics[f"{prefix}/layer_{layer}"] for layer in range(MOE_LAYERS)]


def _sets(routes: torch.Tensor) -> torch.Tensor:
    return routes.sort(dim=-1).values


def _check(name: str, case: dict, single: dict) -> None:
    none, r2, r3 = case["none"], case["R2"], case["R3"]
    lengths = make_batch(False).sequence_lengths
    real = torch.arange(T)[None] < lengths[:, None]
    # Without replay the second optimizer step's forward routes differently from the old policy.
    assert all(v > 0 for v in _layer_values(none["train"], "routing/drift")), (name, none["train"])
    assert _layer_values(none["train"], "routing/drift") == _layer_values(none["train"], "routing/drift_own")
    # R2: the experts used are exactly the recorded ones, although the routers' own choice moved.
    assert _layer_values(r2["train"], "routing/drift") == [0.0] * MOE_LAYERS, (name, r2["train"])
    assert all(v > 0 for v in _layer_values(r2["train"], "routing/drift_own")), (name, r2["train"])
    # R3: engine routes replayed in the old-policy forward and in training.
    assert _layer_values(r3["train"], "routing/drift") == [0.0] * MOE_LAYERS, (name, r3["train"])
    assert _layer_values(r3["prepare"], "routing/engine_vs_trainer_used") == [0.0] * MOE_LAYERS
    assert all(v > 0.5 for v in _layer_values(r3["prepare"], "routing/engine_vs_trainer")), (name, r3["prepare"])
    assert torch.equal(r3["old_routes"][real], make_batch(True).routed_experts[real])
    r3_err = ((r3["old_logprobs"] - single["R3"]["old_logprobs"]) * real).abs().max().item()
    assert r3_err <= 1e-5, (name, r3_err)
    # The routes recorded on this layout are the single rank's (gathered over TP/SP, PP, DP, EP).
    recorded, expected = r2["old_routes"], single["R2"]["old_routes"]
    assert recorded.shape == (B, T, MOE_LAYERS, TOPK)
    assert bool((recorded[real] >= 0).all())
    assert torch.equal(_sets(recorded)[real], _sets(expected)[real]), name
    # Each rank holds only what its routers use: its DP rows, SP / CP tokens and PP stage's layers, for R2's recorded
    # routes and R3's engine routes alike (the share came with every layer of every token of its rows).
    for mode in ("R2", "R3"):
        ranks, whole = case[mode]["held"]["ranks"], single[mode]["held"]["ranks"][0]
        if mode == "R3":  # the real tokens (R2 records every position its forward ran, padding too)
            assert whole["tokens"] == int(lengths.sum()), (name, mode, whole)
        split = ranks[0]["token_split"]
        for held in ranks:
            # tokens ~ 1 / (SP x CP x DP) of one rank's (+ sequence-parallel / CP padding), 8-byte key + uint8 ids
            assert held["tokens"] <= whole["tokens"] / split * 1.25 + 8, (name, mode, held, whole)
            assert held["bytes"] == held["tokens"] * (8 + held["layers"] * TOPK), (name, mode, held)
        assert sum(held["layers"] for held in ranks) == MOE_LAYERS * len(ranks) // ranks[0]["pp"], (name, mode, ranks)
        print(f"{name:12s} {mode} held per rank (bytes) {[h['bytes'] for h in ranks]} of {whole['bytes']}")
    print(f"{name:12s} drift none {none['train']['routing/drift']:.3f}  R2 {r2['train']['routing/drift']} "
          f"(own {r2['train']['routing/drift_own']:.3f})  R3 {r3['train']['routing/drift']}  R3 logprobs {r3_err:.1e}")


def test_replay_single_rank(single, world1):
    _check("single", single, single)
    _check("single/packed", world1["single/packed"], single)
    # R3's logprobs differ from the model's own routing's: the replay changes the forward.
    assert (single["R3"]["old_logprobs"] - single["none"]["old_logprobs"]).abs().max() > 1e-3


def test_replay_with_dense_leading_layers_single_rank(dense_first_single):
    _check("deepseek_v3 single", dense_first_single, dense_first_single)


@pytest.mark.parametrize("world_size,cases,dense_first_cases", [(2, WORLD2, DENSE_FIRST_WORLD2), (4, WORLD4, DENSE_FIRST_WORLD4)], ids=["world2", "world4"])
def test_replay_on_layouts(model_dir, single, dense_first_dir, dense_first_single, world_size, cases, dense_first_cases):
    results, dense_first, *split = run_distributed(_runs, world_size, [(model_dir, cases), (dense_first_dir, dense_first_cases)],
                                                   timeout=400)[0]
    for name, case in results.items():
        _check(name, case, single)
    for name, case in dense_first.items():
        _check(f"deepseek_v3 {name}", case, dense_first_single)
    if split:  # four ranks: each rank got its own fields from its group's leader, and no other rank's
        ranks = split[0]
        assert [r["leader"] for r in ranks] == [0, 0, 2, 2] and [r["rows"] for r in ranks] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
        for r in ranks:
            assert r["policy_version"] == r["rank"] and r["ref_logprobs"] == [float(r["rank"])] and r["advantages_plus_one"], r
            if r["rank"] != r["leader"]:  # the common share and its own PART_BYTES, not its peer's too
                assert r["common"] + PART_BYTES <= r["received"] < r["common"] + PART_BYTES + 1000, r
