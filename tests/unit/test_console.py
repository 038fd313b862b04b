"""Where a run's output goes (megatron_rl.console), the summary line, and the trainer's CPU threads."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import pytest
import torch

from megatron_rl.config import ConfigError, RLConfig, load_config
from megatron_rl.console import library_logs
from megatron_rl.metrics import MetricsLogger, summary_line
from megatron_rl.parallel.threads import cpu_threads_per_process, set_torch_threads


def test_vllm_log_goes_to_the_run_directory_and_only_errors_to_the_console(tmp_path, capfd):
    vllm_logger = logging.getLogger("vllm.model_executor.layerwise")  # a vLLM module's logger
    before = list(logging.getLogger("vllm").handlers)
    with library_logs(tmp_path) as logs:
        assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(logs.vllm.with_suffix(".logging.json"))
        vllm_logger.info("Reloading weights inplace...")
        vllm_logger.warning("RotaryEmbedding: Failed to load weights")
        vllm_logger.error("engine core died")
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # pytest.ini ignores UserWarnings
            warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
    console = capfd.readouterr()
    log = (tmp_path / "logs" / "vllm.log").read_text()
    for line in ("Reloading weights inplace...", "RotaryEmbedding: Failed to load weights", "engine core died"):
        assert line in log
    assert "Reloading" not in console.err + console.out and "RotaryEmbedding" not in console.err + console.out
    assert "engine core died" in console.err
    assert "Apex is not installed" in (tmp_path / "logs" / "warnings.log").read_text()
    assert "Apex" not in console.err
    assert logging.getLogger("vllm").handlers == before and "VLLM_LOGGING_CONFIG_PATH" not in os.environ


def test_engine_start_output_below_python_logging_goes_to_the_vllm_log(tmp_path, capfd):
    with library_logs(tmp_path) as logs:
        with logs.engine_start():
            os.write(2, b"[W utils.cpp:68] Warning: NUMA binding\n")  # as vLLM's C++ code writes it
            print("Loading safetensors checkpoint shards", file=sys.stderr)
        print("after the start", file=sys.stderr)
    console = capfd.readouterr()
    log = logs.vllm.read_text()
    assert "NUMA binding" in log and "Loading safetensors" in log
    assert "NUMA" not in console.err and "Loading safetensors" not in console.err
    assert "after the start" in console.err


def test_summary_line_shows_means_over_the_window():
    window = [
        {"reward/mean": 0.25, "time/step_s": 0.5, "rollout/generate_s": 0.1},
        {"reward/mean": 0.75, "time/step_s": 0.3, "rollout/generate_s": 0.3},
    ]
    assert summary_line(7, window) == "step 7: reward 0.500, s/step 0.40, generate 0.20"


def test_metrics_logger_prints_a_summary_every_n_steps(tmp_path, capsys):
    metrics = MetricsLogger(tmp_path, summary_every=2)
    for step, reward in enumerate([0.0, 1.0, 0.5]):
        metrics.log(step, {"reward/mean": reward})
    metrics.close()
    out = capsys.readouterr().out.splitlines()
    assert out == ["step 1: reward 0.500"]  # step 2 starts the next window, which never fills


def test_cpu_threads_per_process(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads_per_process(3, 1) == 3
    assert cpu_threads_per_process(0, 1) == cores
    assert cpu_threads_per_process(0, 2 * cores) == 1  # never below one thread
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the user's (or torchrun's) stands; cluster.cpu_threads wins
    assert cpu_threads_per_process(0, 1) == 5 and cpu_threads_per_process(3, 1) == 3
    for bad in ("0", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(ValueError, match=f"OMP_NUM_THREADS='{bad}'"):
            cpu_threads_per_process(0, 1)
    with pytest.raises(ConfigError, match="cluster.cpu_threads=-1"):
        load_config(RLConfig, None, ["cluster.cpu_threads=-1"])
    with pytest.raises(ConfigError, match="logging.summary_every=-2"):
        load_config(RLConfig, None, ["logging.summary_every=-2"])


def test_set_torch_threads_works_where_torch_set_num_threads_was_replaced(monkeypatch):
    # an in-process vLLM engine replaces torch.set_num_threads with a function that refuses
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    try:
        set_torch_threads(before + 1)
        assert torch.get_num_threads() == before + 1
    finally:
        set_torch_threads(before)


def test_handlers_made_while_the_engine_starts_write_to_the_console_afterwards(tmp_path, capsys):
    """A library's basicConfig during engine start binds the redirected stderr (the log file, closed after):
    later warnings must reach the console, not end in "I/O operation on closed file"."""
    root = logging.getLogger()
    saved = list(root.handlers)
    try:
        with library_logs(tmp_path) as logs:
            with logs.engine_start():
                root.handlers = [logging.StreamHandler(sys.stderr)]  # what logging.basicConfig() does
                logging.getLogger("megatron_rl.test").warning("during start")
            logging.getLogger("megatron_rl.test").warning("41 prompts were dropped")
        err = capsys.readouterr().err
        assert "41 prompts were dropped" in err and "Logging error" not in err and "during start" not in err
        assert "during start" in logs.vllm.read_text()
    finally:
        root.handlers = saved
