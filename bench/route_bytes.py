"""Bytes of R3's engine routes through a step: the samples, rank 0's padded batch and the share each DP rank receives.

For two real MoE shapes, a step of SEQUENCES samples with long-tailed lengths (the packing benchmark's
distribution, up to MAX_LEN tokens) gets random routes as the engine returns them ([T, L, K] per sample,
made by `rollout.routing.compact_routes`, as `assemble_routes` makes them), then goes the trainer's way:
`Rollouts.to_padded` (rank 0's [B, T, L, K]), `train_batch_from_rollouts`, and `actor.distribute`'s
`select_rows` + pickle for D = 4 data-parallel ranks (the actor's token-balanced plan). Each is measured
twice: with the routes compact_routes chose (int8 for up to 128 experts) and with every route int16
(what each took before). Then, for the shape's preset layout (TP with sequence parallelism x PP), what each
rank of DP rank 0 keeps of its share for the step: `routing.replay_routes` on that rank's microbatch
layouts, sequence-parallel slice and stage's MoE layers (Actor.distribute under R3), against the share's
[B/D, T, L, K] routes it received.

Writes bench/results/route_bytes.json. Run: python bench/route_bytes.py  (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "route_bytes.json"

from bench.packing import long_tail_lengths  # noqa: E402

SHAPES = {  # MoE layers, experts per token, routed experts
    "qwen3-235b-a22b": (94, 8, 128),
    "deepseek-v3": (58, 8, 256),
}
LAYOUTS = {  # the presets' TP (sequence parallel) x PP
    "qwen3-235b-a22b": ("qwen3-235b-a22b-gspo-32x8h100.yaml", 4, 2),
    "deepseek-v3": ("deepseek-v3-gspo-64x8h100.yaml", 8, 1),
}
TOKENS_PER_MICROBATCH = 8192
SEQUENCES, MAX_LEN, PROMPT, DP = 32, 2048, 64, 4


def step(layers: int, topk: int, experts: int, widen: bool):
    from megatron_rl.actor import train_batch_from_rollouts
    from megatron_rl.data.batch import RolloutSample, Rollouts
    from megatron_rl.rollout.routing import compact_routes

    g = np.random.default_rng(0)
    lengths = long_tail_lengths(SEQUENCES, MAX_LEN - PROMPT, 0).tolist()
    samples = []
    for i, response in enumerate(lengths):
        routes = np.stack([g.permutation(experts)[:topk] for _ in range((PROMPT + response) * layers)]).astype(np.int16)
        routes = compact_routes(routes.reshape(PROMPT + response, layers, topk))
        samples.append(RolloutSample(
            prompt_index=i, sample_index=0, prompt_token_ids=torch.zeros(PROMPT, dtype=torch.int64),
            response_token_ids=torch.ones(response, dtype=torch.int64), rollout_logprobs=torch.zeros(response),
            finish_reason="stop", stop_reason=None, weight_version=0,
            routed_experts=routes.to(torch.int16) if widen else routes, routed_experts_include_prompt=True))
    rollouts = Rollouts(samples, n_samples=1, weight_version=0)
    sample_bytes = sum(s.routed_experts.nbytes for s in samples)
    padded = rollouts.to_padded()
    batch = train_batch_from_rollouts(padded, torch.zeros(SEQUENCES))
    return sample_bytes, padded.routed_experts, batch


def share_bytes(batch) -> list[int]:
    from megatron_rl.actor.distribute import select_rows
    from megatron_rl.actor.plan import plan_step

    plan = plan_step(batch.lengths().tolist(), mini_batches=1, dp_size=DP, max_tokens_per_microbatch=TOKENS_PER_MICROBATCH,
                     pack_sequences=True)
    rows = [sorted(r for mb in plan[0][d] for r in mb.rows if r >= 0) for d in range(DP)]
    return [len(pickle.dumps(select_rows(batch, share))) for share in rows]


def held_per_rank(batch, layers: int, topk: int, experts: int, tp: int, pp: int) -> dict:
    """What each (TP, PP) rank of DP rank 0 keeps of its share's engine routes (R3), as Actor.distribute cuts them."""
    from functools import partial

    from megatron_rl.actor.distribute import select_rows
    from megatron_rl.actor.packing import microbatch_layout
    from megatron_rl.actor.plan import plan_step, rank_microbatches
    from megatron_rl.actor.routing import local_tokens, replay_routes

    plan = plan_step(batch.lengths().tolist(), mini_batches=1, dp_size=DP, max_tokens_per_microbatch=TOKENS_PER_MICROBATCH,
                     width_multiple=tp, pack_sequences=True)
    share = select_rows(batch, sorted(r for mb in plan[0][0] for r in mb.rows if r >= 0))
    lengths = share.lengths()
    microbatches = rank_microbatches(plan[0][0], share.row_ids.tolist())
    held = []
    for stage in range(pp):  # megatron's even split of the decoder layers (every layer is MoE in both shapes)
        layer_ids = range(stage * layers // pp, (stage + 1) * layers // pp)
        for tp_rank in range(tp):
            local = partial(local_tokens, tp_rank=tp_rank, tp_size=tp, sequence_parallel=tp > 1)
            routes = replay_routes(share.routed_experts, (microbatch_layout(mb, lengths, multiple=tp) for mb in microbatches),
                                   lengths, layer_ids=layer_ids, local=local, num_moe_layers=layers, topk=topk, num_experts=experts)
            held.append(routes.nbytes)
    received = share.routed_experts.nbytes
    return {"tp": tp, "pp": pp, "share_routes_bytes": received, "held_bytes_per_rank": held,
            "max_held_over_share": max(held) / received}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    result = {}
    for name, (layers, topk, experts) in SHAPES.items():
        out = {}
        for label, widen in (("compact", False), ("int16", True)):
            sample_bytes, routes, batch = step(layers, topk, experts, widen)
            shares = share_bytes(batch)
            out[label] = {"dtype": str(routes.dtype).removeprefix("torch."), "sample_routes_bytes": sample_bytes,
                          "padded_routes_bytes": routes.nbytes, "share_pickle_bytes": shares, "max_share_bytes": max(shares)}
        out["compact_over_int16_max_share"] = out["compact"]["max_share_bytes"] / out["int16"]["max_share_bytes"]
        out["compact_over_int16_padded"] = out["compact"]["padded_routes_bytes"] / out["int16"]["padded_routes_bytes"]
        preset, tp, pp = LAYOUTS[name]
        out["held"] = {"preset": preset, **held_per_rank(step(layers, topk, experts, False)[2], layers, topk, experts, tp, pp)}
        result[name] = {"moe_layers": layers, "topk": topk, "experts": experts, **out}
        print(f"{name}: routes {out['compact']['dtype']}; rank 0's padded routes {out['compact']['padded_routes_bytes'] / 2**20:.0f} "
              f"MiB (int16: {out['int16']['padded_routes_bytes'] / 2**20:.0f}); largest share {out['compact']['max_share_bytes'] / 2**20:.0f} "
              f"MiB (int16: {out['int16']['max_share_bytes'] / 2**20:.0f}): x{out['compact_over_int16_max_share']:.3f}; "
              f"held per rank at TP{tp} x PP{pp}: {max(out['held']['held_bytes_per_rank']) / 2**20:.1f} MiB of the share's "
              f"{out['held']['share_routes_bytes'] / 2**20:.1f} (x{out['held']['max_held_over_share']:.3f})", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "what": "bytes of R3's engine routes: samples, rank 0's padded [B, T, L, K] and the pickled share of each of "
                f"{DP} DP ranks, with compact_routes' dtype and with int16; held: what each TP x PP rank of DP rank 0 keeps "
                "for the step (routing.replay_routes) against the share's routes",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "step": {"sequences": SEQUENCES, "max_len": MAX_LEN, "prompt": PROMPT, "lengths": "log-normal, median a quarter of max"},
        "shapes": result,
    }, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
