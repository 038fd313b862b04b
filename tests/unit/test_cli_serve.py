"""`megatron-rl serve`: the vLLM server command a preset implies, and bad model directories.

The server itself runs in tests/e2e/test_vllm_serve_cli.py.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "serve", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_dry_run_prints_the_server_command_of_the_preset(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = serve("--dry-run", "--config", "configs/tiny-gspo.yaml", f"model.path={model}", "--port", "8123",
                   "rollout.max_model_len=96", "rollout.tensor_parallel=2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "export VLLM_SERVER_DEV_MODE=1" in lines  # POST /collective_rpc, /reset_prefix_cache
    command = shlex.split(lines[-1])
    assert command[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--model") == str(model)
    assert value("--host") == "0.0.0.0" and value("--port") == "8123"
    assert value("--worker-extension-cls") == "megatron_rl.rollout.worker_ext.RolloutWorkerExtension"
    assert value("--logprobs-mode") == "processed_logprobs"  # what the trainer's logprobs are compared with
    assert value("--max-model-len") == "96" and value("--tensor-parallel-size") == "2"
    assert value("--seed") == "42"  # train.seed's default


def test_a_model_path_without_config_json_is_named(tmp_path):
    result = serve("--dry-run", "--config", "configs/tiny-gspo.yaml", f"model.path={tmp_path}")
    assert result.returncode == 2
    assert f"model.path='{tmp_path}'" in result.stderr and "no config.json" in result.stderr


def test_a_bad_override_is_a_config_error():
    result = serve("--dry-run", "--config", "configs/tiny-gspo.yaml", "rollout.tensor_paralel=2")
    assert result.returncode == 2
    assert "tensor_paralel" in result.stderr and "tensor_parallel" in result.stderr
