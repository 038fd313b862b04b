"""On a CUDA GPU: no transformer layer of the actor makes the host wait for the device, forward or backward.

A tiny Qwen3-MoE actor in bf16 (grouped experts on torch._grouped_mm where it runs, the sorted MoE dispatch, flash
varlen packed attention) trains one step through the trainer's calls with `torch.cuda.set_sync_debug_mode("error")`
on from the first layer's input to the last layer's output in the forward, and from the last layer output's gradient
to the first layer input's in the backward: any `.item()`, blocking copy or data-sized output there raises.
(tests/distributed/test_actor_step_cost.py counts the same ops on the CPU.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


class LayerSyncGuard:
    """Sync debug mode "error" while the decoder's layers run, forward and backward (module docstring)."""

    def __init__(self, layers) -> None:
        self.handles = [layers[0].register_forward_pre_hook(self._first_in),
                        layers[-1].register_forward_hook(self._last_out)]

    @staticmethod
    def _mode(mode: str):
        def set_mode(*_):
            torch.cuda.set_sync_debug_mode(mode)
        return set_mode

    def _first_in(self, module, args):
        hidden = args[0]
        if hidden.requires_grad:
            hidden.register_hook(self._mode("default"))  # its gradient ends the layers' backward
        torch.cuda.set_sync_debug_mode("error")

    def _last_out(self, module, args, output):
        torch.cuda.set_sync_debug_mode("default")
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(self._mode("error"))  # its gradient starts the layers' backward

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_no_layer_waits_for_the_gpu(tmp_path):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.op_count import TOKENS_PER_MICROBATCH, make_batch, tiny_model

    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.models.mapping import unwrap_model
    from megatron_rl.parallel import destroy_parallel, init_parallel

    model_dir = tiny_model(str(tmp_path))
    ctx = init_parallel(ParallelConfig(), shape=model_shape(load_hf_config(model_dir)))
    actor = Actor(ctx, model=ModelConfig(path=model_dir, dtype="bfloat16"), optimizer=OptimizerConfig(lr=1e-4),
                  train=TrainConfig(pack_sequences=True, max_tokens_per_microbatch=TOKENS_PER_MICROBATCH, old_logprobs="forward"),
                  algorithm=AlgorithmConfig(loss="grpo"))
    guard = None
    try:
        share = actor.distribute(make_batch(actor.arch.vocab_size))
        share, _ = actor.prepare_batch(share)
        actor.train_step(share)  # warm-up: lazy initialisation and the kernel probes run once, outside the guard
        layers = unwrap_model(actor.model[0]).decoder.layers
        if type(layers[0].mlp.token_dispatcher).__name__ != "SortedTokenDispatcher" or type(layers[0].mlp.experts).__name__ != "GroupedMLP":
            pytest.skip("this GPU builds megatron's dispatcher or per-expert GEMMs (no grouped kernel): their syncs are megatron's")
        guard = LayerSyncGuard(layers)
        share, _ = actor.prepare_batch(share.replace(old_logprobs=None, old_routed_experts=None))
        metrics = actor.train_step(share)
        assert metrics["microbatches_per_rank"] >= 2
    finally:
        if guard is not None:
            guard.remove()
        actor.close()
        destroy_parallel(ctx)
