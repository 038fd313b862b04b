"""`megatron-rl serve` starts a server the trainer's engine can use: it waits for it, pushes, samples, with the
token of rollout.server_token_file; a client without it is refused in one line; the sockets between the server's
processes are in a directory of the server's own, gone when it stops (vLLM's default leaves 3 socket files in the
temp directory at every start).

One server start (~20-40 s on 2 cores).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import tests.e2e.requires_vllm  # noqa: F401,E402  (skips the module, naming the extra, without vLLM; a broken install fails)

from megatron_rl.config import RolloutConfig
from megatron_rl.rollout import SamplingSpec, VLLMServerEngine
from megatron_rl.rollout.server_supervisor import free_port
from megatron_rl.weight_sync import bucketize, push_weights
from tests.e2e.vllm_helpers import build_models, hf_state_dict, max_logprob_error

REPO = Path(__file__).resolve().parents[2]


def test_served_model_takes_pushes_and_samples(tmp_path, monkeypatch):
    import secrets

    from megatron_rl.rollout.server_auth import ServerTokenError

    models = build_models(tmp_path / "models")
    token_file = tmp_path / "server-token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    for name in ("MEGATRON_RL_SERVER_TOKEN", "MEGATRON_RL_SERVER_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    port = free_port()
    started = time.time()
    log = open(tmp_path / "serve.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.cli", "serve", "--config", "configs/tiny-gspo.yaml",
         f"model.path={models['moe0']}", "--host", "127.0.0.1", "--port", str(port),
         "rollout.kv_cache_gib=0.25", "rollout.max_model_len=128", f"rollout.server_token_file={token_file}"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    engine = None
    try:
        # the engine is made while the server is still loading: it waits for /health
        config = RolloutConfig(max_model_len=128, server_start_timeout_s=300, server_token_file=str(token_file))
        engine = VLLMServerEngine([f"http://127.0.0.1:{port}"], config)
        assert engine.max_model_len == 128 and engine.weight_transport == "broadcast"
        with pytest.raises(ServerTokenError, match="needs a token and this process has none"):
            VLLMServerEngine([f"http://127.0.0.1:{port}"], RolloutConfig(max_model_len=128))
        push_weights(engine, bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10), version=2)
        rollouts = engine.generate([[1, 5, 6, 7, 8], [1, 9, 10]], SamplingSpec(n=2, max_new_tokens=10, seed=2))
        assert rollouts.weight_version == 2
        assert max_logprob_error(models["moe1"], rollouts, 1.0) < 1e-4
        lines = (tmp_path / "serve.log").read_text().splitlines()
        sockets = Path(next(line for line in lines if "vLLM's sockets in " in line).split("sockets in ")[1].split(" (")[0])
        assert any(p.is_socket() for p in sockets.iterdir()), sorted(sockets.iterdir())  # the server's, while it runs
    finally:
        if engine is not None:
            engine.shutdown()
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
    assert process.returncode is not None and not sockets.exists(), sorted(sockets.iterdir())
    # none of vLLM's uuid-named sockets or group-store files of this server in the temp directory itself (another
    # test's engine keeps its own in a directory of its own too)
    leaked = [p for p in Path(tempfile.gettempdir()).iterdir()
              if (p.is_socket() or p.name.startswith("vllm_dist_")) and p.stat().st_mtime >= started]
    assert not leaked, leaked
