"""Engine core in a child process (rollout.multiprocessing): broadcast and bytes pushes, capture, real kills, a job's
stop signals, and a trainer that dies without closing its engine.

Four engine-core starts (~10 s each on 2 idle cores: the worker runs inside the engine core): the tests that kill
a real engine process, once in the middle of a streamed push (the push is made
again from a fresh export into the restarted engine) and once during
generation (the restarted engine gets a re-export); the in-process recovery
test injects its fault.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import tests.e2e.requires_vllm  # noqa: F401,E402  (skips the module, naming the extra, without vLLM; a broken install fails)

from megatron_rl.config import RolloutConfig  # noqa: E402
from megatron_rl.rollout import SamplingSpec, VLLMEngine  # noqa: E402
from megatron_rl.rollout.vllm_engine import engine_core_processes  # noqa: E402
from megatron_rl.weight_sync import WeightStream, bucketize, push_weights  # noqa: E402
from megatron_rl.weight_sync.stream import entries_of  # noqa: E402
from tests.e2e.vllm_helpers import (  # noqa: E402
    build_models,
    hf_router_topk,
    hf_state_dict,
    max_logprob_error,
    socket_files,
    vllm_processes_below,
)

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10]]


def _core_pid(engine) -> int:
    return engine_core_processes(engine._llm)[0].pid


@pytest.mark.slow
def test_killed_engine_core_is_restarted_with_the_pushed_weights(tmp_path):
    models = build_models(tmp_path)
    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=128, multiprocessing=True, return_routed_experts=True)
    engine = VLLMEngine(models["moe0"], config)
    try:
        assert engine.weight_transport == "broadcast"  # gloo group with the engine's worker
        # the worker runs inside the engine-core process: vLLM's CPU platform would spawn a third (worker_in_engine_core)
        assert vllm_processes_below(_core_pid(engine)) == []
        # with every CPU but one for its model's threads, the one vLLM's spawned worker leaves the client's processing
        cpus = len(os.sched_getaffinity(0))
        assert engine.model_info["cpu_threads"] == int(os.environ.get("OMP_NUM_THREADS", max(1, cpus - 1)))
        # the core ends after its shutdown: the worker extension keeps its heap frozen through it (megatron_rl.heap)
        assert engine.model_info["heap_frozen_until_exit"] is True
        # vLLM's sockets between this process and its core are in a directory of this start's own (engine_files.SocketDir)
        first_sockets = engine._sockets.path
        assert len(socket_files(first_sockets)) >= 2, first_sockets
        # a job's stop signals reach every process of it (Slurm's srun passes USR1 on; Slurm's TERM at a requeue or
        # a pre-emption goes to all of them, torchrun's to the rank's process group): the core outlives both, so the
        # step in progress and the save after it keep their engine
        core = _core_pid(engine)
        os.kill(core, signal.SIGUSR1)
        os.kill(core, signal.SIGTERM)
        assert engine.generate(PROMPTS, SamplingSpec(n=1, max_new_tokens=2, seed=1)).metrics["restarts"] == 0
        os.kill(core, 0)  # still there
        assert engine.restarts == 0
        # the core ends itself if this process dies without closing it (test_a_trainer_killed_...)
        assert engine.model_info["owner_watched"] is True
        # a push broken midway by a killed engine core: made again from a fresh export on a restarted engine
        exports = []

        def export():  # the trainer's export, made anew per attempt; the first loses the engine core midway
            exports.append(1)
            listed = list(bucketize(hf_state_dict(models["moe1"]).items(), 16 << 10))

            def buckets():
                for index, bucket in enumerate(listed):
                    if index == 4 and len(exports) == 1:
                        os.kill(_core_pid(engine), signal.SIGKILL)
                    yield bucket

            return WeightStream(entries_of(listed), buckets())

        push_weights(engine, export, version=3, max_attempts=2)
        assert len(exports) == 2 and engine.restarts == 1
        # the killed start's directory went with it; the restarted one has its own
        assert not os.path.exists(first_sockets) and socket_files(engine._sockets.path)
        spec = SamplingSpec(n=2, max_new_tokens=10, seed=1, return_routed_experts=True)
        before = engine.generate(PROMPTS, spec)
        # moe1's logprobs, not the directory's moe0: the restarted engine got the whole second export
        assert before.weight_version == 3 and max_logprob_error(models["moe1"], before, 1.0) < 1e-4
        for s in before:
            ids, margin = hf_router_topk(models["moe1"], s.token_ids, 2)
            differ = (s.routed_experts.long().sort(dim=-1).values[:-1] != ids[:-1]).any(dim=-1)
            assert not (differ & (margin[:-1] > 1e-5)).any()

        # a killed engine core during generation: restarted, and the trainer's weights re-exported into it
        engine.reexport_fn = lambda: bucketize(hf_state_dict(models["moe1"]).items(), 64 << 10)
        os.kill(_core_pid(engine), signal.SIGKILL)
        after = engine.generate(PROMPTS, spec)
        assert after.metrics["restarts"] == 1 and engine.restarts == 2 and after.weight_version == 3
        assert max_logprob_error(models["moe1"], after, 1.0) < 1e-4  # re-pushed, not the directory's weights
        assert [s.response_token_ids.tolist() for s in after] == [s.response_token_ids.tolist() for s in before]
        assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(after, before))

        # the same engine with buckets as safetensors bytes over vLLM's RPC (rollout.weight_transport=rpc)
        engine.weight_transport = "rpc"
        push_weights(engine, bucketize(hf_state_dict(models["moe0"]).items(), 64 << 10), version=5)
        by_rpc = engine.generate(PROMPTS, spec)
        assert by_rpc.weight_version == 5 and max_logprob_error(models["moe0"], by_rpc, 1.0) < 1e-4
    finally:
        last_sockets = engine._sockets.path
        last_core = engine_core_processes(engine._llm)[0] if engine._llm else None
        engine.shutdown()
    assert last_sockets and not os.path.exists(last_sockets)  # removed with the engine
    # its TERM blocked, the core ended by the SIGINT of the engine's shutdown through vLLM's own handler (exit code 0),
    # not by the SIGKILL that vLLM's shutdown sends a core still running 5 s after its TERM (-9)
    assert last_core is not None and last_core.exitcode == 0, last_core


OWNER = """
import sys
from megatron_rl.config import RolloutConfig
from megatron_rl.rollout import VLLMEngine
from megatron_rl.rollout.vllm_engine import engine_core_processes

engine = VLLMEngine(sys.argv[1], RolloutConfig(kv_cache_gib=0.25, max_model_len=128, multiprocessing=True))
print("core pid", engine_core_processes(engine._llm)[0].pid, flush=True)
sys.stdin.read()  # until the test kills this process
"""


@pytest.mark.slow
def test_a_trainer_killed_without_closing_its_engine_takes_the_engine_core_with_it(tmp_path):
    """A trainer killed by SIGKILL (the out-of-memory killer, a lost node's cleanup) closes nothing; torchrun restarts
    the rank without signalling the dead one's process group, and the core blocks TERM: the core's own watch of the
    process that started it (rollout.engine_env.watch_owner) ends it, so the restarted rank gets its memory back."""
    import subprocess
    import sys
    import time

    import psutil

    models = build_models(tmp_path)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(models["moe0"])], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    core = None
    try:
        line = ""
        while not line.startswith("core pid "):  # vLLM logs to the same stdout
            line = owner.stdout.readline()
            assert line, "the engine's owner ended before its engine started"
        core = psutil.Process(int(line.split()[-1]))
        assert core.is_running() and core.ppid() == owner.pid
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and core.is_running() and core.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.2)
        assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE, "the orphaned engine core still runs"
    finally:
        if owner.poll() is None:
            owner.kill()
        if core is not None and core.is_running():  # a failed test leaves no engine behind
            core.kill()
