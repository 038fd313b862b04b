"""The actor's share of an RL step with the old policy from a forward of its own vs from the training forward.

One Qwen3-MoE-shaped model (megatron-core, local spec, one CPU process, float32, the packing benchmark's
shape) and one batch of long-tailed sequences, packed. Two actors built from the same weights run the
trainer's calls on it, interleaved, REPEATS times: `Actor.distribute`, `prepare_batch`, `train_step`
(Adam), with 1 and with 4 optimizer steps per RL step (the large presets' train.mini_batches_per_step).
`train.old_logprobs=forward` runs the old-policy forward over every row in prepare_batch;
`training_forward` takes the first mini-batch's from its training forward (the weights it runs at are
the old policy's) and runs the forward over the other mini-batches' rows only (none with one).
Reported: the minimum over repeats of prepare_batch, train_step and their sum for each, the ratio of
the sums, and the first repeat's loss and gradient norm of both (they train the same step).

Writes bench/results/old_logprobs.json. Run: python bench/old_logprobs.py  (under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "old_logprobs.json"

from bench.packing import MODEL, make_batch, model_in  # noqa: E402  (the packing benchmark's model and lengths)

B, MAX_LEN, BUDGET, REPEATS = 32, 512, 4096, 7
SOURCES = ("forward", "training_forward")


def measure(model_dir: str, mini_batches: int) -> dict:
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(), shape=model_shape(load_hf_config(model_dir)))
    batch = make_batch(B, MAX_LEN, 0, 256)
    actors, times, first = {}, {s: {"prepare_s": [], "train_s": [], "step_s": []} for s in SOURCES}, {}
    try:
        for source in SOURCES:
            actors[source] = Actor(ctx, model=ModelConfig(path=model_dir), optimizer=OptimizerConfig(lr=1e-6),
                                   train=TrainConfig(max_tokens_per_microbatch=BUDGET, pack_sequences=True, old_logprobs=source,
                                                     prompts_per_step=B, mini_batches_per_step=mini_batches),
                                   algorithm=AlgorithmConfig(loss="gspo"))
        for repeat in range(REPEATS + 1):  # the first is a warm-up (lazy initialisation, optimizer state): not timed
            for source, actor in actors.items():
                start = time.perf_counter()
                share, _ = actor.prepare_batch(actor.distribute(batch))
                prepared = time.perf_counter()
                metrics = actor.train_step(share)
                done = time.perf_counter()
                if repeat == 0:
                    first[source] = {"loss/sum": metrics["loss/sum"], "grad_norm": metrics["grad_norm"],
                                     "source": actor.old_logprobs_from}
                    continue
                times[source]["prepare_s"].append(prepared - start)
                times[source]["train_s"].append(done - prepared)
                times[source]["step_s"].append(done - start)
    finally:
        for actor in actors.values():
            actor.close()
        destroy_parallel(ctx)
    out = {source: {key: min(values) for key, values in phases.items()} for source, phases in times.items()}
    out["training_forward_over_forward_step_s"] = out["training_forward"]["step_s"] / out["forward"]["step_s"]
    out["first_step"] = first
    out["real_tokens"] = int(batch.sequence_lengths.sum())
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_in(tmp)
        result = {f"mini_batches_{m}": measure(model_dir, m) for m in (1, 4)}
    for key, r in result.items():
        f, o = r["forward"], r["training_forward"]
        print(f"{key}: forward: prepare {f['prepare_s']:.2f} s + train {f['train_s']:.2f} s = {f['step_s']:.2f} s; "
              f"training_forward: prepare {o['prepare_s']:.2f} s + train {o['train_s']:.2f} s = {o['step_s']:.2f} s; "
              f"x{r['training_forward_over_forward_step_s']:.3f} the time", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "what": "prepare_batch + train_step seconds with the old policy from a forward of its own vs from the training "
                "forward (train.old_logprobs), the same model, batch and weights; minimum over interleaved repeats",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": 1, "torch": torch.__version__},
        "model": MODEL,
        "batch": {"sequences": B, "max_len": MAX_LEN, "budget_tokens": BUDGET, "packed": True, "repeats": REPEATS},
        **result,
    }, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
