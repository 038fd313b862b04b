"""Training-step throughput, packed (THD) vs right-padded microbatches, and the batch bytes each rank receives.

1. Throughput: one Qwen3-MoE-shaped model (megatron-core, local spec, one CPU
   process, float32) trains the same batch with the same token budget per
   microbatch, once with right-padded rows (rows x padded width <= budget) and
   once packed (sum of sequence lengths <= budget), and once as right-padded rows
   4 at a time in batch order (micro_batch_size, no budget). Response lengths follow a
   long tail as RL responses do: log-normal with median a quarter of the maximum
   (sigma 0.8), clipped to [16, max]. Reported: real tokens per second of
   `Actor.train_step` (old logprobs given, one optimizer step), the minimum over
   interleaved repeats, and the fraction of model positions that are padding.
   Every mode runs the trainer's path: `Actor.distribute` makes the rank's share,
   `prepare_batch` its old logprobs, `train_step` trains it; the padding and
   packed fractions are the step's own metrics (batch/padding_fraction,
   batch/packed_fraction).
2. Batch bytes per rank: a step of 256 sequences of up to 4,096 tokens (same
   length distribution) with its float32 rollout logprobs, cut into the shares
   `Actor.distribute` sends for D = 1, 2, 4 data-parallel ranks (the actor's
   token-balanced plan); each share pickled, as the scatter sends it.

Writes bench/results/packing.json. Run: python bench/packing.py  (a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "packing.json"

MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)
B, MAX_LEN, PROMPT = 32, 1024, 32
BUDGET = 4096
ROWS_PER_MICROBATCH = 4
REPEATS = 3


def long_tail_lengths(num: int, max_len: int, seed: int) -> torch.Tensor:
    """Response lengths ~ log-normal, median max_len / 4, sigma 0.8, clipped to [16, max_len]."""
    g = torch.Generator().manual_seed(seed)
    median = max_len / 4
    values = torch.exp(torch.randn(num, generator=g) * 0.8 + torch.log(torch.tensor(median)))
    return values.round().clamp(16, max_len).to(torch.int64)


def make_batch(num: int, max_len: int, seed: int, vocab: int):
    from megatron_rl.actor import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.minimum(long_tail_lengths(num, max_len - PROMPT, seed) + PROMPT, torch.tensor(max_len))
    positions = torch.arange(max_len)
    mask = (positions[None] >= PROMPT) & (positions[None] < lengths[:, None])
    return TrainBatch(
        tokens=torch.randint(0, vocab, (num, max_len), generator=g),
        response_mask=mask,
        advantages=torch.randn(num, generator=g),
        prompt_lengths=torch.full((num,), PROMPT),
        sequence_lengths=lengths,
        rollout_logprobs=torch.where(mask, -torch.rand(num, max_len, generator=g), 0.0),
    )


def throughput(model_dir: str) -> dict:
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(), shape=model_shape(load_hf_config(model_dir)))
    batch = make_batch(B, MAX_LEN, 0, 256)
    real_tokens = int(batch.sequence_lengths.sum())
    modes = {
        "padded": TrainConfig(max_tokens_per_microbatch=BUDGET),
        "packed": TrainConfig(max_tokens_per_microbatch=BUDGET, pack_sequences=True),
        # rows in batch order, ROWS_PER_MICROBATCH at a time (train.micro_batch_size without a budget)
        "padded_by_count": TrainConfig(micro_batch_size=ROWS_PER_MICROBATCH),
    }
    actors, shares, times, metrics = {}, {}, {name: [] for name in modes}, {}
    try:
        for name, train in modes.items():
            actors[name] = Actor(ctx, model=ModelConfig(path=model_dir), optimizer=OptimizerConfig(lr=1e-6),
                                 train=train, algorithm=AlgorithmConfig(loss="gspo"))
            # The trainer's path: actor.distribute makes this rank's share, prepare_batch its old logprobs.
            shares[name], _ = actors[name].prepare_batch(actors[name].distribute(batch))
        for _ in range(REPEATS):  # interleaved: both see the same machine load
            for name, actor in actors.items():
                start = time.perf_counter()
                metrics[name] = actor.train_step(shares[name])
                times[name].append(time.perf_counter() - start)
    finally:
        for actor in actors.values():
            actor.close()
        destroy_parallel(ctx)
    out = {}
    for name in modes:
        best = min(times[name])
        padding = metrics[name]["batch/padding_fraction"]
        out[name] = {
            "step_s": best,
            "tokens_per_s": real_tokens / best,
            "model_positions": round(real_tokens / (1 - padding)),
            "padding_fraction": padding,
            "packed_fraction": metrics[name]["batch/packed_fraction"],
            "microbatches": int(metrics[name]["microbatches_per_rank"]),
        }
    out["packed_over_padded_tokens_per_s"] = out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"]
    out["packed_over_padded_by_count_tokens_per_s"] = out["packed"]["tokens_per_s"] / out["padded_by_count"]["tokens_per_s"]
    out["real_tokens"] = real_tokens
    return out


def share_bytes() -> dict:
    from megatron_rl.actor.distribute import select_rows
    from megatron_rl.actor.microbatches import plan_step

    batch = make_batch(256, 4096, 1, 151_936)
    lengths = batch.sequence_lengths.tolist()
    whole = len(pickle.dumps(batch))
    out = {"whole_step_bytes": whole, "per_rank": {}}
    for dp in (1, 2, 4):
        plan = plan_step(lengths, mini_batches=1, dp_size=dp, max_tokens_per_microbatch=8192, pack_sequences=True)
        rows = [sorted(r for mb in plan[0][d] for r in mb.rows) for d in range(dp)]
        sizes = [len(pickle.dumps(select_rows(batch, share))) for share in rows]
        out["per_rank"][str(dp)] = {"max_bytes": max(sizes), "bytes": sizes, "max_over_whole": max(sizes) / whole}
        print(f"D={dp}: bytes per rank {sizes} ({max(sizes) / whole:.3f} of the whole step)", flush=True)
    return out


def model_in(tmp: str) -> str:
    """The benchmark's model (MODEL: random weights, megatron-core reads it as HF) written under `tmp`."""
    from megatron_rl.models.tiny import make_tiny_model_dir

    return str(make_tiny_model_dir(Path(tmp) / "moe", "qwen3_moe", seed=0, with_tokenizer=False, **MODEL))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        step = throughput(model_in(tmp))
    print(f"padded {step['padded']['tokens_per_s']:.0f} tokens/s ({step['padded']['padding_fraction']:.0%} padding), "
          f"packed {step['packed']['tokens_per_s']:.0f} tokens/s ({step['packed']['padding_fraction']:.0%}): "
          f"x{step['packed_over_padded_tokens_per_s']:.2f}; padded 4 rows at a time "
          f"{step['padded_by_count']['tokens_per_s']:.0f} tokens/s ({step['padded_by_count']['padding_fraction']:.0%}): "
          f"x{step['packed_over_padded_by_count_tokens_per_s']:.2f}", flush=True)
    result = {
        "what": "Actor.train_step real tokens/s, packed vs right-padded microbatches (same token budget), "
                "long-tailed response lengths; bytes of the batch share each DP rank receives",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": 1, "torch": torch.__version__},
        "model": MODEL,
        "batch": {"sequences": B, "max_len": MAX_LEN, "prompt": PROMPT, "budget_tokens": BUDGET,
                  "lengths": "log-normal, median a quarter of max, sigma 0.8"},
        "train_step": step,
        "batch_share": share_bytes(),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
