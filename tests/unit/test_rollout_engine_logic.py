"""Engine logic without vLLM: restart-and-retry, prompt checks, sampling translation, batch layout."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import RolloutConfig
from megatron_rl.data.batch import Rollouts
from megatron_rl.rollout.prompts import check_prompts
from megatron_rl.rollout.samples import make_sample
from megatron_rl.rollout.engine import PromptError, RolloutError, RolloutFailedError, run_with_restarts
from megatron_rl.rollout.sampling import SamplingSpec, prompt_seed, to_completion_request
from tests.extras import VLLM_EXTRA


class EngineDied(RuntimeError):
    pass


def _flaky(failures: int):
    calls = {"attempts": 0, "restarts": 0}

    def attempt():
        calls["attempts"] += 1
        if calls["attempts"] <= failures:
            raise EngineDied(f"died on attempt {calls['attempts']}")
        return "batch"

    def restart(error):
        assert isinstance(error, EngineDied)
        calls["restarts"] += 1

    return attempt, restart, calls


def test_retries_until_success_within_budget():
    attempt, restart, calls = _flaky(2)
    result, used = run_with_restarts(attempt, restart, max_restarts=2, is_engine_failure=lambda e: isinstance(e, EngineDied), what="gen")
    assert (result, used) == ("batch", 2) and calls == {"attempts": 3, "restarts": 2}


def test_fails_clearly_after_max_restarts():
    attempt, restart, calls = _flaky(10)
    with pytest.raises(RolloutFailedError, match=r"gen failed after 2 engine restart\(s\).*died on attempt 3.*No partial batch") as info:
        run_with_restarts(attempt, restart, max_restarts=2, is_engine_failure=lambda e: isinstance(e, EngineDied), what="gen")
    assert isinstance(info.value.__cause__, EngineDied) and calls == {"attempts": 3, "restarts": 2}


def test_caller_errors_are_not_retried():
    def attempt():
        raise PromptError("prompt 3 is empty")

    with pytest.raises(PromptError):
        run_with_restarts(attempt, lambda e: pytest.fail("restarted"), max_restarts=5, is_engine_failure=lambda e: not isinstance(e, PromptError), what="x")


def test_a_failing_restart_counts_as_a_failure():
    attempts = []

    def attempt():
        attempts.append(1)
        raise EngineDied("dead")

    def restart(error):
        raise EngineDied("restart failed")

    with pytest.raises(RolloutFailedError, match="restart failed"):
        run_with_restarts(attempt, restart, max_restarts=3, is_engine_failure=lambda e: isinstance(e, EngineDied), what="x")
    assert len(attempts) == 1


def test_check_prompts():
    assert check_prompts([[1, 2], (3,)], max_model_len=8, vocab_size=10) == [[1, 2], [3]]
    with pytest.raises(PromptError, match=r"prompt 1 has 8 tokens but the engine's context is 8"):
        check_prompts([[1], [1] * 8], max_model_len=8, vocab_size=10)
    with pytest.raises(PromptError, match="prompt 0 is empty"):
        check_prompts([[]], 8, 10)
    with pytest.raises(PromptError, match=r"prompt 0: token id -1"):
        check_prompts([[1, -1]], 8, 10)
    with pytest.raises(PromptError, match="string"):
        check_prompts(["hello"], 8, 10)


def test_sampling_spec():
    cfg = RolloutConfig(n_samples=3, temperature=0.6, top_k=5, stop=["\n"], stop_token_ids=[7], max_new_tokens=9)
    spec = SamplingSpec.from_config(cfg, seed=11)
    assert (spec.n, spec.temperature, spec.top_k, spec.stop, spec.stop_token_ids, spec.seed) == (3, 0.6, 5, ["\n"], [7], 11)
    body = to_completion_request(spec, 2, [1, 2, 3], model="m")
    assert body["prompt"] == [1, 2, 3] and body["logprobs"] == 0 and body["return_token_ids"] and body["n"] == 3
    assert body["seed"] == prompt_seed(11, 2) and body["max_tokens"] == 9 and body["stop_token_ids"] == [7]
    for bad in (dict(n=0), dict(temperature=0.0), dict(top_p=0.0), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingSpec(**bad).validate()


def test_prompt_seeds_differ_and_leave_room_for_sample_offsets():
    seeds = [prompt_seed(s, i) for s in range(5) for i in range(200)]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2**62 for x in seeds)
    assert prompt_seed(None, 3) is None and prompt_seed(4, 3) == prompt_seed(4, 3)


def _sample(i, j, prompt, response, version=2):
    return make_sample(
        prompt_index=i, sample_index=j, prompt_ids=prompt, response_ids=response,
        logprobs=[-0.5 * (k + 1) for k in range(len(response))], finish_reason="length", stop_reason=None,
        weight_version=version,
    )


def test_make_sample_rejects_partial_outputs():
    with pytest.raises(RolloutError, match="prompt 1 sample 0.*abort"):
        make_sample(prompt_index=1, sample_index=0, prompt_ids=[1], response_ids=[2], logprobs=[0.0],
                    finish_reason="abort", stop_reason=None, weight_version=0)
    with pytest.raises(RolloutError, match="1 logprobs for 2 tokens"):
        make_sample(prompt_index=0, sample_index=0, prompt_ids=[1], response_ids=[2, 3], logprobs=[0.0],
                    finish_reason="stop", stop_reason=None, weight_version=0)


def test_to_padded_aligns_tokens_logprobs_and_routes():
    a = _sample(0, 0, [1, 5, 6], [7, 2])
    b = _sample(0, 1, [1, 5, 6], [8, 9, 10, 2])
    a.routed_experts = torch.arange(5 * 2 * 2, dtype=torch.int16).view(5, 2, 2)
    a.routed_experts_include_prompt = True
    b.routed_experts = torch.ones(4, 2, 2, dtype=torch.int16)  # response-only rows
    rollouts = Rollouts(samples=[a, b], n_samples=2, weight_version=2)
    padded = rollouts.to_padded(pad_token_id=3)
    assert padded.tokens.tolist() == [[1, 5, 6, 7, 2, 3, 3], [1, 5, 6, 8, 9, 10, 2]]
    assert padded.response_mask.tolist()[0] == [False, False, False, True, True, False, False]
    assert padded.rollout_logprobs[1, 3:].tolist() == [-0.5, -1.0, -1.5, -2.0]
    assert padded.routed_experts.shape == (2, 7, 2, 2)
    assert torch.equal(padded.routed_experts[0, :5], a.routed_experts) and (padded.routed_experts[0, 5:] == -1).all()
    assert (padded.routed_experts[1, :3] == -1).all() and (padded.routed_experts[1, 3:] == 1).all()
    assert rollouts.num_prompts == 1 and rollouts.group(0) == [a, b]


def test_server_command_line(tmp_path):
    from megatron_rl.rollout.server_supervisor import VLLMServer

    config = RolloutConfig(kv_cache_gib=0.5, max_model_len=512, return_routed_experts=True, dtype="float32")
    cmd = VLLMServer(tmp_path, config, port=8123).command()
    joined = " ".join(cmd)
    assert "-m megatron_rl.rollout.server_main" in joined and "--port 8123" in joined
    assert "--worker-extension-cls megatron_rl.rollout.worker_ext.RolloutWorkerExtension" in joined
    assert "--logprobs-mode processed_logprobs" in joined and "--dtype float32" in joined
    assert f"--kv-cache-memory-bytes {1 << 29}" in joined and "--max-model-len 512" in joined
    assert "--no-enable-prefix-caching" in cmd  # prompt routes need every prompt token computed
    assert "--no-enable-prefix-caching" not in VLLMServer(tmp_path, RolloutConfig(), port=1).command()


def parse_vllm_server_args(argv: list[str]):
    """`argv` as `python -m vllm.entrypoints.openai.api_server` reads it: the parser and checks of vLLM's own main()."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    validate_parsed_serve_args(args)
    return args


@pytest.mark.extra(VLLM_EXTRA, "vllm")
def test_server_command_line_parses_with_vllms_parser(tmp_path):
    """What vLLM's API server makes of the command: each field as meant, and an unknown flag or a value outside
    its choices fails here (argparse exits) rather than at a server's start."""
    from megatron_rl.rollout.server_supervisor import VLLMServer

    config = RolloutConfig(kv_cache_gib=0.5, max_model_len=512, return_routed_experts=True, dtype="float32")
    cmd = VLLMServer(tmp_path, config, port=8123).command()
    assert cmd[1:3] == ["-m", "megatron_rl.rollout.server_main"]  # vLLM's API server with the request-head limit
    args = parse_vllm_server_args(cmd[3:])
    assert args.model == str(tmp_path) and args.host == "127.0.0.1" and args.port == 8123
    assert args.dtype == "float32" and args.seed == 0
    assert args.logprobs_mode == "processed_logprobs"
    assert args.worker_extension_cls == "megatron_rl.rollout.worker_ext.RolloutWorkerExtension"
    assert args.kv_cache_memory_bytes == 512 * 1024 * 1024  # 0.5 GiB
    assert args.max_model_len == 512 and args.tensor_parallel_size == 1 and args.pipeline_parallel_size == 1
    assert args.enable_prefix_caching is False  # prompt routes need every prompt token computed
    # the body limit inside the token check (vLLM adds each middleware outside the ones before it)
    assert args.middleware == ["megatron_rl.rollout.server_limits.BodyLimitMiddleware",
                               "megatron_rl.rollout.server_auth.BearerTokenMiddleware"]  # a token: a random one here
    assert args.disable_log_stats is True and args.api_key is None  # the token is never on the command line

    # defaults: prefix caching left to vLLM (its default, unset), and no token check for an open control plane
    args = parse_vllm_server_args(VLLMServer(tmp_path, RolloutConfig(), port=1, open_control_plane=True).command()[3:])
    assert args.enable_prefix_caching is None and args.port == 1
    assert args.middleware == ["megatron_rl.rollout.server_limits.BodyLimitMiddleware"]


def test_a_server_engine_without_urls_names_both_ways_to_get_them():
    from megatron_rl.config import ConfigError
    from megatron_rl.rollout import make_engine

    with pytest.raises(ConfigError, match=r"needs rollout.server_urls=\[http://host:port, ...\].*launch/slurm.sbatch"):
        make_engine("unused", RolloutConfig(engine="vllm_server"))


def test_an_engines_socket_directory_holds_vllms_socket_names_and_is_removed(monkeypatch):
    """engine_files.SocketDir: vLLM names a socket <VLLM_RPC_BASE_PATH>/<uuid4>; the directory is one the kernel can bind
    such a name in, or none at all (vLLM's own temp directory) where the temp directory's path leaves no room."""
    import getpass
    import os
    import subprocess
    import sys
    import shutil
    import socket
    import tempfile
    import uuid

    from megatron_rl.rollout.engine_files import SocketDir

    def binds(path: str) -> bool:
        with socket.socket(socket.AF_UNIX) as sock:
            try:
                sock.bind(path)
                return True
            except OSError:
                return False

    short = tempfile.mkdtemp(prefix="s", dir="/tmp")  # pytest's tmp_path (under xdist: .../popen-gw0/...) is too long
    try:
        # the kernel's limit, found by binding: a name of MAX_PATH + 37 bytes binds, one byte more does not
        deep = os.path.join(short, "d" * (SocketDir.MAX_PATH - len(short) - 1))
        os.mkdir(deep)
        assert len(deep) == SocketDir.MAX_PATH
        assert binds(f"{deep}/{uuid.uuid4()}") and not binds(f"{deep}/{uuid.uuid4()}x")

        monkeypatch.setattr(tempfile, "tempdir", short)
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        sockets = SocketDir()
        variables = sockets.environment()
        first = variables[SocketDir.VARIABLE]
        assert os.path.dirname(first) == short and binds(f"{first}/{uuid.uuid4()}")
        # the engine's processes make their temp files (vLLM's group store) there, and keep torch inductor's cache
        # where its default is for this temp directory (torch's documented default: <tmp>/torchinductor_<user>)
        child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                               env={**os.environ, **variables}, capture_output=True, text=True, check=True)
        assert child.stdout.strip() == first and tempfile.gettempdir() == short  # this process's own is unchanged
        assert variables["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(short, f"torchinductor_{getpass.getuser()}")
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")  # one the user set is the processes' own
        assert "TORCHINDUCTOR_CACHE_DIR" not in sockets.environment()
        first = sockets.environment()[SocketDir.VARIABLE]
        second = sockets.environment()[SocketDir.VARIABLE]  # a restart: a new directory, the one before removed
        assert second != first and not os.path.exists(first) and os.path.isdir(second)
        sockets.remove()
        assert not os.path.exists(second) and sockets.path is None

        # a temp directory whose path leaves no room for the socket names: vLLM's default, nothing made
        long_dir = os.path.join(short, "l" * (SocketDir.MAX_PATH - len(short) - len(SocketDir.PREFIX) - 1))
        os.mkdir(long_dir)
        monkeypatch.setattr(tempfile, "tempdir", long_dir)
        assert sockets.environment() == {} and sockets.path is None and os.listdir(long_dir) == []
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_a_servers_killed_process_that_only_another_can_reap_counts_as_dead():
    """A server's processes left after it exits are orphans (its resource tracker outlives it): killed, each is a
    zombie until its parent reaps it. The stop waits for them to be dead, not reaped: here the parent never reaps."""
    import subprocess
    import sys
    import threading

    import psutil

    from megatron_rl.rollout.server_supervisor import _kill_all

    code = "import subprocess, time; p = subprocess.Popen(['sleep', '600']); print(p.pid, flush=True); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        orphan_like = psutil.Process(int(parent.stdout.readline()))
        assert orphan_like.ppid() == parent.pid and orphan_like.status() != psutil.STATUS_ZOMBIE
        stop = threading.Thread(target=_kill_all, args=([orphan_like],), kwargs={"timeout_s": 600}, daemon=True)
        stop.start()
        stop.join(60)
        assert not stop.is_alive(), "the stop waits for a reaping only the process's parent can do"
        assert orphan_like.status() == psutil.STATUS_ZOMBIE  # killed, held by a parent that does not reap
    finally:
        parent.kill()
        parent.wait()


def test_an_in_process_engine_gives_torchs_compiler_back_as_it_found_it():
    # an in-process engine on CPU turns torch's compiler off while it runs (rollout.engine_env.compiles_nothing) and, at
    # its shutdown, back to what it was before its first start: restarts keep the first value
    import torch._dynamo

    from megatron_rl.rollout import VLLMEngine

    before = torch._dynamo.config.disable
    try:
        for was in (False, True):
            torch._dynamo.config.disable = was
            engine = VLLMEngine.__new__(VLLMEngine)
            engine._compiler_was = None
            engine._compiler_off()
            engine._compiler_off()  # a restart
            assert torch._dynamo.config.disable is True
            engine._compiler_back()
            assert torch._dynamo.config.disable is was and engine._compiler_was is None
            engine._compiler_back()  # a second shutdown changes nothing
            assert torch._dynamo.config.disable is was
    finally:
        torch._dynamo.config.disable = before
