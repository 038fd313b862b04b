"""Step time and peak memory of the tiny MoE per parallel layout (CPU, gloo).

    python bench/layouts.py            # writes bench/results/layouts.json
    python bench/layouts.py --families # adds DeepSeek-V3 and GLM-4.5 (single, TP2, PP2, EP2, TP2xEP2) to it

Model: tiny Qwen3-MoE (4 layers, hidden 64, 8 experts top-2, vocab 256).
Step: one optimizer step (Adam, distributed optimizer) over a global batch of
8 sequences x 32 tokens = 256 tokens, in 4 microbatches per data-parallel
rank, through megatron's pipeline schedule; median of the timed steps after
warm-up. Memory: peak resident set size per rank (ru_maxrss, which includes
torch and megatron-core themselves, ~0.5 GB) and its growth during the run.
Each layout runs in fresh processes (forked from a server with the imports
done) so peaks do not carry over. On a 2-core machine 4 ranks oversubscribe
the cores: the ratios show communication and oversubscription overhead, not
what the layouts would do on real hardware.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_SEQS, SEQ, MICROBATCHES = 8, 32, 4
WARMUP, TIMED = 2, 5

LAYOUTS = {
    "single": {},
    "TP2": {"tensor_parallel": 2, "expert_tensor_parallel": 2},
    "PP2": {"pipeline_parallel": 2},
    "EP2": {"expert_parallel": 2},
    "DP2": {},
    "TP2xEP2": {"tensor_parallel": 2, "expert_parallel": 2},
    "PP2xTP2": {"pipeline_parallel": 2, "tensor_parallel": 2, "expert_tensor_parallel": 2},
    "PP2xEP2": {"pipeline_parallel": 2, "expert_parallel": 2},
    "TP2xPP2xEP2": {"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 1},
}
WORLD = {"single": 1, "TP2": 2, "PP2": 2, "EP2": 2, "DP2": 2}
# The newer families on the layouts their tests cover: DeepSeek-V3 (multi-latent attention, sigmoid
# router, a dense first layer) and GLM-4.5 (partial rotary, q/k/v biases and norms, sigmoid router).
FAMILY_LAYOUTS = ("single", "TP2", "PP2", "EP2", "TP2xEP2")
FAMILIES = ("deepseek_v3", "glm4_moe")


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _bench_rank(rank: int, world_size: int, model_dir: str, layout: dict) -> dict:
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models import build_model, load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    rss_start = _rss_mib()
    dp = world_size // (layout.get("tensor_parallel", 1) * layout.get("pipeline_parallel", 1))
    ctx = init_parallel(ParallelConfig(**layout), shape=model_shape(load_hf_config(model_dir)), num_microbatches=MICROBATCHES)
    chunks = build_model(
        ModelConfig(path=model_dir, moe_aux_loss_coeff=1e-2),
        ctx,
        wrap_ddp=True,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0, use_distributed_optimizer=True), chunks, use_gloo_process_groups=False
    )
    tokens = torch.randint(0, 256, (NUM_SEQS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    mine = tokens.chunk(dp)[ctx.dp_rank]
    micro_batch_size = mine.shape[0] // MICROBATCHES
    positions = torch.arange(SEQ).unsqueeze(0)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch[:, :-1], positions, attention_mask=None)

        def loss_func(output):
            loss = tensor_parallel.vocab_parallel_cross_entropy(output.transpose(0, 1).contiguous(), batch[:, 1:].t().contiguous()).mean()
            return loss, {"loss": loss.detach().clone()}

        return logits, loss_func

    times = []
    for step in range(WARMUP + TIMED):
        start = time.perf_counter()
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mine.split(micro_batch_size)),
            model=chunks,
            num_microbatches=MICROBATCHES,
            seq_length=SEQ,
            micro_batch_size=micro_batch_size,
        )
        optimizer.step()
        torch.distributed.barrier()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    destroy_parallel(ctx)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"step_s": statistics.median(times), "peak_rss_mib": peak, "rss_growth_mib": peak - rss_start}


def _run_layouts(model_dir: str, names) -> dict:
    from tests.distributed.harness import run_distributed

    results = {}
    for name in names:
        layout = LAYOUTS[name]
        world = WORLD.get(name, 4)
        ranks = run_distributed(_bench_rank, world, model_dir, layout, timeout=300)
        step = max(r["step_s"] for r in ranks)
        results[name] = {"world_size": world, "layout": layout, "step_ms": round(step * 1e3, 1)}
        print(f"{name:12s} world {world}  step {results[name]['step_ms']:7.1f} ms", flush=True)
    for entry in results.values():
        entry["step_time_vs_single"] = round(entry["step_ms"] / results["single"]["step_ms"], 2)
    return results


def families_main() -> None:
    """Step time per layout relative to the single rank for FAMILIES, added to bench/results/layouts.json."""
    from megatron_rl.models.tiny import make_tiny_model_dir

    path = ROOT / "bench" / "results" / "layouts.json"
    out = json.loads(path.read_text())
    families = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            model_dir = str(make_tiny_model_dir(Path(tmp) / family, family, seed=0, num_hidden_layers=4, with_tokenizer=False))
            print(family, flush=True)
            families[family] = {"model": f"tiny {family}: 4 layers (the first dense), hidden 64, 8 experts top-2, vocab 256, fp32",
                                "layouts": _run_layouts(model_dir, FAMILY_LAYOUTS)}
    out["families"] = families
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


def main() -> None:
    from megatron_rl.models.tiny import make_tiny_model_dir
    from tests.distributed.harness import run_distributed

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model_dir(Path(tmp) / "tiny_moe", "qwen3_moe", seed=0, num_hidden_layers=4, with_tokenizer=False))
        for name, layout in LAYOUTS.items():
            world = WORLD.get(name, 4)
            ranks = run_distributed(_bench_rank, world, model_dir, layout, timeout=300)
            step = max(r["step_s"] for r in ranks)
            results[name] = {
                "world_size": world,
                "layout": layout,
                "step_ms": round(step * 1e3, 1),
                "tokens_per_s": round(NUM_SEQS * SEQ / step, 1),
                "peak_rss_mib_per_rank": [round(r["peak_rss_mib"], 1) for r in ranks],
                "rss_growth_mib_per_rank": [round(r["rss_growth_mib"], 1) for r in ranks],
            }
            print(f"{name:12s} world {world}  step {results[name]['step_ms']:7.1f} ms  peak RSS/rank {max(results[name]['peak_rss_mib_per_rank']):6.0f} MiB", flush=True)
    base = results["single"]
    for entry in results.values():
        entry["step_time_vs_single"] = round(entry["step_ms"] / base["step_ms"], 2)
        entry["peak_rss_per_rank_vs_single"] = round(max(entry["peak_rss_mib_per_rank"]) / max(base["peak_rss_mib_per_rank"]), 2)
    out = {
        "device": "cpu",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "model": "tiny qwen3_moe: 4 layers, hidden 64, 8 experts top-2, vocab 256, fp32",
        "batch": f"{NUM_SEQS} x {SEQ} tokens per step, {MICROBATCHES} microbatches per DP rank, Adam (distributed optimizer)",
        "timing": f"median of {TIMED} steps after {WARMUP} warm-up steps; step time = slowest rank",
        "layouts": results,
    }
    path = ROOT / "bench" / "results" / "layouts.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    families_main() if sys.argv[1:] == ["--families"] else main()
