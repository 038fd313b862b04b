"""Bytes of R3's engine routes through a step: the samples, rank 0's step batch, each DP rank's share, what a rank keeps.

For two real MoE shapes, a step of SEQUENCES samples with long-tailed lengths (the packing benchmark's
distribution, up to MAX_LEN tokens) gets random routes as the engine returns them ([T, L, K] per sample,
made by `rollout.routing.compact_routes`, as `assemble_routes` makes them), then goes the trainer's way:
`train_batch_from_rollouts` (rank 0's step batch) and `actor.distribute`'s `select_rows` + pickle for
D = 4 data-parallel ranks (the actor's token-balanced plan). Three ways: every id int16 and padded to
[B, T, L, K] (`Rollouts.to_padded`), compact_routes' ids (int8 for up to 128 experts) padded, and those
packed by sample without padding (`pack_routes=True`, `data.batch.PackedRoutes`: what the trainer does).

Then, for the shape's preset layout (TP with sequence parallelism x PP), what each rank of DP rank 0
receives of the share's routes and keeps for the step: `routing.replay_routes` on that rank's microbatch
layouts, sequence-parallel slice and stage's MoE layers (Actor.distribute under R3: the share group's
leader cuts each peer's), against the routes of the packed share (what each peer received before), and
the time the leader's cuts for all its peers take against rank 0's selecting and pickling of that share.

Writes bench/results/route_bytes.json. Run: python bench/route_bytes.py  (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import sys
import time
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


def step(layers: int, topk: int, experts: int, widen: bool, packed: bool):
    """(the samples' route bytes, the step's TrainBatch): routes padded to [B, T, L, K] (Rollouts.to_padded) or
    packed by sample (Rollouts.to_padded(pack_routes=True), the trainer's)."""
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
    return sample_bytes, train_batch_from_rollouts(rollouts.to_padded(pack_routes=packed), torch.zeros(SEQUENCES))


def share_bytes(batch) -> list[int]:
    from megatron_rl.actor.distribute import select_rows
    from megatron_rl.actor.microbatches import plan_step

    plan = plan_step(batch.lengths().tolist(), mini_batches=1, dp_size=DP, max_tokens_per_microbatch=TOKENS_PER_MICROBATCH,
                     pack_sequences=True)
    rows = [sorted(r for mb in plan[0][d] for r in mb.rows if r >= 0) for d in range(DP)]
    return [len(pickle.dumps(select_rows(batch, share))) for share in rows]


def held_per_rank(batch, layers: int, topk: int, experts: int, tp: int, pp: int) -> dict:
    """What each (TP, PP) rank of DP rank 0 keeps of its share's engine routes (R3), as Actor.distribute cuts them."""
    from functools import partial

    from megatron_rl.actor.distribute import select_rows
    from megatron_rl.actor.packing import microbatch_layout
    from megatron_rl.actor.microbatches import plan_step, rank_microbatches
    from megatron_rl.actor.routing import local_tokens, replay_routes
    import megatron_rl.models.attention  # noqa: F401  (the packed layouts' import of megatron-core: outside the timing)

    plan = plan_step(batch.lengths().tolist(), mini_batches=1, dp_size=DP, max_tokens_per_microbatch=TOKENS_PER_MICROBATCH,
                     width_multiple=tp, pack_sequences=True)
    share = select_rows(batch, sorted(r for mb in plan[0][0] for r in mb.rows if r >= 0))
    lengths = share.lengths()
    microbatches = rank_microbatches(plan[0][0], share.row_ids.tolist())
    held, cut_s = [], []
    for stage in range(pp):  # megatron's even split of the decoder layers (every layer is MoE in both shapes)
        layer_ids = range(stage * layers // pp, (stage + 1) * layers // pp)
        for tp_rank in range(tp):
            local = partial(local_tokens, tp_rank=tp_rank, tp_size=tp, sequence_parallel=tp > 1)
            start = time.perf_counter()
            routes = replay_routes(share.routed_experts, (microbatch_layout(mb, lengths, multiple=tp) for mb in microbatches),
                                   lengths, batch_shape=(share.batch_size, share.seq_len), layer_ids=layer_ids, local=local,
                                   num_moe_layers=layers, topk=topk, num_experts=experts)
            cut_s.append(time.perf_counter() - start)
            held.append(routes.nbytes)
    # the leader's work for its peers against rank 0's for the same share (select its rows, pickle them): best of 3
    pickle_s = min(_timed(lambda: pickle.dumps(select_rows(batch, share.row_ids.tolist()))) for _ in range(3))
    received = share.routed_experts.nbytes
    return {"tp": tp, "pp": pp, "share_routes_bytes": received, "held_bytes_per_rank": held,
            "max_held_over_share": max(held) / received,
            "leader_cut_over_rank0_pickle": sum(cut_s) / pickle_s}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


VARIANTS = {  # label: (every id int16, routes packed by sample)
    "int16_padded": (True, False),
    "compact_padded": (False, False),
    "compact_packed": (False, True),
}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    result = {}
    for name, (layers, topk, experts) in SHAPES.items():
        out = {}
        for label, (widen, packed) in VARIANTS.items():
            sample_bytes, batch = step(layers, topk, experts, widen, packed)
            shares = share_bytes(batch)
            routes = batch.routed_experts
            out[label] = {"dtype": str((routes.values if packed else routes).dtype).removeprefix("torch."),
                          "sample_routes_bytes": sample_bytes, "rank0_routes_bytes": routes.nbytes,
                          "share_pickle_bytes": shares, "max_share_bytes": max(shares)}
        for label in ("compact_padded", "compact_packed"):
            out[f"{label}_over_int16_padded"] = {
                key: out[label][key] / out["int16_padded"][key] for key in ("rank0_routes_bytes", "max_share_bytes")}
        preset, tp, pp = LAYOUTS[name]
        out["held"] = {"preset": preset, **held_per_rank(step(layers, topk, experts, False, True)[1], layers, topk, experts, tp, pp)}
        result[name] = {"moe_layers": layers, "topk": topk, "experts": experts, **out}
        mib = {label: (out[label]["rank0_routes_bytes"] / 2**20, out[label]["max_share_bytes"] / 2**20) for label in VARIANTS}
        print(f"{name}: rank 0's routes / largest share, MiB: " + "; ".join(f"{label} {a:.1f} / {b:.1f}" for label, (a, b) in mib.items())
              + f"; held per rank at TP{tp} x PP{pp}: {max(out['held']['held_bytes_per_rank']) / 2**20:.2f} MiB of the share's "
              f"{out['held']['share_routes_bytes'] / 2**20:.1f} (x{out['held']['max_held_over_share']:.3f}); the leader's cuts for "
              f"its {tp * pp} ranks take x{out['held']['leader_cut_over_rank0_pickle']:.2f} rank 0's pickling of the share", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "what": "bytes of R3's engine routes: the samples', rank 0's in the step's batch and the pickled share of each of "
                f"{DP} DP ranks; int16 ids padded to [B, T, L, K], compact_routes' ids padded, compact ids packed by sample "
                "(the trainer's); held: what each TP x PP rank of DP rank 0 receives and keeps for the step "
                "(routing.replay_routes) against the routes of the packed share",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "step": {"sequences": SEQUENCES, "max_len": MAX_LEN, "prompt": PROMPT, "lengths": "log-normal, median a quarter of max"},
        "shapes": result,
    }, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
