"""Core attention forward + backward on a long-tail batch: packed (THD) vs right-padded rows, CPU float32.

    python bench/attention.py          # writes bench/results/attention.json (about a minute)

Batch: 16 responses whose lengths follow a log-normal law with median a quarter of the
longest (RL responses: most short, a few near the limit), clipped to [16, 1024] tokens;
Qwen3-shaped heads on one TP rank (8 query heads, 2 key/value groups, head dim 64); the
sizes keep megatron's dense [B x heads, T, T] scores to about 0.5 GB.

Compared in the same run (time = minimum over interleaved repeats, single-threaded):
  packed             megatron_rl's LocalCoreAttention on the THD pack (block-diagonal causal,
                     one fused scaled_dot_product_attention call per sequence)
  padded             the same module on [T_max, B] right-padded rows (causal; padding computed)
  padded_megatron    megatron's local DotProductAttention on the same padded rows (the local
                     spec's attention before packing: baddbmm + masked softmax + bmm)
The ratios are what matter; absolute times are of this shared 2-core machine.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "attention.json"

BATCH, MAX_LEN, MIN_LEN = 16, 1024, 16
HEADS, GROUPS, HEAD_DIM = 8, 2, 64
REPEATS = 5


def response_lengths(torch) -> list[int]:
    """Log-normal lengths, median MAX_LEN / 4, sigma 1, clipped to [MIN_LEN, MAX_LEN]."""
    gen = torch.Generator().manual_seed(0)
    median = MAX_LEN / 4
    lengths = torch.exp(torch.randn(BATCH, generator=gen) + torch.log(torch.tensor(median)))
    return [int(n) for n in lengths.clamp(MIN_LEN, MAX_LEN).round().tolist()]


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    import warnings

    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.config import ParallelConfig
    from megatron_rl.models.attention import LocalCoreAttention, packed_seq_params
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig())
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=HEAD_DIM,
        attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True, masked_softmax_fusion=False,
    )  # fmt: skip
    local = LocalCoreAttention(config, 1, AttnMaskType.causal, "self")
    megatron = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    lengths = response_lengths(torch)
    tokens, padded_len = sum(lengths), max(lengths)
    params = packed_seq_params(lengths)
    gen = torch.Generator().manual_seed(1)

    def inputs(shape):
        q = torch.randn(*shape, HEADS, HEAD_DIM, generator=gen).requires_grad_()
        k = torch.randn(*shape, GROUPS, HEAD_DIM, generator=gen).requires_grad_()
        v = torch.randn(*shape, GROUPS, HEAD_DIM, generator=gen).requires_grad_()
        return q, k, v

    packed_inputs, padded_inputs = inputs((tokens,)), inputs((padded_len, BATCH))
    cases = {
        "packed": lambda: local(*packed_inputs, None, packed_seq_params=params).sum().backward(),
        "padded": lambda: local(*padded_inputs, None).sum().backward(),
        "padded_megatron": lambda: megatron(*padded_inputs, None).sum().backward(),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(REPEATS):  # interleaved: load on the machine hits every case alike
        for name, fn in cases.items():
            times[name] += timed(fn, 1)
    best = {name: min(t) for name, t in times.items()}
    destroy_parallel(ctx)
    result = {
        "what": "core attention forward + backward, CPU float32, 1 thread, min over interleaved repeats",
        "batch": BATCH,
        "lengths": {"max": padded_len, "median": sorted(lengths)[BATCH // 2], "min": min(lengths), "tokens": tokens},
        "padded_tokens": padded_len * BATCH,
        "padding_fraction": round(1 - tokens / (padded_len * BATCH), 3),
        "heads": {"query": HEADS, "key_value": GROUPS, "head_dim": HEAD_DIM},
        "seconds": {name: round(t, 4) for name, t in best.items()},
        "packed_over_padded": round(best["packed"] / best["padded"], 3),
        "packed_over_padded_megatron": round(best["packed"] / best["padded_megatron"], 3),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine()},
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
