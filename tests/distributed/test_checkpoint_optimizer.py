"""The distributed optimizer's state in a checkpoint: what a rank holds to save it, and what a resume reads back.

Adam on the tiny Qwen3-MoE model, through the calls the trainer makes (actor.state_dict(optimizer_format=...),
save_checkpoint, load_checkpoint, actor.load_state_dict). Two ranks (DP2) train one step and save in both
formats (the second save of each without megatron's shard-coverage check, as the trainer's later saves); runs
resumed on DP2 and on one rank (DP1) must hold the saved Adam state exactly, and each parameter's step count.
The state is read outside the checkpoint code: each rank's shard of every parameter's main weights, exp_avg and
exp_avg_sq, at its range of the parameter (megatron's optimizer maps), assembled into whole parameters. To save, a rank holds its
own shard of the optimizer state with dp_reshardable (3 x params / DP fp32 values beyond the model's own
parameters), and its model-parallel slice's whole state gathered over DP with fully_reshardable (3 x params).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.distributed.harness import run_distributed

FORMATS = ("dp_reshardable", "fully_reshardable")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("ckpt") / "moe", "qwen3_moe", seed=11, with_tokenizer=False,
                                   vocab_size=200))


def _actor(ctx, model_dir: str):
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, TrainConfig

    return Actor(ctx, model=ModelConfig(path=model_dir), optimizer=OptimizerConfig(name="adam", lr=1e-3, clip_grad=0.0),
                 train=TrainConfig(micro_batch_size=12), algorithm=AlgorithmConfig(loss="gspo"), temperature=0.8)


def _step(actor, rank: int) -> None:
    """One training step on the test batch, given as the trainer gives it (rank 0 holds it, actor.distribute)."""
    from tests.distributed.test_actor_layouts import make_batch

    batch = actor.distribute(make_batch() if rank == 0 else None)
    logprobs = actor.compute_logprobs(batch)  # the old policy 0.05 nats below the current one on every response token
    actor.train_step(batch.replace(old_logprobs=logprobs - 0.05 * batch.response_mask))


def _state_values_beyond_the_model(state: dict, actor) -> int:
    """fp32 values the optimizer part of a sharded state dict holds in storage of its own (not the model's)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    model = {p.untyped_storage().data_ptr() for chunk in actor.model for p in chunk.parameters()}
    held = {}
    for value in nested_values(state["optimizer"]):
        tensor = value.data if isinstance(value, ShardedTensor) else value
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in model:
                held[storage.data_ptr()] = storage.nbytes() // tensor.element_size()
    return sum(held.values())


def _adam_state(actor, ctx) -> dict[str, dict[str, torch.Tensor]] | None:
    """On rank 0: every parameter's whole flattened main weights, exp_avg and exp_avg_sq, from every rank's shard."""
    import torch.distributed as dist

    names = {p: name for chunk in actor.model for name, p in chunk.named_parameters()}
    pieces = []
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for param in opt.model_param_gbuf_map:
            where = opt._get_model_param_range_map(param)["param"]
            state = opt._get_main_param_and_optimizer_states(param)
            pieces.append((names[param], param.numel(), where.start, where.end,
                           {k: state[k].detach().double().flatten().clone() for k in ("param", "exp_avg", "exp_avg_sq")}))
    every = [None] * ctx.world_size
    dist.all_gather_object(every, pieces)
    if ctx.rank != 0:
        return None
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for name, numel, begin, end, values in (piece for rank_pieces in every for piece in rank_pieces):
        slots = whole.setdefault(name, {k: torch.full((numel,), float("nan"), dtype=torch.float64) for k in values})
        for k, v in values.items():
            slots[k][begin:end] = v
    return whole


@contextlib.contextmanager
def _checks_of_shard_coverage():
    """Calls of megatron's check that the ranks' shards cover every tensor once (its all-gather of every rank's list)."""
    from megatron.core.dist_checkpointing import state_dict_utils

    real, calls = state_dict_utils.validate_sharding_integrity, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    state_dict_utils.validate_sharding_integrity = counted
    try:
        yield calls
    finally:
        state_dict_utils.validate_sharding_integrity = real


def _run(rank: int, world_size: int, model_dir: str, out: str, mode: str) -> dict:
    from pathlib import Path

    from megatron_rl.checkpoint.state import load_checkpoint, save_checkpoint
    from megatron_rl.config import ParallelConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(timeout_s=120), shape=model_shape(load_hf_config(model_dir)))
    result: dict = {"held": {}, "state": {}}
    try:
        for name in FORMATS:
            actor = _actor(ctx, model_dir)
            try:
                if mode == "save":  # one step, then save in this format: checked as the trainer's first save, and not
                    _step(actor, rank)
                    state = actor.state_dict(optimizer_format=name)
                    result["held"][name] = (_state_values_beyond_the_model(state, actor),
                                            sum(p.numel() for chunk in actor.model for p in chunk.parameters()))
                    with _checks_of_shard_coverage() as checks:
                        save_checkpoint(Path(out) / name, 1, state, {"optimizer_format": name})
                        first = len(checks)
                        save_checkpoint(Path(out) / name, 2, actor.state_dict(optimizer_format=name),
                                        {"optimizer_format": name}, validate=False)
                    result["checks"] = (first, len(checks) - first)
                else:  # a resume from the save that was not checked
                    loaded, _, _ = load_checkpoint(Path(out) / name / "step_00000002",
                                                   actor.state_dict(is_loading=True, optimizer_format=name))
                    actor.load_state_dict(loaded)
                result["state"][name] = _adam_state(actor, ctx)
                result.setdefault("steps", {})[name] = sorted({  # each parameter's Adam step count
                    float(state["step"]) for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
                    for state in opt.optimizer.state.values() if "step" in state})
            finally:
                actor.close()
    finally:
        destroy_parallel(ctx, keep_world=True)
    return result


def test_a_rank_saves_its_own_optimizer_shard_and_a_resume_on_any_data_parallel_size_reads_it_back(model_dir, tmp_path):
    out = str(tmp_path)
    saved = run_distributed(_run, 2, model_dir, out, "save", timeout=300)
    for rank, result in enumerate(saved):
        own, params = result["held"]["dp_reshardable"]
        # its own shards of the fp32 main weights, exp_avg and exp_avg_sq (megatron pads each bucket to a multiple of DP)
        assert own <= 1.02 * 3 * params / 2, (rank, own, params)
        gathered, _ = result["held"]["fully_reshardable"]
        assert gathered >= 3 * params, (rank, gathered, params)  # gathered over DP: its slice's whole state
        print(f"rank {rank}: fp32 values held to save: dp_reshardable {own}, fully_reshardable {gathered} "
              f"({params} parameters)")
        assert result["checks"] == (1, 0), result["checks"]  # the first save checks its shards' coverage; the next not
    before = saved[0]["state"]
    resumed = {"DP2": run_distributed(_run, 2, model_dir, out, "resume", timeout=300)[0],
               "DP1": run_distributed(_run, 1, model_dir, out, "resume", timeout=300)[0]}
    for name in FORMATS:
        want = before[name]
        assert sum(float(v["exp_avg"].abs().sum()) for v in want.values()) > 0  # the step left moments to keep
        assert not any(v[k].isnan().any() for v in want.values() for k in v)  # every element is some rank's
        for layout, result in resumed.items():
            # one step was taken before the save: Adam's bias correction goes on from 1 (megatron's dp_reshardable
            # load alone leaves every count at 0)
            assert result["steps"][name] == [1.0], (layout, name, result["steps"][name])
            got = result["state"][name]
            assert sorted(got) == sorted(want), (layout, name)
            for param, values in want.items():
                for k, v in values.items():
                    assert torch.equal(got[param][k], v), (layout, name, param, k)
