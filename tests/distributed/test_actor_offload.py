"""Actor offload (train.offload): the round trip through host memory is bit-exact, and training is unchanged.

Two gloo ranks, data-parallel with megatron's distributed optimizer (each rank
holds its shard of Adam's state). Compared with an actor that never offloads:
every parameter, gradient and optimizer-state byte after each round trip,
and the loss metrics of the next training step.
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_distributed

B, T = 4, 16


def _batch():
    from megatron_rl.actor import TrainBatch

    positions = torch.arange(T)
    lengths = torch.tensor([16, 12, 9, 14])
    return TrainBatch(
        tokens=torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0)),
        response_mask=(positions[None] >= 4) & (positions[None] < lengths[:, None]),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        prompt_lengths=torch.full((B,), 4),
        sequence_lengths=lengths,
    )


def _snapshot(actor) -> list[torch.Tensor]:
    from megatron_rl.actor.offload import model_tensors, optimizer_tensors

    return [t.detach().clone() for t in model_tensors(actor.model) + optimizer_tensors(actor.optimizer)]


def _optimizer_state(optimizer) -> list[torch.Tensor]:
    """Adam's moments of this rank's shard (not the parameters they update)."""
    return [v for opt in optimizer.chained_optimizers for state in opt.optimizer.state.values()
            for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1]


def _device_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _staged_round_trip(actor) -> dict:
    """The trainer's order (train.offload=all): optimizer state and gradients out before the weight push, the
    parameters after it. What stays on the device at each stage, and the bytes after the round trip."""
    from megatron_rl.actor.offload import ActorOffload, grad_tensors, param_tensors

    offload = ActorOffload(actor.model, actor.optimizer, "all")
    before = _snapshot(actor)
    params, grads = param_tensors(actor.model), grad_tensors(actor.model)
    resident = (_device_bytes(params), _device_bytes(grads), _device_bytes(_optimizer_state(actor.optimizer)))
    moved_before_push = offload.to_host(["optimizer", "grads"])
    for_push = (_device_bytes(params), _device_bytes(grads), _device_bytes(_optimizer_state(actor.optimizer)))
    moved_after_push = offload.to_host()
    generating = (_device_bytes(params), _device_bytes(grads), _device_bytes(_optimizer_state(actor.optimizer)))
    offload.to_device()
    exact = all(torch.equal(a, b) for a, b in zip(before, _snapshot(actor)))
    return {"resident": resident, "for_push": for_push, "generating": generating, "exact": exact,
            "moved": (moved_before_push, moved_after_push)}


def _closed_actors_release(*actors) -> dict:
    """Actor.close() after training: every parameter, DDP wrapper, optimizer and their storages unreachable."""
    import gc
    import weakref

    params = [p for actor in actors for chunk in actor.model for p in chunk.parameters()]
    storages = [p.untyped_storage() for p in params]
    bytes_before = sum(s.nbytes() for s in storages)
    refs = [weakref.ref(obj) for obj in params + [c for a in actors for c in a.model] + [a.optimizer for a in actors]]
    for actor in actors:
        actor.close()
    bytes_after = sum(s.nbytes() for s in storages)
    del params, storages, actors
    gc.collect()
    return {"bytes": (bytes_before, bytes_after), "alive": sum(r() is not None for r in refs), "objects": len(refs)}


def _offload_round_trips(rank: int, world_size: int, model_dir: str) -> dict:
    from megatron_rl.actor import Actor
    from megatron_rl.actor.offload import ActorOffload, model_tensors
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(timeout_s=60))
    out: dict = {"exact": [], "freed": {}, "model_kept": None, "metrics_equal": [], "staged": []}
    try:
        def make():
            return Actor(ctx, model=ModelConfig(path=model_dir), optimizer=OptimizerConfig(lr=1e-2), train=TrainConfig(),
                         algorithm=AlgorithmConfig(loss="grpo"))

        offloaded, plain = make(), make()
        batch = _batch()
        for _step in range(2):
            metrics = []
            for actor in (offloaded, plain):
                prepared, _ = actor.prepare_batch(batch)
                metrics.append({k: v for k, v in actor.train_step(prepared).items() if not k.startswith("time/")})
            out["metrics_equal"].append(metrics[0] == metrics[1])
            for mode in ("optimizer", "all"):
                offload = ActorOffload(offloaded.model, offloaded.optimizer, mode)
                before = _snapshot(offloaded)
                moved = offload.to_host()
                model_bytes = sum(t.untyped_storage().nbytes() for t in model_tensors(offloaded.model))
                optim_bytes = sum(t.untyped_storage().nbytes() for t in _optimizer_state(offloaded.optimizer))
                out["freed"][mode] = (moved, model_bytes, optim_bytes)
                offload.to_device()
                after = _snapshot(offloaded)
                out["exact"].append(all(torch.equal(a, b) for a, b in zip(before, after)) and len(before) == len(after))
            out["staged"].append(_staged_round_trip(offloaded))
        del offload  # the test's own last reference to a model (ActorOffload keeps the chunks)
        out["released"] = _closed_actors_release(offloaded, plain)
    finally:
        destroy_parallel(ctx, keep_world=True)
    return out


def test_offload_round_trip_is_bit_exact_and_training_unchanged(tmp_path):
    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = str(make_tiny_model_dir(tmp_path / "moe", "qwen3_moe", seed=1, with_tokenizer=False))
    for rank, result in enumerate(run_distributed(_offload_round_trips, 2, model_dir, timeout=180)):
        assert result["exact"] == [True] * 4, (rank, result)
        released = result["released"]  # after training: DDP's accumulator hooks once kept all of it alive
        assert released["bytes"][0] > 0 and released["bytes"][1] == 0 and released["alive"] == 0, released
        assert released["objects"] > 50, released
        assert result["metrics_equal"] == [True, True], (rank, result)
        moved, model_bytes, optim_bytes = result["freed"]["optimizer"]
        # fp32: Adam's two moments of this rank's shard moved; the main parameters are the model's and stay
        assert moved > 0 and optim_bytes == 0 and model_bytes > 0, (rank, result["freed"])
        moved, model_bytes, optim_bytes = result["freed"]["all"]
        assert moved > 0 and model_bytes == 0 and optim_bytes == 0, (rank, result["freed"])
        for staged in result["staged"]:
            params, grads, optim = staged["resident"]
            assert params > 0 and grads > 0 and optim > 0, staged
            # before the push only the parameters stay; after it nothing; the bytes come back bit-exact
            assert staged["for_push"] == (params, 0, 0) and staged["generating"] == (0, 0, 0), staged
            assert staged["moved"][1] == params and staged["moved"][0] >= grads + optim and staged["exact"], staged
