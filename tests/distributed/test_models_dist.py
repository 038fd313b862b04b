"""HF weights loaded into TP2, EP2, PP2 and TP2xEP2 give transformers' logits; export gives the HF tensors back bit for bit.

Families: Qwen3-MoE and DeepSeek-V3 (multi-latent attention, sigmoid router with
expert bias, a dense first layer) and GLM-4.5 (partial rotary, q/k/v biases and
norms, sigmoid router) in every layout, Qwen2-MoE (shared expert, q/k/v biases)
at TP2xEP2 on 2 ranks, Mixtral at PP2xTP2, dense Qwen2 at TP2, and a Qwen3-MoE
variant with a padded vocabulary (200 -> 256), tied embeddings (the last PP
stage holds a copy), a dense layer and sharded safetensors at TP2 and PP2.
Export runs with 96 KiB buckets, so the weights travel in many buckets, and
again without copies (fresh=False), each bucket packed at once as a push does.
Qwen3-MoE and DeepSeek-V3 also run with their routed experts as megatron-core's
GroupedMLP (moe_grouped_gemm: fused weight1 / weight2 holding an EP rank's
experts, TP-split) on EP2 and TP2xEP2 (Qwen3-MoE with expert TP 2).

The reference is transformers' own model, run in this (pytest) process on the
same tiny checkpoint. Each launch re-initialises megatron's parallel state per
layout inside the same ranks (one launch per world size).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_distributed

SEQ, BATCH = 16, 2
BUCKET_BYTES = 96 << 10

GROUPED = {"moe_grouped_gemm": True}  # routed experts as megatron-core's GroupedMLP (fused weight1 / weight2 per EP rank)

WORLD2 = [
    ("qwen3_moe", {"tensor_parallel": 2, "expert_tensor_parallel": 2}),  # without EP, expert TP = TP
    ("qwen3_moe", {"expert_parallel": 2}),
    ("qwen3_moe", {"pipeline_parallel": 2}),
    ("qwen2_moe", {"tensor_parallel": 2, "expert_parallel": 2}),
    ("qwen2", {"tensor_parallel": 2}),
    ("padded", {"tensor_parallel": 2, "expert_tensor_parallel": 2}),
    ("padded", {"pipeline_parallel": 2}),
    ("deepseek_v3", {"tensor_parallel": 2, "expert_tensor_parallel": 2}),
    ("deepseek_v3", {"expert_parallel": 2}),
    ("deepseek_v3", {"pipeline_parallel": 2}),
    ("glm4_moe", {"tensor_parallel": 2, "expert_tensor_parallel": 2}),
    ("glm4_moe", {"expert_parallel": 2}),
    ("glm4_moe", {"pipeline_parallel": 2}),
    ("qwen3_moe", {"expert_parallel": 2}, GROUPED),
    ("deepseek_v3", {"expert_parallel": 2}, GROUPED),
]
WORLD4 = [
    ("qwen3_moe", {"tensor_parallel": 2, "expert_parallel": 2}),
    ("mixtral", {"tensor_parallel": 2, "pipeline_parallel": 2, "expert_tensor_parallel": 2}),
    ("deepseek_v3", {"tensor_parallel": 2, "expert_parallel": 2}),
    ("glm4_moe", {"tensor_parallel": 2, "expert_parallel": 2}),
    ("qwen3_moe", {"tensor_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 2}, GROUPED),
    ("deepseek_v3", {"tensor_parallel": 2, "expert_parallel": 2}, GROUPED),
]


def sample_tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def forward_logits(chunks, ctx, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full-vocabulary logits [B, T, V] through megatron's pipeline schedule; None off the last stage."""
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    collected = []
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch, positions, attention_mask=None)

        def keep(output_tensor):
            collected.append(output_tensor.detach())
            return output_tensor.sum() * 0.0, {}

        return output, keep

    for chunk in chunks:
        chunk.eval()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([tokens]),
        model=chunks,
        num_microbatches=1,
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=True,
    )
    if not ctx.is_pipeline_last_stage():
        return None
    local = collected[0].contiguous()  # [B, T, V_padded / TP]
    parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, local, group=ctx.tp_group)
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def _load_forward_export(rank: int, world_size: int, cases: list, dirs: dict) -> list:
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models import build_model, export_hf_weights, load_hf_config, model_shape
    from megatron_rl.models.export import funnel_plan
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.weight_sync.broadcast import describe_bucket, pack_bucket, unpack_bucket

    results = []
    for family, layout, *settings in cases:
        hf_config = load_hf_config(dirs[family])
        ctx = init_parallel(ParallelConfig(**layout), shape=model_shape(hf_config))
        try:
            chunks = build_model(ModelConfig(path=dirs[family], **(settings[0] if settings else {})), ctx)
            if settings and not _experts_are_grouped(chunks):
                raise AssertionError(f"{family} {layout} {settings}: the routed experts are not GroupedMLP")
            logits = forward_logits(chunks, ctx, sample_tokens(hf_config["vocab_size"]), hf_config["vocab_size"])
            exported, bucket_sizes, yielded = {}, [], []
            export = export_hf_weights(chunks, ctx, bucket_bytes=BUCKET_BYTES)
            announced = list(export.entries)  # known before the first bucket is made
            for bucket in export:
                bucket_sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
                exported.update(bucket)
                yielded += [(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in bucket]
            if ctx.rank == 0 and announced != yielded:
                raise AssertionError(f"{family} {layout}: the export announced {announced} but yielded {yielded}")
            # fresh=False (the pushing rank's own tensors as views of its parameters), each bucket written into a
            # packed buffer at once as a push does, through a plan kept for later pushes (as the pusher keeps it):
            # the same bytes as the fresh copies
            plan = funnel_plan(chunks, ctx)
            for bucket in export_hf_weights(chunks, ctx, bucket_bytes=BUCKET_BYTES, fresh=False, plan=plan):
                layout_of = describe_bucket(bucket)
                for name, tensor in unpack_bucket(layout_of, pack_bucket(bucket, layout_of, ctx.device)):
                    if not torch.equal(tensor, exported[name]):
                        raise AssertionError(f"{family} {layout}: {name} exported without a copy differs")
            # a step later (every parameter moved in place), the kept plan exports the new values: those of a new plan
            with torch.no_grad():
                for chunk in chunks:
                    for param in chunk.parameters():
                        param.add_(1.0)
            kept = {n: t for b in export_hf_weights(chunks, ctx, bucket_bytes=BUCKET_BYTES, plan=plan) for n, t in b}
            new = {n: t for b in export_hf_weights(chunks, ctx, bucket_bytes=BUCKET_BYTES) for n, t in b}
            if kept.keys() != new.keys() or any(not torch.equal(kept[n], new[n]) for n in new):
                raise AssertionError(f"{family} {layout}: an export through a kept plan differs from a new plan's")
            if ctx.rank == 0 and all(torch.equal(kept[n], exported[n]) for n in kept):
                raise AssertionError(f"{family} {layout}: the kept plan exported the weights of before the step")
            results.append({"logits": logits, "exported": exported if ctx.rank == 0 else None, "buckets": bucket_sizes})
        finally:
            destroy_parallel(ctx, keep_world=True)
    return results


def _experts_are_grouped(chunks) -> bool:
    from megatron_rl.models.mapping import unwrap_model

    experts = [layer.mlp.experts for chunk in chunks for layer in unwrap_model(chunk).decoder.layers if hasattr(layer.mlp, "experts")]
    return bool(experts) and all(type(e).__name__ == "GroupedMLP" for e in experts)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    root = tmp_path_factory.mktemp("models_dist")
    dirs = {f: str(make_tiny_model_dir(root / f, f, seed=3)) for f in ("qwen3_moe", "qwen2_moe", "qwen2", "mixtral")}
    # Vocabulary 200 (padded to 256), tied embeddings, sharded safetensors with an index, a dense layer.
    dirs["padded"] = str(
        make_tiny_model_dir(
            root / "padded",
            "qwen3_moe",
            seed=4,
            with_tokenizer=False,
            vocab_size=200,
            tie_word_embeddings=True,
            mlp_only_layers=[0],
            norm_topk_prob=False,
            max_shard_size="100KB",
        )
    )
    # Multi-latent attention, sigmoid router with expert bias and groups, a dense first layer (4 layers: PP2 splits 1 dense + 1 MoE | 2 MoE).
    dirs["deepseek_v3"] = str(make_tiny_model_dir(root / "deepseek_v3", "deepseek_v3", seed=5, with_tokenizer=False, init_std=0.1, num_hidden_layers=4))
    # GLM-4.5: q/k/v biases, q/k norms, half of each head rotated, sigmoid router, a dense first layer.
    dirs["glm4_moe"] = str(make_tiny_model_dir(root / "glm4_moe", "glm4_moe", seed=6, with_tokenizer=False, init_std=0.1, num_hidden_layers=4))
    return dirs


def _reference(model_dir: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(sample_tokens(model.config.vocab_size)).logits
    tensors = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(shard))
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return logits, tensors


def _check(cases: list, results: list, dirs: dict) -> None:
    refs = {family: _reference(dirs[family]) for family in {case[0] for case in cases}}
    for i, (family, layout, *settings) in enumerate(cases):
        layout = {**layout, **(settings[0] if settings else {})}  # named in the messages
        ref_logits, ref_tensors = refs[family]
        got = [r[i]["logits"] for r in results if r[i]["logits"] is not None]
        assert got, f"{family} {layout}: no last-stage logits"
        for logits in got:
            err = (logits - ref_logits).abs().max().item()
            assert err < 1e-4, f"{family} {layout}: max |logits - transformers| = {err:.3g}"
        exported = results[0][i]["exported"]
        assert set(exported) == set(ref_tensors), f"{family} {layout}: names differ: {set(exported) ^ set(ref_tensors)}"
        for name, ref in ref_tensors.items():
            assert exported[name].dtype == ref.dtype and torch.equal(exported[name], ref), f"{family} {layout}: {name} differs"
        assert all(r[i]["exported"] is None for r in results[1:])
        # Every rank yields the same number of buckets; only rank 0's hold tensors, each within the limit.
        counts = {len(r[i]["buckets"]) for r in results}
        assert len(counts) == 1 and counts.pop() > 3, f"{family} {layout}: bucket counts {[len(r[i]['buckets']) for r in results]}"
        assert all(size == 0 for r in results[1:] for size in r[i]["buckets"])
        assert 0 < max(results[0][i]["buckets"]) <= _bucket_limit(dirs[family], layout)


def _bucket_limit(model_dir: str, layout: dict) -> int:
    """BUCKET_BYTES, or one GroupedMLP weight1 (H x E_local x 2 F fp32, all of an EP rank's experts) when larger:
    a parameter larger than a bucket travels alone."""
    if not layout.get("moe_grouped_gemm"):
        return BUCKET_BYTES
    from megatron_rl.models import load_hf_config, parse_hf_config

    arch = parse_hf_config(load_hf_config(model_dir))
    weight1 = arch.hidden_size * arch.num_experts // layout.get("expert_parallel", 1) * 2 * arch.moe_ffn_hidden_size * 4
    return max(BUCKET_BYTES, weight1)


def test_load_and_export_world2(model_dirs):
    results = run_distributed(_load_forward_export, 2, WORLD2, model_dirs, timeout=240)
    _check(WORLD2, results, model_dirs)


def test_load_and_export_world4(model_dirs):
    results = run_distributed(_load_forward_export, 4, WORLD4, model_dirs, timeout=240)
    _check(WORLD4, results, model_dirs)
