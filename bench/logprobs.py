"""Peak memory and time of vocab-parallel logprobs vs gather + log_softmax (CPU, gloo).

    python bench/logprobs.py            # writes bench/results/logprobs.json

Each TP rank holds logits [N, V / TP] = h @ W_shard^T (h [N, 256] requires grad,
as a model's last hidden states do). Two ways to score the sampled tokens, in
the same processes, on the same logits:

* ours: megatron_rl.actor.logprobs.vocab_parallel_logprobs (two all-reduces of
  O(N) statistics, float32 work in row chunks, gradient written in place), with
  the entropy (as the actor's training forward computes it) and without;
* naive: all_gather the shards into [N, V], log_softmax(logits.float() / T), gather.

Peak memory is what the CPU allocator reports to torch's profiler
(profile_memory=True: the running "Total Allocated" of every allocation made
inside the measured region), plus the logits shard that exists before it, as a
multiple of the logits shard's bytes: "forward" scores the tokens (and their
entropy, for ours) without grad; "forward+backward" also backpropagates to h.
Goal: ours <= 1.5 x the shard. Time: median of a few repeats, max over ranks
(the 1-minute load average before and after the run is recorded: on a shared
machine the times are only indicative; the memory ratios do not depend on load).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N_TOKENS, VOCAB, HIDDEN = 1024, 65536, 256
TEMPERATURE = 0.9
REPEATS = 3
CASES = [(1, "float32"), (2, "float32"), (2, "bfloat16")]


def _peak_bytes(fn) -> int:
    """Peak bytes allocated (CPU allocator) while fn runs, relative to the start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        events = json.load(open(fh.name))["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0)


def _rank(rank: int, world: int, port: int, dtype_name: str, out_file: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_rl.actor.logprobs import vocab_parallel_logprobs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtype = getattr(torch, dtype_name)
    shard = VOCAB // world
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N_TOKENS, HIDDEN, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.2).to(dtype)[rank * shard : (rank + 1) * shard].contiguous()
    targets = torch.randint(0, VOCAB, (N_TOKENS,), generator=g)
    group = dist.group.WORLD

    def ours(backward: bool):
        logits = hidden @ weight.t() if backward else (hidden @ weight.t()).detach()
        def run():
            lp, ent = vocab_parallel_logprobs(logits, targets, group=group, vocab_start=rank * shard,
                                              temperature=TEMPERATURE, with_entropy=True)
            if backward:
                (lp.sum() + 0.1 * ent.sum()).backward()
            return lp.detach()
        return logits, run

    def naive(backward: bool):
        logits = hidden @ weight.t() if backward else (hidden @ weight.t()).detach()
        def run():
            from torch.distributed.nn.functional import all_gather

            full = torch.cat(all_gather(logits, group=group), dim=-1) if world > 1 else logits
            logprobs = torch.log_softmax(full.float() / TEMPERATURE, dim=-1)
            lp = logprobs.gather(-1, targets[:, None]).squeeze(-1)
            if backward:
                lp.sum().backward()
            return lp.detach()
        return logits, run

    shard_bytes = N_TOKENS * shard * torch.empty((), dtype=dtype).element_size()
    result = {"shard_mib": shard_bytes / 2**20}
    values = {}
    def ours_no_entropy(backward: bool):
        logits = hidden @ weight.t() if backward else (hidden @ weight.t()).detach()
        def run():
            lp, _ = vocab_parallel_logprobs(logits, targets, group=group, vocab_start=rank * shard, temperature=TEMPERATURE)
            if backward:
                lp.sum().backward()
            return lp.detach()
        return logits, run

    for name, make in (("ours", ours), ("ours_no_entropy", ours_no_entropy), ("naive", naive)):
        for phase, backward in (("forward", False), ("forward+backward", True)):
            ctx = torch.enable_grad() if backward else torch.no_grad()
            with ctx:
                logits, run = make(backward)
                holder = {}
                peak = _peak_bytes(lambda holder=holder, run=run: holder.setdefault("lp", run()))
                values[(name, phase)] = holder["lp"]
                del logits, run
                hidden.grad = None
                times = []
                for _ in range(REPEATS):
                    logits, run = make(backward)
                    dist.barrier()
                    t0 = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - t0)
                    del logits, run
                    hidden.grad = None
            result[f"{name}/{phase}/peak_x_shard"] = (shard_bytes + peak) / shard_bytes
            result[f"{name}/{phase}/ms"] = statistics.median(times) * 1e3
    result["max_abs_diff"] = float((values[("ours", "forward")] - values[("naive", "forward")]).abs().max())
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_file, "w") as fh:
            json.dump(gathered, fh)
    dist.destroy_process_group()


def _run_case(world: int, dtype_name: str) -> dict:
    import torch.multiprocessing as mp

    from megatron_rl.ports import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out_file = str(Path(tmp) / "out.json")
        mp.start_processes(_rank, args=(world, free_port(), dtype_name, out_file), nprocs=world, start_method="spawn")
        per_rank = json.load(open(out_file))
    merged = {"tp": world, "dtype": dtype_name, "tokens": N_TOKENS, "vocab": VOCAB}
    for key in per_rank[0]:
        merged[key] = float(f"{max(r[key] for r in per_rank):.4g}")
    for phase in ("forward", "forward+backward"):
        merged[f"{phase}/time_ours_vs_naive"] = round(merged[f"ours/{phase}/ms"] / merged[f"naive/{phase}/ms"], 3)
        merged[f"{phase}/time_ours_no_entropy_vs_naive"] = round(merged[f"ours_no_entropy/{phase}/ms"] / merged[f"naive/{phase}/ms"], 3)
        merged[f"{phase}/memory_ours_vs_naive"] = round(merged[f"ours/{phase}/peak_x_shard"] / merged[f"naive/{phase}/peak_x_shard"], 3)
    return merged


def main() -> None:
    import torch

    load_before = os.getloadavg()[0]
    cases = [_run_case(world, dtype) for world, dtype in CASES]
    goal = 1.5
    report = {
        "device": "cpu",
        "cpus": os.cpu_count(),
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "what": f"logprobs (+ entropy for ours) of {N_TOKENS} sampled tokens, vocabulary {VOCAB}, temperature {TEMPERATURE}",
        "memory": "peak CPU-allocator bytes (torch profiler) + the logits shard, / the logits shard's bytes; max over TP ranks",
        "goal": f"ours <= {goal} x the logits shard",
        "goal_met": all(c[f"ours/{p}/peak_x_shard"] <= goal for c in cases for p in ("forward", "forward+backward")),
        "cases": cases,
    }
    out = ROOT / "bench" / "results" / "logprobs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for c in cases:
        print(f"TP{c['tp']} {c['dtype']:8s} shard {c['shard_mib']:.0f} MiB | peak x shard: ours fwd {c['ours/forward/peak_x_shard']:.2f} "
              f"fwd+bwd {c['ours/forward+backward/peak_x_shard']:.2f}, naive fwd {c['naive/forward/peak_x_shard']:.2f} "
              f"fwd+bwd {c['naive/forward+backward/peak_x_shard']:.2f} | time ours/naive fwd {c['forward/time_ours_vs_naive']:.2f} "
              f"fwd+bwd {c['forward+backward/time_ours_vs_naive']:.2f} (no entropy {c['forward/time_ours_no_entropy_vs_naive']:.2f}, "
              f"{c['forward+backward/time_ours_no_entropy_vs_naive']:.2f}) | max |diff| {c['max_abs_diff']:.1e}")
    print(f"wrote {out}; goal met: {report['goal_met']}")


if __name__ == "__main__":
    main()
