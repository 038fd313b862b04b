"""A resume builds the policy without reading its HF weights (Actor(load_weights=False), as the trainer does when
it has a checkpoint to resume from): the checkpoint alone must restore every weight and persistent buffer.

Two ranks (EP2), each family the trainer supports (Qwen3-MoE; DeepSeek-V3 with multi-latent attention, a dense
first layer and the router's expert bias; GLM-4.5 with q/k/v biases and the expert bias). Actor A reads the HF
weights, trains one Adam step and saves; actor B is built without them, every parameter and persistent buffer of it
set to NaN, then loaded through the trainer's calls (read_trainer_state, optimizer_format_to_load, load_checkpoint,
actor.load_state_dict, actor.load_schedule_state). B's model state must equal A's element for element, and one more
step on each must give equal weights (the optimizer state came back too, Adam's step count with it).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed

FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    root = tmp_path_factory.mktemp("resume_families")
    # init std 0.1 and the expert bias trained by the step: routing far from uniform, the bias away from its init
    layers = {"deepseek_v3": {"num_hidden_layers": 4}, "glm4_moe": {"num_hidden_layers": 4}}  # a dense layer, then MoE
    return {family: str(make_tiny_model_dir(root / family, family, seed=13, with_tokenizer=False, vocab_size=200,
                                            init_std=0.1, **layers.get(family, {})))
            for family in FAMILIES}


def _actor(ctx, model_dir: str, *, load_weights: bool):
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, TrainConfig

    return Actor(ctx, model=ModelConfig(path=model_dir), optimizer=OptimizerConfig(name="adam", lr=1e-3, clip_grad=0.0),
                 train=TrainConfig(micro_batch_size=12), algorithm=AlgorithmConfig(loss="gspo"), temperature=0.8,
                 load_weights=load_weights)


def _model_state(actor) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for chunk in actor.model for name, value in chunk.state_dict().items()
            if isinstance(value, torch.Tensor) and "_extra_state" not in name}


def _run(rank: int, world_size: int, model_dirs: dict, out: str) -> dict:
    from pathlib import Path

    from megatron_rl.checkpoint.state import load_checkpoint, optimizer_format_to_load, read_trainer_state, save_checkpoint
    from megatron_rl.config import ParallelConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from tests.distributed.test_checkpoint_optimizer import _step

    layout = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 2, "expert_tensor_parallel": 1,
              "context_parallel": 1, "data_parallel": 2}
    results = {}
    for family, model_dir in model_dirs.items():
        ctx = init_parallel(ParallelConfig(timeout_s=120, expert_parallel=2), shape=model_shape(load_hf_config(model_dir)))
        try:
            saved_at = Path(out) / family
            first = _actor(ctx, model_dir, load_weights=True)
            _step(first, rank)
            save_checkpoint(saved_at, 1, first.state_dict(optimizer_format="dp_reshardable"),
                            {"optimizer_format": "dp_reshardable", "layout": layout, **first.schedule_state()})
            resumed = _actor(ctx, model_dir, load_weights=False)
            with torch.no_grad():
                for chunk in resumed.model:  # what a checkpoint holds: parameters and persistent buffers
                    for value in chunk.module.state_dict(keep_vars=True).values():
                        if isinstance(value, torch.Tensor) and value.is_floating_point():
                            value.fill_(float("nan"))
            path = saved_at / "step_00000001"
            saved = read_trainer_state(path)
            state, trainer_state, _ = load_checkpoint(path, resumed.state_dict(
                is_loading=True, optimizer_format=optimizer_format_to_load(path, saved, layout)), trainer_state=saved)
            resumed.load_state_dict(state)
            resumed.load_schedule_state(trainer_state)
            before, after = _model_state(first), _model_state(resumed)
            differ = sorted(name for name in before if not torch.equal(before[name], after[name]))
            _step(first, rank)
            _step(resumed, rank)
            stepped = _model_state(first), _model_state(resumed)
            results[family] = {
                "names": sorted(before), "differ": differ,
                "differ_after_a_step": sorted(n for n in stepped[0] if not torch.equal(stepped[0][n], stepped[1][n])),
                "moved": sum(float((stepped[0][n].double() - before[n].double()).abs().sum()) for n in before
                             if stepped[0][n].is_floating_point()),
            }
            first.close()
            resumed.close()
        finally:
            destroy_parallel(ctx, keep_world=True)
    return results


def test_a_resume_restores_every_weight_and_buffer_without_the_hf_weights(model_dirs, tmp_path):
    for rank, results in enumerate(run_distributed(_run, 2, model_dirs, str(tmp_path), timeout=300)):
        for family, result in results.items():
            assert result["differ"] == [], (rank, family, result["differ"])
            assert result["differ_after_a_step"] == [], (rank, family, result["differ_after_a_step"])
            assert result["moved"] > 0, (rank, family)  # the second step moved the weights: the comparison has teeth
            if family != "qwen3_moe":  # the trained expert bias is part of what a resume restores
                assert any(name.endswith("router.expert_bias") for name in result["names"]), (family, result["names"][:20])
