"""Metric sinks: jsonl contents, the PNG summary, tensorboard and wandb files (the wandb extra), rank gating."""

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.metrics import MetricsLogger, plot_summary, read_metrics


def _log_three_steps(logger):
    for step in range(3):
        logger.log(step, {"reward/mean": torch.tensor(0.25 * step), "response/length_mean": 4.0 + step, "note": "x"})
    logger.close()


def test_jsonl_and_plot(tmp_path):
    _log_three_steps(MetricsLogger(tmp_path, progress_total=3))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["reward/mean"] for r in rows] == [0.0, 0.25, 0.5]
    assert rows[2]["response/length_mean"] == 6.0 and rows[0]["note"] == "x"
    png = plot_summary(tmp_path / "metrics.jsonl", tmp_path / "summary.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.extra("wandb", "wandb", "tensorboard")
def test_tensorboard_and_wandb_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    _log_three_steps(MetricsLogger(tmp_path, use_wandb=True, use_tensorboard=True, config={"a": 1}))
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path / "evaluated", use_tensorboard=True)
    logger.log_eval(3, {"eval/aime/pass@1": 0.5})  # an evaluation's numbers at the step of the weights it scored
    logger.close()
    events = EventAccumulator(str(tmp_path / "evaluated" / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/aime/pass@1")] == [(3, 0.5)]


def test_other_ranks_write_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "r1", enabled=False, use_tensorboard=True)
    logger.log(0, {"reward/mean": 1.0})
    logger.close()
    assert not (tmp_path / "r1").exists()


def test_resume_keeps_last_row_per_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"step": 0, "x": 1}, {"step": 1, "x": 2}, {"step": 1, "x": 3}]))
    assert [r["x"] for r in read_metrics(path)] == [1, 3]
    with pytest.raises(ValueError, match="none of the summary metrics"):
        plot_summary(path, tmp_path / "p.png")


def test_evaluation_rows_go_to_their_own_jsonl_and_the_step_of_their_weights(tmp_path):
    logger = MetricsLogger(tmp_path, progress_total=2, summary_every=1)
    logger.log_eval(0, {"eval/aime/mean@4": 0.25})  # before the first step
    logger.log(0, {"reward/mean": 0.5})
    logger.log_eval(1, {"eval/aime/mean@4": 0.75})  # the weights after step 0
    assert logger._bar.n == 1  # evaluations do not advance the progress bar
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "reward/mean": 0.5}]
    assert read_metrics(tmp_path / "eval" / "metrics.jsonl") == [{"step": 0, "eval/aime/mean@4": 0.25}, {"step": 1, "eval/aime/mean@4": 0.75}]


def test_a_run_resumed_at_an_odd_step_prints_its_summary_lines_on_the_uninterrupted_runs_steps(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, summary_every=2)
    for step in range(5, 12):  # resumed at step 5 of 12
        logger.log(step, {"reward/mean": step / 10})
    logger.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 5", "step 7", "step 9", "step 11"]
    assert lines[-1] == "step 11: reward 1.050"  # the mean of steps 10 and 11


PROBE = """
import json, os, resource
from megatron_rl.metrics import process_memory_metrics

def statm_rss_gib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024**3

def reading():
    rss_before = statm_rss_gib()
    metrics = process_memory_metrics()
    return {"metrics": metrics, "ru_maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
            "rss_gib": [rss_before, statm_rss_gib()]}

first = reading()
block = b"\\x01" * (384 << 20)  # every page written: resident
second = reading()
print(json.dumps([first, second]))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self (Linux only)")
def test_the_memory_metrics_agree_with_getrusage_and_statm(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    # The probe is forked by a shell, not by this (large) test process: Linux's ru_maxrss starts from the peak of
    # the process that forked the one that reads it, and the shell's is small.
    command = f'"{sys.executable}" "{tmp_path / "probe.py"}"; exit $?'
    out = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, check=True, env=env, timeout=120)
    first, second = json.loads(out.stdout)
    for reading in (first, second):
        metrics = reading["metrics"]
        assert metrics["memory/peak_rss_gib"] == pytest.approx(reading["ru_maxrss_gib"], abs=2e-3)  # KiB vs KiB, 2 MiB
        # /proc/self/statm's resident pages read just before and just after bracket the current RSS
        assert reading["rss_gib"][0] - 2e-3 <= metrics["memory/rss_gib"] <= reading["rss_gib"][1] + 2e-3
        assert metrics["memory/rss_gib"] <= metrics["memory/peak_rss_gib"]
    # 384 MiB written between the two readings: the peak and the current memory both rose by them
    assert 0.37 <= second["metrics"]["memory/peak_rss_gib"] - first["metrics"]["memory/peak_rss_gib"] <= 0.40
    assert 0.37 <= second["metrics"]["memory/rss_gib"] - first["metrics"]["memory/rss_gib"] <= 0.40


def test_the_summary_line_shows_the_largest_peak_of_its_window():
    from megatron_rl.metrics import summary_line

    window = [{"memory/peak_rss_gib": 13.94, "time/step_s": 2.0}, {"memory/peak_rss_gib": 12.0, "time/step_s": 4.0}]
    assert summary_line(3, window) == "step 3: s/step 3.00, peak RSS 13.9 GiB"
