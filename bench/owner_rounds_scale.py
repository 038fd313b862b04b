"""What an engine worker holds during an owner-parallel push at 256 senders, simulated on Qwen3-235B-A22B's parameters.

    python bench/owner_rounds_scale.py        # writes bench/results/owner_rounds.json

The megatron parameter list of Qwen3-235B-A22B (94 layers, 128 experts of 4096 x 1536, bf16, about 470 GB) on
TP4 x PP4 x EP (32 or 64) over 256 ranks, with the owners `assign_owners` gives, cut into 512 MiB buckets two
ways: `owner_rounds` (the push's rounds) and every owner's r-th bucket of the whole model (how rounds were cut
before). A worker receives each round in slices of 4 buckets (OwnerIpcRelay / the broadcast's max_parts) and
keeps each bucket until every vLLM module it holds a tensor of is complete (vLLM's layerwise reload: the
attention's fused qkv and a layer's experts are one module each, every other tensor its own). Reported per
plan: the most bytes a worker keeps at once, the rounds, and `plan_seconds`, the host time of the owners' assignment
and rounds (every rank's part of `owner_plan`, made once per run by the pusher; it was made at every push). No
process group, no model: pure bookkeeping on names and shapes, which is all the plan itself reads.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_rl.models.export import _buckets, _order_key  # noqa: E402
from megatron_rl.models.export_owners import _Param, assign_owners, owner_rounds  # noqa: E402

TP, PP, WORLD = 4, 4, 256
BUCKET = 512 << 20
HIDDEN, EXPERTS, FFN, VOCAB, LAYERS = 4096, 128, 1536, 151936, 94
STAGE_LAYERS = [24, 24, 23, 23]
SLICE = 4


def parameters(ep: int) -> list[_Param]:
    dp, edp = WORLD // (TP * PP), WORLD // (ep * PP)
    first = [sum(STAGE_LAYERS[:i]) for i in range(PP)]
    params = []

    def dense(name, shape, stage, split=True):
        param = _Param(name, TP if split else 1, shape, "bfloat16")
        for d in range(dp):
            if split:
                param.rows[d] = {t: t + TP * d + TP * dp * stage for t in range(TP)}
            else:
                for t in range(TP):
                    rank = t + TP * d + TP * dp * stage
                    param.rows[rank] = {0: rank}
        params.append(param)

    dense("embedding.word_embeddings.weight", (VOCAB // TP, HIDDEN), 0)
    dense("output_layer.weight", (VOCAB // TP, HIDDEN), PP - 1)
    dense("decoder.final_layernorm.weight", (HIDDEN,), PP - 1, split=False)
    for layer in range(LAYERS):
        stage = max(i for i in range(PP) if first[i] <= layer)
        pre = f"decoder.layers.{layer}."
        dense(pre + "self_attention.linear_qkv.weight", ((8192 + 1024) // TP, HIDDEN), stage)
        dense(pre + "self_attention.linear_proj.weight", (HIDDEN, 8192 // TP), stage)
        for norm, width in (("self_attention.linear_qkv.layer_norm_weight", HIDDEN), ("self_attention.q_layernorm.weight", 128),
                            ("self_attention.k_layernorm.weight", 128), ("pre_mlp_layernorm.weight", HIDDEN)):
            dense(pre + norm, (width,), stage, split=False)
        dense(pre + "mlp.router.weight", (EXPERTS, HIDDEN), stage, split=False)
        for e in range(EXPERTS):
            for fc, shape in (("linear_fc1", (2 * FFN, HIDDEN)), ("linear_fc2", (HIDDEN, FFN))):
                param = _Param(pre + f"mlp.experts.local_experts.{e}.{fc}.weight", 1, shape, "bfloat16")
                for d in range(edp):
                    param.rows[d] = {0: e // (EXPERTS // ep) + ep * d + ep * edp * stage}
                params.append(param)
    params.sort(key=lambda p: _order_key(p.name))
    return params


def module(name: str) -> str:
    """The vLLM module a megatron parameter loads into (completed together by the layerwise reload)."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not match:
        return name
    layer, rest = match.groups()
    if rest.startswith("mlp.experts"):
        return f"{layer}.experts"
    return f"{layer}.qkv" if rest == "self_attention.linear_qkv.weight" else name


def most_held(rounds) -> int:
    need: dict[str, int] = {}
    for parts in rounds:
        for _, bucket in parts:
            for param in bucket:
                need[module(param.name)] = need.get(module(param.name), 0) + 1
    have: dict[str, int] = {}
    kept, most = [], 0
    for parts in rounds:
        for start in range(0, len(parts), SLICE):
            for _, bucket in parts[start : start + SLICE]:
                modules = {module(p.name) for p in bucket}
                for param in bucket:
                    have[module(param.name)] = have.get(module(param.name), 0) + 1
                kept.append((sum(p.nbytes for p in bucket), modules))
            most = max(most, sum(size for size, _ in kept))
            kept = [(size, mods) for size, mods in kept if any(have[m] < need[m] for m in mods)]
    return most


def main() -> None:
    results = []
    for ep in (32, 64):
        start = time.perf_counter()
        params = parameters(ep)
        planning = time.perf_counter()  # what every rank computes in models.export_owners.owner_plan, once per run
        assign_owners(params, WORLD)
        layered = owner_rounds(params, BUCKET)
        plan_seconds = time.perf_counter() - planning
        per_owner = {o: _buckets([p for p in params if p.owner == o], BUCKET) for o in sorted({p.owner for p in params})}
        whole = [[(o, b[r]) for o, b in per_owner.items() if r < len(b)] for r in range(max(len(b) for b in per_owner.values()))]
        row = {
            "layout": f"TP{TP} x PP{PP} x EP{ep}, {WORLD} ranks", "model_bytes": sum(p.nbytes for p in params),
            "senders": len(per_owner), "bucket_bytes": BUCKET,
            "owner_rounds": {"rounds": len(layered), "worker_most_held_bytes": most_held(layered)},
            "rth_bucket_of_the_model": {"rounds": len(whole), "worker_most_held_bytes": most_held(whole)},
            "funnel_model_order": {"worker_most_held_bytes": most_held([[(0, b)] for b in _buckets(params, BUCKET)])},
            "plan_seconds": plan_seconds,
            "seconds": time.perf_counter() - start,
        }
        print(json.dumps(row))
        results.append(row)
    out = ROOT / "bench" / "results" / "owner_rounds.json"
    out.write_text(json.dumps({"qwen3_235b_a22b": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
