"""Evaluation throughput on CPU: prompts/s and tokens/s for k = 1, 8, 32, in-process engine vs one vLLM server.

    python bench/eval.py                   # writes bench/results/eval.json

Model: the demo's (make demo): the tiny Qwen3-MoE (2 layers, hidden 64, 8
experts top-2, fp32) after the demo's answer-format warm-up, so that it answers
with a letter and EOS as the demo's model does before RL. Set: 64 prompts of
synthetic:first_letter8 (the demo's task), the `exact` reward, the
configs/tiny-gspo.yaml engine settings, the eval-set defaults (temperature
0.6, top-p 0.95) and the preset's response budget (8 tokens).

One evaluation = megatron_rl.evaluation.Evaluator.evaluate, exactly what the
trainer and `megatron-rl eval` run: one generate() of every prompt x k, the
reward of every sample, the maj@k vote, the aggregation. Each k is evaluated
REPEATS times after a warm-up; prompts/s = prompts / the fastest whole
evaluation, tokens/s = response tokens / the fastest generate() (other
processes on a shared machine only ever add time; medians are reported too).
The server is one `vllm.entrypoints.openai.api_server` process on the same
model (VLLMServer), driven over HTTP by VLLMServerEngine; its scores are
checked against the in-process engine's (same seeds).

Then the README's example: the demo (`python -m megatron_rl.demo`) with the
64-prompt set at k = 8 evaluated before training, every 50 steps and after the
last one (its console tables are kept), and `megatron-rl eval` on the run's
last checkpoint, whose step_<n>.json is compared with the run's.
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

PROMPTS, KS, REPEATS = 64, (1, 8, 32), 5
TASK = f"synthetic:first_letter8:{PROMPTS}:7"


def measure(engine, evaluators: dict) -> dict:
    """{k: numbers} for one engine; the last report of each k is kept for the score check."""
    out = {}
    for k, evaluator in evaluators.items():
        evaluator.evaluate(engine, 0)  # warm-up
        totals, generates, report = [], [], None
        for _ in range(REPEATS):
            start = time.perf_counter()
            report = evaluator.evaluate(engine, 0)
            totals.append(time.perf_counter() - start)
            generates.append(report.sets[0].generate_s)
        results = report.sets[0].results
        tokens = sum(sum(r.lengths) for r in results)
        out[k] = {
            "samples": PROMPTS * k,
            "response_tokens": tokens,
            "evaluate_s": [round(t, 3) for t in totals],
            "generate_s": [round(t, 3) for t in generates],
            "prompts_per_s": round(PROMPTS / min(totals), 1),
            "prompts_per_s_median": round(PROMPTS / statistics.median(totals), 1),
            "tokens_per_s": round(tokens / min(generates), 1),
            "tokens_per_s_median": round(tokens / statistics.median(generates), 1),
            "scoring_share_of_evaluate": round(1 - min(generates) / min(totals), 3),
            "scores": {key: round(value, 4) for key, value in report.sets[0].metrics.items()},
            "_report": report,
        }
    return out


def demo_run() -> dict:
    """The demo with the set evaluated along the run, then `megatron-rl eval` on its last checkpoint."""
    import subprocess

    sets = f"data.eval_sets={{letters: {{path: '{TASK}', k: 8}}}}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "demo"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        start = time.perf_counter()
        demo = subprocess.run([sys.executable, "-m", "megatron_rl.demo", "--out", str(out), sets, "train.eval_every=50",
                               "logging.progress_bar=false"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        demo_s = time.perf_counter() - start
        last = max(int(p.stem.removeprefix("step_")) for p in (out / "eval").glob("step_*.json"))
        start = time.perf_counter()
        cli = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "eval", "--config", str(ROOT / "configs" / "tiny-gspo.yaml"),
                              f"checkpoint.load={out / 'checkpoints'}", sets, f"logging.dir={Path(tmp) / 'cli'}"],
                             cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        cli_s = time.perf_counter() - start
        strip = lambda path: {n: {k: v for k, v in s.items() if k != "generate_s"} for n, s in json.loads(path.read_text())["sets"].items()}  # noqa: E731
        same = strip(out / "eval" / f"step_{last}.json") == strip(Path(tmp) / "cli" / "eval" / f"step_{last}.json")
    keep = lambda text: [line for line in text.splitlines() if line.startswith(("evaluation at", "set ", "letters", "[demo] mean"))]  # noqa: E731
    return {"demo_console": keep(demo.stdout), "demo_s": round(demo_s, 1), "eval_command_console": keep(cli.stdout),
            "eval_command_s": round(cli_s, 1), "eval_command_json_equals_the_run_s": same, "last_step": last}


def main() -> None:
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.demo import PRESET, warm_up_format
    from megatron_rl.evaluation import Evaluator
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.rollout import VLLMEngine, VLLMServer, VLLMServerEngine

    load_start = os.getloadavg()[0]
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "tiny-moe", "qwen3_moe", seed=0)
        warm_up_format(model_dir, TASK)
        cfg = {k: load_config(RLConfig, PRESET, [f"model.path={model_dir}", f"data.eval_sets={{letters: {{path: '{TASK}', k: {k}}}}}"]) for k in KS}
        tokenizer = load_tokenizer(model_dir)
        evaluators = {k: Evaluator.from_config(cfg[k], tokenizer) for k in KS}
        rollout = cfg[KS[0]].rollout

        start = time.perf_counter()
        engine = VLLMEngine(model_dir, rollout)
        results["in_process"] = {"engine_start_s": round(time.perf_counter() - start, 2), "by_k": measure(engine, evaluators)}
        engine.shutdown()

        start = time.perf_counter()
        server = VLLMServer(model_dir, rollout, seed=cfg[KS[0]].train.seed, log_path=Path(tmp) / "server.log").start()
        engine = VLLMServerEngine([server], rollout, model_dir=model_dir)
        try:
            results["one_server"] = {"engine_start_s": round(time.perf_counter() - start, 2), "by_k": measure(engine, evaluators)}
        finally:
            engine.shutdown()
            server.stop()

    tables = {}
    for where in ("in_process", "one_server"):
        for k, numbers in results[where]["by_k"].items():
            report = numbers.pop("_report")
            tables[f"{where} k={k}"] = report.table()
    for k in KS:
        inproc, served = results["in_process"]["by_k"][k], results["one_server"]["by_k"][k]
        served["same_scores_as_in_process"] = inproc["scores"] == served["scores"]
    result = {
        "device": "cpu",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "load_average_1min_at_start_and_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "model": "the demo's tiny qwen3_moe (2 layers, hidden 64, 8 experts top-2, fp32) after its answer-format warm-up",
        "set": {"task": TASK, "prompts": PROMPTS, "reward": "exact", "temperature": 0.6, "top_p": 0.95, "max_new_tokens": rollout.max_new_tokens},
        "repeats": REPEATS,
        **results,
        "tables": tables,
    }
    result["demo_run"] = demo_run()
    out = ROOT / "bench" / "results" / "eval.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    for name, table in tables.items():
        print(f"[{name}]\n{table}\n")
    print(json.dumps({w: {k: {m: v for m, v in n.items() if m.endswith("_per_s")} for k, n in results[w]["by_k"].items()} for w in ("in_process", "one_server")}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
