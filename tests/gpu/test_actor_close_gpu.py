"""On a CUDA GPU: Actor.close() after a training step gives the device memory back (a second model fits)."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.mark.gpu
def test_close_returns_the_device_memory_on_gpu(tmp_path):
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from tests.distributed.test_actor_offload import _batch

    model_dir = str(make_tiny_model_dir(tmp_path / "moe", "qwen3_moe", seed=1, with_tokenizer=False))
    ctx = init_parallel(ParallelConfig())

    def train_and_close() -> int:
        """Bytes the actor held after one training step."""
        actor = Actor(ctx, model=ModelConfig(path=model_dir, dtype="bfloat16"), optimizer=OptimizerConfig(lr=1e-3),
                      train=TrainConfig(), algorithm=AlgorithmConfig(loss="gspo"))
        prepared, _ = actor.prepare_batch(_batch())
        actor.train_step(prepared)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        actor.close()
        return held

    try:
        train_and_close()  # the process's one-time allocations (cuBLAS workspaces, compiled kernels) come first
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        held = train_and_close() - before  # a second actor in the same process
        gc.collect()
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - before
        assert held > 0 and left <= 0.01 * held, f"{left} of {held} bytes still allocated after close()"
    finally:
        destroy_parallel(ctx)
