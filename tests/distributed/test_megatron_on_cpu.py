"""megatron-core runs on a CPU-only torch build through megatron_rl.parallel (gloo).

A tiny megatron-core GPTModel MoE built directly (local layer spec), forward +
backward through get_forward_backward_func and one step of megatron's
DistributedOptimizer (DDP wrapper, grad clipping), on every kind of layout and
both token dispatchers; plus dist_checkpointing save/load. Finite numbers are
all that is asserted here: numerical equivalence across layouts is tested with
the real model builder (megatron_rl/models).
"""

from __future__ import annotations

import math
import os
import tempfile
import time

from megatron_rl.config import ModelShape, ParallelConfig
from tests.distributed.harness import run_distributed

SEQ, MICRO_BATCH, VOCAB = 32, 2, 128
SHAPE = ModelShape(num_layers=2, num_attention_heads=4, num_query_groups=2, num_experts=4, hidden_size=64, vocab_size=VOCAB)


def _build(ctx, dispatcher: str, tie: bool = False, distributed_optimizer: bool = True):
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=4,
        moe_ffn_hidden_size=64,
        moe_router_topk=2,
        moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=1e-2,
        moe_grouped_gemm=False,
        tensor_model_parallel_size=ctx.tp_size,
        pipeline_model_parallel_size=ctx.pp_size,
        expert_model_parallel_size=ctx.ep_size,
        expert_tensor_parallel_size=ctx.expert_tp_size,
        sequence_parallel=ctx.sequence_parallel,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ctx.is_pipeline_first_stage(),
        post_process=ctx.is_pipeline_last_stage(),
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tie,
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=False, bucket_size=None
    )
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    return config, model


def _step(ctx, config, model, num_microbatches: int) -> dict:
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=False, params_dtype=torch.float32,
                        use_distributed_optimizer=True, clip_grad=1e-3),  # fmt: skip
        [model],
    )
    # Same data on every model-parallel rank, different per data-parallel rank.
    gen = torch.Generator().manual_seed(100 + ctx.dp_rank)
    batches = [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen) for _ in range(num_microbatches)]

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)
        output = model(inputs, position_ids, attention_mask=None, labels=labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # the schedule scales `loss` in place

        return output, loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    t0 = time.perf_counter()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    t1 = time.perf_counter()
    ok, grad_norm, _ = optimizer.step()
    t2 = time.perf_counter()
    return {
        "losses": [float(d["lm loss"]) for d in losses],
        "update_ok": bool(ok),
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "fwd_bwd_s": t1 - t0,
        "opt_s": t2 - t1,
    }


def _uneven_collectives(ctx) -> dict:
    """gloo rejects uneven list all_gather/reduce_scatter; the CPU layer emulates them (mappings.py:150/193)."""
    import torch
    from megatron.core.tensor_parallel import mappings

    sizes = [3, 5, 2, 4][: ctx.world_size]
    mine = torch.arange(sizes[ctx.rank] * 2, dtype=torch.float32).reshape(-1, 2) + 100 * ctx.rank
    gathered = mappings._gather_along_first_dim(mine, ctx.world_group, output_split_sizes=sizes)
    expected = torch.cat([torch.arange(n * 2, dtype=torch.float32).reshape(-1, 2) + 100 * r for r, n in enumerate(sizes)])
    full = torch.ones(sum(sizes), 2) * (ctx.rank + 1)
    scattered = mappings._reduce_scatter_along_first_dim(full, ctx.world_group, input_split_sizes=sizes)
    total = sum(r + 1 for r in range(ctx.world_size))
    return {
        "gather_ok": torch.equal(gathered, expected),
        "reduce_scatter_ok": scattered.shape == (sizes[ctx.rank], 2) and bool((scattered == total).all()),
    }


def _cases_worker(rank: int, world_size: int, cases: list, ckpt_case: str | None) -> dict:
    from megatron_rl.parallel import destroy_parallel, init_parallel

    out = {}
    ctx = init_parallel(ParallelConfig(timeout_s=120))
    out["uneven"] = _uneven_collectives(ctx)
    destroy_parallel(ctx, keep_world=True)
    for name, layout, dispatcher, microbatches, tie in cases:
        ctx = init_parallel(ParallelConfig(timeout_s=120, **layout), shape=SHAPE, num_microbatches=microbatches, seed=1234)
        config, model = _build(ctx, dispatcher, tie=tie)
        result = _step(ctx, config, model, microbatches)
        result["last_stage"] = ctx.is_pipeline_last_stage()
        if name == ckpt_case:
            result["ckpt"] = _checkpoint_roundtrip(ctx, model)
        out[name] = result
        destroy_parallel(ctx, keep_world=True)
    return out


def _checkpoint_roundtrip(ctx, model) -> dict:
    """dist_checkpointing save, perturb, load: parameters come back exactly."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if ctx.rank == 0:
        path = tempfile.mkdtemp(prefix="mrl-ckpt-")
    else:
        path = None
    holder = [path]
    dist.broadcast_object_list(holder, src=0)
    path = holder[0]
    t0 = time.perf_counter()
    dist_checkpointing.save(model.module.sharded_state_dict(), path)
    t1 = time.perf_counter()
    before = {k: v.detach().clone() for k, v in model.module.state_dict().items() if torch.is_tensor(v)}
    with torch.no_grad():
        for param in model.module.parameters():
            param.add_(1.0)
    loaded = dist_checkpointing.load(model.module.sharded_state_dict(), path)
    model.module.load_state_dict(loaded, strict=False)
    t2 = time.perf_counter()
    after = model.module.state_dict()
    mismatched = [k for k, v in before.items() if not torch.equal(v, after[k])]
    dist.barrier()
    if ctx.rank == 0:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    return {"mismatched": mismatched, "n": len(before), "save_s": t1 - t0, "load_s": t2 - t1}


def _check(results: list[dict], cases: list) -> None:
    for rank, out in enumerate(results):
        assert out["uneven"] == {"gather_ok": True, "reduce_scatter_ok": True}, (rank, out["uneven"])
    for name, _layout, _dispatcher, microbatches, _tie in cases:
        for rank, out in enumerate(results):
            r = out[name]
            assert r["update_ok"], f"{name} rank {rank}: optimizer step reported failure"
            assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, f"{name} rank {rank}: grad norm {r['grad_norm']}"
            if r["last_stage"]:
                assert len(r["losses"]) == microbatches and all(map(math.isfinite, r["losses"])), (name, rank, r)
                assert all(4.0 < loss < 6.0 for loss in r["losses"]), (name, rank, r["losses"])  # ~ln(128)=4.85
            else:
                assert r["losses"] == []
            if "ckpt" in r:
                assert r["ckpt"]["n"] > 0 and r["ckpt"]["mismatched"] == [], (name, rank, r["ckpt"])
        # The gradient norm is a global quantity: every rank reports the same.
        norms = {round(out[name]["grad_norm"], 5) for out in results}
        assert len(norms) == 1, (name, norms)


CASES_2 = [
    # name, layout, dispatcher, microbatches, tied embeddings
    # EP 1: megatron treats experts as dense weights, so expert TP must equal TP (check_layout).
    ("TP2-alltoall", dict(tensor_parallel=2, expert_tensor_parallel=2), "alltoall", 2, False),
    ("TP2-allgather", dict(tensor_parallel=2, expert_tensor_parallel=2), "allgather", 2, False),
    ("EP2-alltoall", dict(expert_parallel=2), "alltoall", 2, False),
    ("EP2-allgather", dict(expert_parallel=2), "allgather", 2, False),
    ("PP2", dict(pipeline_parallel=2), "alltoall", 4, True),
    ("DP2", dict(), "alltoall", 2, False),
]
CASES_4 = [
    ("TP2xPP2xEP2-alltoall", dict(tensor_parallel=2, pipeline_parallel=2, expert_parallel=2), "alltoall", 4, False),
    ("TP2xEP2-ETP2-alltoall", dict(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=2), "alltoall", 2, False),
]


def test_megatron_moe_on_2_ranks():
    results = run_distributed(_cases_worker, 2, CASES_2, "TP2-alltoall", timeout=240)
    _check(results, CASES_2)
    _report(results, CASES_2)


def test_megatron_moe_on_4_ranks():
    # (dist_checkpointing is exercised on 2 ranks only: its first save per process spawns a
    # Manager that imports torch, ~5 s per rank on 2 cores.)
    results = run_distributed(_cases_worker, 4, CASES_4, None, timeout=240)
    _check(results, CASES_4)
    _report(results, CASES_4)


def _report(results, cases):
    if os.environ.get("MEGATRON_RL_TEST_TIMINGS"):
        for name, *_ in cases:
            r = results[0][name]
            print(f"{name}: fwd+bwd {r['fwd_bwd_s'] * 1e3:.0f} ms, step {r['opt_s'] * 1e3:.0f} ms, ckpt {r.get('ckpt', {})}")
