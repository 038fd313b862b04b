"""Weight pushes at scale, measured: funnel vs owner-parallel senders, and sparse deltas over real training steps.

    python bench/weight_sync_scale.py                 # adds both parts to bench/results/weight_sync.json
    python bench/weight_sync_scale.py --parts delta   # one of them
    python bench/weight_sync_scale.py --readme        # the README's table, from the JSON

- `owner_parallel`: megatron-core's tiny Qwen3-MoE on 1, 2 and 4 trainer
  ranks (layouts 1, EP2, PP2 x EP2: 1, 2 and 4 senders) pushed into 2 engines
  of 2 worker-extension processes each (tests/worker_process.py: the worker
  extension vLLM's workers run, over a torch module) over gloo, twice per
  layout in one run: the funnel (models.export_hf_weights through rank 0, one
  broadcast group, weight_sync.push) and owner-parallel (models.export_owners,
  weight_sync.parallel). Per trainer rank: bytes sent to the engines and bytes
  received from other trainer ranks; wall time of the push (fastest of REPEATS).
- `delta`: the demo (megatron_rl.demo: tiny Qwen3-MoE, format warm-up, GSPO
  with configs/tiny-gspo.yaml) trained for STEPS steps; after each step's push
  the trainer's weights are exported, cast to bf16 (the wire dtype on GPUs)
  and encoded by weight_sync.delta.DeltaEncoder against the previous step's:
  wire bytes of the delta vs the full push, and the fraction of bf16 values
  that changed. Run at the demo's lr (1e-3) and at 1e-5.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REPEATS = 3
STEPS = 20
WORKERS = [2, 2]
BUCKET_BYTES = 64 << 10
LAYOUTS = {1: {}, 2: {"expert_parallel": 2}, 4: {"pipeline_parallel": 2, "expert_parallel": 2}}


# ---- owner-parallel vs funnel ---------------------------------------------------------------------------------
def _funnel(chunks, ctx, targets, manifest, sender, version: int) -> dict:
    """One push through rank 0 (models.export_hf_weights + weight_sync.push with the broadcast group)."""
    import torch.distributed as dist

    from megatron_rl.models.export import export_hf_weights
    from megatron_rl.weight_sync.push import stream_push
    from megatron_rl.weight_sync.stream import as_weight_stream

    export = export_hf_weights(chunks, ctx, bucket_bytes=BUCKET_BYTES)
    begin = time.perf_counter()
    if targets is not None:
        stream_push(targets, as_weight_stream(export), version, manifest=manifest, sender=lambda: sender, repack_moe=False)
    else:
        for _ in export:
            pass
    dist.barrier()
    return {"seconds": time.perf_counter() - begin}


def _scale_rank(rank: int, world_size: int, model_dir: str, addresses: list) -> dict:
    import torch.distributed as dist

    from tests.worker_process import TcpEngine

    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models import build_model, load_hf_config, model_shape
    from megatron_rl.models.export_owners import export_owned_weights
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.weight_sync import manifest_from_checkpoint
    from megatron_rl.weight_sync.broadcast import BroadcastSender
    from megatron_rl.weight_sync.parallel import OwnerSenders, owner_parallel_push

    ctx = init_parallel(ParallelConfig(**LAYOUTS[world_size]), shape=model_shape(load_hf_config(model_dir)))
    targets = [TcpEngine(a).target(f"engine {i}") for i, a in enumerate(addresses)] if rank == 0 else None
    manifest = manifest_from_checkpoint(model_dir) if rank == 0 else None
    senders = OwnerSenders("gloo", "127.0.0.1", timeout_s=120.0)
    funnel = BroadcastSender("gloo", "127.0.0.1", timeout_s=120.0) if rank == 0 else None
    out: dict = {"funnel_s": [], "owner_s": []}
    try:
        chunks = build_model(ModelConfig(path=model_dir), ctx)
        if rank == 0:
            funnel.connect([lambda info, t=t: t.call_each("mrl_broadcast_join", info) for t in targets], WORKERS)
        for version in range(1, REPEATS + 1):
            out["funnel_s"].append(_funnel(chunks, ctx, targets, manifest, funnel, 2 * version)["seconds"])
            export = export_owned_weights(chunks, ctx, bucket_bytes=BUCKET_BYTES)
            begin = time.perf_counter()
            owner_parallel_push(targets, export, 2 * version + 1, senders=senders, rank=rank, trainer_group=ctx.world_group,
                                manifest=manifest, workers_per_engine=WORKERS, repack_moe=False)
            dist.barrier()
            out["owner_s"].append(time.perf_counter() - begin)
        out.update(senders=export.senders, owned=export.stats.owned, peer_in=export.stats.peer_in,
                   peer_out=export.stats.peer_out, held=sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()))
        if rank == 0:
            out["model_bytes"] = sum(n * 4 for n in (_numel(s) for s in manifest.shapes.values()))
    finally:
        senders.shutdown()
        if funnel is not None:
            funnel.shutdown()
        destroy_parallel(ctx)
    return out


def _numel(shape) -> int:
    total = 1
    for d in shape:
        total *= d
    return total


def _busiest_ratio(funnel_sent: list, funnel_received: list, results: list) -> float:
    """Bytes through the busiest rank (sent to engines + received from ranks), owner-parallel over funnel."""
    owner = max(r["owned"] + r["peer_in"] for r in results)
    return owner / max(s + r for s, r in zip(funnel_sent, funnel_received))


def measure_owner_parallel() -> dict:
    from megatron_rl.models.tiny import make_tiny_model_dir
    from tests.distributed.harness import _context, run_distributed
    from tests.worker_process import TcpWorkers

    model_dir = make_tiny_model_dir(Path(tempfile.mkdtemp()) / "m", "qwen3_moe", seed=1, with_tokenizer=False)
    context = _context()
    rows = []
    for world in LAYOUTS:
        workers = TcpWorkers(model_dir, WORKERS, context)
        try:
            results = run_distributed(_scale_rank, world, str(model_dir), workers.addresses, timeout=600)
        finally:
            workers.close()
        model = results[0]["model_bytes"]
        # funnel: rank 0 sends the whole model to the engines and receives every shard it does not hold itself
        funnel_sent = [model if r == 0 else 0 for r in range(world)]
        funnel_received = [model - results[0]["held"] if world > 1 else 0] + [0] * (world - 1)
        funnel_s, owner_s = min(results[0]["funnel_s"]), min(results[0]["owner_s"])
        rows.append({
            "trainer_ranks": world, "layout": LAYOUTS[world] or {"single": 1}, "senders": len(results[0]["senders"]),
            "model_bytes": model, "bucket_bytes": BUCKET_BYTES, "engines": len(WORKERS), "workers_per_engine": WORKERS,
            "funnel": {"sent_to_engines_per_rank": funnel_sent, "received_from_ranks_per_rank": funnel_received,
                       "seconds": funnel_s},
            "owner_parallel": {"sent_to_engines_per_rank": [r["owned"] for r in results],
                               "received_from_ranks_per_rank": [r["peer_in"] for r in results], "seconds": owner_s},
            "busiest_rank_bytes_ratio": _busiest_ratio(funnel_sent, funnel_received, results),
            "time_ratio_owner_over_funnel": owner_s / funnel_s,
        })
        print(json.dumps(rows[-1]), flush=True)
    return {"note": "funnel's per-rank bytes are the model (rank 0's sends) and the shards rank 0 does not hold "
                    "(its receives), by construction of models.export_hf_weights; owner-parallel's are counted while "
                    "pushing (models.export_owners.SendStats). fp32 tiny model, 2 shared CPU cores: times are gloo "
                    "on loopback, not a network.", "rows": rows}


# ---- delta over real steps ------------------------------------------------------------------------------------
def measure_delta(lr: float, out_dir: Path) -> dict:
    import torch

    from megatron_rl import demo, trainer
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.weight_sync.buckets import tensor_bytes
    from megatron_rl.weight_sync.delta import DeltaEncoder, _bits

    model_dir = out_dir / "model"
    cfg = load_config(RLConfig, demo.PRESET, [f"model.path={model_dir}", f"logging.dir={out_dir}", f"train.steps={STEPS}",
                                              f"checkpoint.dir={out_dir / 'ckpt'}", "train.stop_at_reward=0",
                                              f"optimizer.lr={lr}", "checkpoint.save_every=0"])
    make_tiny_model_dir(model_dir, "qwen3_moe", seed=0)
    demo.warm_up_format(model_dir, cfg.data.path)
    encoder, steps = DeltaEncoder(full_every=10**9), []
    original = trainer.Trainer._sync_weights

    def sync_and_measure(self, version: int) -> dict[str, float]:
        pushed = original(self, version)
        bucket = [(n, t.to(torch.bfloat16)) for b in self.actor.export_hf_weights(64 << 20) for n, t in b]
        full = sum(tensor_bytes(t) for _, t in bucket)
        had_base = encoder.base is not None
        changed = sum(int((_bits(encoder.held[n]) != _bits(t)).sum()) for n, t in bucket if n in encoder.held)
        wire, meta = encoder.encode(bucket, delta=True)
        sparse = sum(1 for m in meta.values() if m["kind"] == "sparse")
        encoder.commit(version, delta=had_base)
        if had_base:
            steps.append({"version": version, "full_bytes": full, "delta_bytes": sum(tensor_bytes(t) for _, t in wire),
                          "changed_values": changed, "values": full // 2, "sparse_tensors": sparse,
                          "tensors": len(meta)})
        return pushed

    trainer.Trainer._sync_weights = sync_and_measure
    try:
        trainer.run(cfg)
    finally:
        trainer.Trainer._sync_weights = original
    full, delta = sum(s["full_bytes"] for s in steps), sum(s["delta_bytes"] for s in steps)
    return {"lr": lr, "pushes": len(steps), "full_bytes": full, "delta_bytes": delta, "saved_fraction": 1 - delta / full,
            "changed_value_fraction_mean": sum(s["changed_values"] / s["values"] for s in steps) / len(steps),
            "steps": steps}


def readme_table(result: dict) -> str:
    """The README's table of these measurements (markdown), from bench/results/weight_sync.json."""
    lines = ["| what | funnel (rank 0) | owner-parallel | bytes through the busiest rank, owner / funnel | push time, owner / funnel |",
             "| --- | --- | --- | --- | --- |"]
    for row in result.get("owner_parallel", {}).get("rows", []):
        funnel, owner = row["funnel"], row["owner_parallel"]
        per_rank = " / ".join(f"{b / 1e3:.0f}" for b in owner["sent_to_engines_per_rank"])
        lines.append(
            f"| {row['trainer_ranks']} trainer rank(s), {row['senders']} sender(s), {row['model_bytes'] / 1e6:.2f} MB model, "
            f"2 engines x 2 workers | rank 0 sends {funnel['sent_to_engines_per_rank'][0] / 1e3:.0f} kB, receives "
            f"{funnel['received_from_ranks_per_rank'][0] / 1e3:.0f} kB; {funnel['seconds'] * 1e3:.0f} ms | kB sent per rank "
            f"{per_rank}, received {max(owner['received_from_ranks_per_rank']) / 1e3:.0f} kB at most; "
            f"{owner['seconds'] * 1e3:.0f} ms | {row['busiest_rank_bytes_ratio']:.2f}x | {row['time_ratio_owner_over_funnel']:.2f}x |")
    delta = result.get("delta")
    if delta:
        lines += ["", "| sparse delta, bf16 wire, demo model | pushes | bf16 values changed per push (mean) | "
                      "delta bytes / full bytes |", "| --- | --- | --- | --- |"]
        for run in delta["runs"]:
            lines.append(f"| {delta['steps']} GSPO steps at lr {run['lr']:g} | {run['pushes']} | "
                         f"{100 * run['changed_value_fraction_mean']:.1f}% | {run['delta_bytes'] / run['full_bytes']:.3f} "
                         f"({100 * run['saved_fraction']:.1f}% saved) |")
    return "\n".join(lines)


def main() -> None:
    import argparse

    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("WANDB_MODE", "offline"),
                       ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="*", default=["owner_parallel", "delta"], choices=["owner_parallel", "delta"])
    parser.add_argument("--lrs", nargs="*", type=float, default=[1e-3, 1e-5])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "weight_sync.json"))
    parser.add_argument("--readme", action="store_true", help="print the README's table from --out and stop")
    args = parser.parse_args()
    out = Path(args.out)
    if args.readme:
        print(readme_table(json.loads(out.read_text())))
        return
    result = json.loads(out.read_text()) if out.exists() else {}
    if "owner_parallel" in args.parts:
        result["owner_parallel"] = measure_owner_parallel()
        out.write_text(json.dumps(result, indent=1) + "\n")
    if "delta" in args.parts:
        runs = []
        for lr in args.lrs:
            runs.append(measure_delta(lr, Path(tempfile.mkdtemp(prefix="delta-"))))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "steps"}), flush=True)
        result["delta"] = {"model": "the demo's tiny Qwen3-MoE (configs/tiny-gspo.yaml), bf16 wire dtype",
                           "steps": STEPS, "runs": runs}
        out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
