"""docs/quickstart.md's generated tables (tools/quickstart_tables.py) and the quickstart's results table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tables():
    spec = importlib.util.spec_from_file_location("quickstart_tables", REPO / "tools" / "quickstart_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_the_generated_one():
    tables = _tables()
    assert tables.PAGE.read_text(encoding="utf-8") == tables.page_text(), "run python tools/quickstart_tables.py"


def test_tables_from_made_up_results(tmp_path):
    tables = _tables()
    recipes = tmp_path / "recipes.json"
    recipes.write_text(json.dumps({"date": "2026-01-02", "device": "CPU (2 cores)", "task": "t", "runs": {
        "gspo": {"steps": 40, "train_min": 18.5, "s_per_step": 27.7, "pass@1_before": 0.3, "pass@1_after": 0.4512,
                 "load_start": 1.0, "load_end": 2.5}}}))
    assert tables.recipes_table(recipes)[-1] == "| gspo | 40 | 18.5 | 27.7 | 0.300 | 0.451 | 1.0, 2.5 |"
    assert "bench/recipes.py" in tables.recipes_table(tmp_path / "absent.json")[0]
    trl = tmp_path / "trl.json"
    trl.write_text(json.dumps({"date": "d", "device": "CPU", "load_start": 1, "load_end": 2, "settings": "s",
                               "speedup_samples_per_s": 2.5, "runs": {
                                   "megatron_rl": {"steps": 10, "s_per_step": 20.0, "samples_per_s": 1.6, "reward_mean": 0.4},
                                   "trl": {"steps": 10, "s_per_step": 50.0, "samples_per_s": 0.64, "reward_mean": 0.35}}}))
    lines = tables.trl_table(trl)
    assert "| trl | 10 | 50.0 | 0.64 | 0.350 |" in lines and lines[-1] == "samples/s, megatron_rl over TRL: 2.5x"


def test_quickstart_results_table():
    from megatron_rl.quickstart import results_markdown

    scores = {"pass@1": 0.25, "pass@4": 0.5, "maj@4": 0.3, "length_mean": 120.0, "truncated_fraction": 0.1, "prompts": 100, "k": 4}
    after = {**scores, "pass@1": 0.375, "pass@4": 0.625}
    summary = {"algorithm": "gspo", "model": "outputs/quickstart/model", "steps": 40, "prompts_per_step": 8, "samples_per_prompt": 4,
               "lr": 5e-6, "before": scores, "after": after, "train_s": 1200.0, "s_per_step": 30.0, "wall_s": 1500.0,
               "machine": {"cpus": 2, "load_start": 1.0, "load_end": 2.0}}
    text = results_markdown(summary)
    assert "| pass@1 | 0.250 | 0.375 | +0.125 |" in text
    assert "| pass@4 | 0.500 | 0.625 | +0.125 |" in text
    assert "training 20.0 min (30.0 s/step), 25.0 min in all" in text


def test_a_before_report_of_another_held_out_set_is_refused(tmp_path):
    import pytest

    from megatron_rl.quickstart import EVAL_SET, check_before_report

    metrics = {"samples_per_prompt": 4, "pass@1": 0.1, "pass@4": 0.2, "maj@4": 0.1, "length_mean": 90.0,
               "truncated_fraction": 0.3, "num_prompts": 100}
    report = tmp_path / "step_0.json"
    report.write_text(json.dumps({"sets": {EVAL_SET: {"metrics": metrics}}}))
    check_before_report(report, 100, 4)  # the same set: accepted
    with pytest.raises(SystemExit, match="scored 100 prompts x 4 samples, this run's held-out set is 50 x 4"):
        check_before_report(report, 50, 4)
    with pytest.raises(SystemExit, match="not an evaluation report"):
        check_before_report(tmp_path / "absent.json", 100, 4)


def test_the_eval_curve_takes_each_report_with_the_training_minutes_before_it(tmp_path):
    from megatron_rl.quickstart import EVAL_SET, eval_curve, results_markdown

    def report(step: int, pass1: float) -> Path:
        metrics = {"samples_per_prompt": 4, "pass@1": pass1, "pass@4": pass1 * 2, "maj@4": pass1, "length_mean": 90.0,
                   "truncated_fraction": 0.3, "num_prompts": 100}
        path = tmp_path / f"step_{step}.json"
        path.write_text(json.dumps({"sets": {EVAL_SET: {"metrics": metrics}}}))
        return path

    reports = [report(0, 0.1), report(10, 0.15), report(20, 0.2), report(25, 0.25)]
    rows = [{"step": i, "time/step_s": 60.0 if i < 10 else 30.0} for i in range(25)]  # 10 min, then 0.5 min a step
    curve = eval_curve(reports, rows)
    assert [(e["step"], e["train_min"], e["pass@1"], e["pass@4"]) for e in curve] == [
        (0, 0.0, 0.1, 0.2), (10, 10.0, 0.15, 0.3), (20, 15.0, 0.2, 0.4), (25, 17.5, 0.25, 0.5)]
    # an earlier run's step-0 report stands in for a skipped first evaluation
    assert [e["step"] for e in eval_curve(reports[1:], rows, before_report=reports[0])] == [0, 10, 20, 25]
    scores = {"pass@1": 0.1, "pass@4": 0.2, "maj@4": 0.1, "length_mean": 90.0, "truncated_fraction": 0.3, "prompts": 100, "k": 4}
    summary = {"algorithm": "gspo", "model": "m", "steps": 25, "prompts_per_step": 8, "samples_per_prompt": 4, "lr": 1e-5,
               "before": scores, "after": {**scores, "pass@1": 0.25}, "train_s": 1050.0, "s_per_step": 42.0, "wall_s": 1500.0,
               "machine": {"cpus": 2, "load_start": 1.0, "load_end": 2.0}, "evals": curve}
    assert ("held-out pass@1 by step (training minutes before it): 0: 0.100 (0.0 min), 10: 0.150 (10.0 min), "
            "20: 0.200 (15.0 min), 25: 0.250 (17.5 min)") in results_markdown(summary)
