"""`megatron-rl serve`: the vLLM server command a preset implies, and bad model directories.

The server itself runs in tests/e2e/test_vllm_serve_cli.py.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.extras import VLLM_EXTRA
from tests.unit.test_rollout_engine_logic import parse_vllm_server_args

REPO = Path(__file__).resolve().parents[2]


TOKEN = "k3Rq0-token-of-this-test-9xZ"


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_RL_SERVER_TOKEN")}
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "serve", *args], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**clean, **(env or {})},
    )


def _model(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def _token_file(tmp_path, mode=0o600):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


def test_dry_run_prints_the_server_command_of_the_preset(tmp_path):
    model = _model(tmp_path)
    token_file = _token_file(tmp_path)
    result = serve("--dry-run", "--config", "configs/tiny-gspo.yaml", f"model.path={model}", "--port", "8123",
                   "rollout.max_model_len=96", "rollout.tensor_parallel=2", f"rollout.server_token_file={token_file}")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "export VLLM_SERVER_DEV_MODE=1" in lines  # POST /collective_rpc, /reset_prefix_cache
    # the token reaches the server in its environment, read from the file by the printed line; never printed
    assert f'export MEGATRON_RL_SERVER_TOKEN="$(cat {token_file})"' in lines
    assert f'export VLLM_API_KEY="$(cat {token_file})"' in lines
    assert TOKEN not in result.stdout + result.stderr
    command = shlex.split(lines[-1])
    assert command[:3] == [sys.executable, "-m", "megatron_rl.rollout.server_main"]  # vLLM's API server, its sockets removed

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("--model") == str(model)
    assert value("--host") == "0.0.0.0" and value("--port") == "8123"
    assert value("--worker-extension-cls") == "megatron_rl.rollout.worker_ext.RolloutWorkerExtension"
    assert value("--logprobs-mode") == "processed_logprobs"  # what the trainer's logprobs are compared with
    assert value("--max-model-len") == "96" and value("--tensor-parallel-size") == "2"
    assert value("--seed") == "42"  # train.seed's default
    assert [command[i + 1] for i, flag in enumerate(command) if flag == "--middleware"] == [
        "megatron_rl.rollout.server_limits.BodyLimitMiddleware", "megatron_rl.rollout.server_auth.BearerTokenMiddleware"]
    assert "export MEGATRON_RL_SERVER_MAX_BODY_BYTES=4096000000" in lines  # rollout.server_max_body_mb's default
    assert "--api-key" not in command  # a command line is every user's to read (ps)


@pytest.mark.extra(VLLM_EXTRA, "vllm")
def test_the_dry_run_command_parses_with_vllms_parser(tmp_path):
    """megatron_rl.rollout.server_main hands its arguments to vLLM's API server as they are: vLLM's own parser reads them
    into the preset's and the command line's values."""
    model = _model(tmp_path)
    result = serve("--dry-run", "--config", "configs/tiny-gspo.yaml", f"model.path={model}", "--port", "8123",
                   "rollout.max_model_len=96", "rollout.tensor_parallel=2", f"rollout.server_token_file={_token_file(tmp_path)}")
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.splitlines()[-1])
    assert command[1:3] == ["-m", "megatron_rl.rollout.server_main"]
    args = parse_vllm_server_args(command[3:])
    assert args.model == str(model) and args.host == "0.0.0.0" and args.port == 8123
    assert args.worker_extension_cls == "megatron_rl.rollout.worker_ext.RolloutWorkerExtension"
    assert args.logprobs_mode == "processed_logprobs"
    assert args.max_model_len == 96 and args.tensor_parallel_size == 2 and args.seed == 42
    assert args.middleware == ["megatron_rl.rollout.server_limits.BodyLimitMiddleware",
                               "megatron_rl.rollout.server_auth.BearerTokenMiddleware"]
    assert args.api_key is None


def test_serving_other_hosts_without_a_token_is_refused_in_one_line(tmp_path):
    model = _model(tmp_path)
    result = serve("--config", "configs/tiny-gspo.yaml", f"model.path={model}", "--host", "0.0.0.0")  # no --dry-run
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "--host 0.0.0.0" in result.stderr and "rollout.server_token_file" in result.stderr
    assert "MEGATRON_RL_SERVER_TOKEN" in result.stderr
    # with the token in the environment it binds as asked
    result = serve("--dry-run", "--config", "configs/tiny-gspo.yaml", f"model.path={model}", "--host", "0.0.0.0",
                   env={"MEGATRON_RL_SERVER_TOKEN": TOKEN})
    assert result.returncode == 0, result.stderr
    assert 'export VLLM_API_KEY="$MEGATRON_RL_SERVER_TOKEN"' in result.stdout.splitlines()
    # on loopback without a token: open to this host's users, said on stderr
    result = serve("--dry-run", "--config", "configs/tiny-gspo.yaml", f"model.path={model}", "--host", "127.0.0.1")
    assert result.returncode == 0, result.stderr
    assert "server_auth.BearerTokenMiddleware" not in result.stdout and "VLLM_API_KEY" not in result.stdout
    assert "no token: every user of this host can drive the server" in result.stderr


@pytest.mark.parametrize("mode, content, message", [
    (0o644, TOKEN, "has mode 644: other users could read or change the token; run chmod 600"),
    (0o600, "short", "at least 16 characters"),
    (None, TOKEN, "cannot read it (No such file or directory)"),
])
def test_a_bad_token_file_is_named(tmp_path, mode, content, message):
    path = tmp_path / "token"
    if mode is not None:
        path.write_text(content)
        path.chmod(mode)
    result = serve("--dry-run", "--config", "configs/tiny-gspo.yaml", f"model.path={_model(tmp_path)}",
                   f"rollout.server_token_file={path}")
    assert result.returncode == 2
    assert f"rollout.server_token_file='{path}'" in result.stderr and message in result.stderr
    assert content not in result.stderr


def test_a_model_path_without_config_json_is_named(tmp_path):
    result = serve("--dry-run", "--config", "configs/tiny-gspo.yaml", f"model.path={tmp_path}", "--host", "127.0.0.1")
    assert result.returncode == 2
    assert f"model.path='{tmp_path}'" in result.stderr and "no config.json" in result.stderr


def test_a_bad_override_is_a_config_error():
    result = serve("--dry-run", "--config", "configs/tiny-gspo.yaml", "rollout.tensor_paralel=2")
    assert result.returncode == 2
    assert "tensor_paralel" in result.stderr and "tensor_parallel" in result.stderr
