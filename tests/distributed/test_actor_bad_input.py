"""Bad batches fail before any collective, with errors that name the sample and the fix."""

from __future__ import annotations

import math

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
        advantages=torch.ones(B),
        prompt_lengths=torch.full((B,), 4),
        sequence_lengths=lengths,
    )


def _errors(rank: int, world_size: int, model_dir: str) -> dict:
    from megatron_rl.actor import Actor, BatchError
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(timeout_s=60))
    messages = {}

    def expect(name, fn):
        try:
            fn()
        except BatchError as err:
            messages[name] = str(err)
        else:
            messages[name] = None

    try:
        actor = Actor(ctx, model=ModelConfig(path=model_dir), optimizer=OptimizerConfig(), train=TrainConfig(old_logprobs="forward"),
                      algorithm=AlgorithmConfig(loss="grpo", routing_replay="R2"))
        batch = _batch()
        old = actor.compute_logprobs(batch)
        nan_old = old.clone()
        nan_old[2, 6] = float("nan")
        expect("nan_old", lambda: actor.train_step(batch.replace(old_logprobs=nan_old, old_routed_experts=None)))
        nan_rollout = torch.zeros(B, T)
        nan_rollout[3, 10] = float("nan")
        expect("nan_rollout", lambda: actor.compute_logprobs(batch.replace(rollout_logprobs=nan_rollout)))
        expect("routes_shape", lambda: actor.compute_logprobs(batch.replace(routed_experts=torch.zeros(B, T, 3, 2, dtype=torch.int16))))
        missing = torch.zeros(B, T, 2, 2, dtype=torch.int16)
        missing[1, 2] = -1  # a prompt token the engine did not capture: fine for metrics, not for R3 replay
        actor.compute_logprobs(batch.replace(routed_experts=missing), record_routes=True)
        r3 = Actor(ctx, model=ModelConfig(path=model_dir), optimizer=OptimizerConfig(), train=TrainConfig(),
                   algorithm=AlgorithmConfig(loss="grpo", routing_replay="R3"))
        expect("routes_missing", lambda: r3.compute_logprobs(batch.replace(routed_experts=missing)))
        expect("r3_without_routes", lambda: r3.compute_logprobs(batch))
        from megatron_rl.actor import PackedRoutes

        whole = torch.zeros(B, T, 2, 2, dtype=torch.int16)  # the trainer's step batch: routes packed, for distribute only
        packed = PackedRoutes(torch.cat([whole[b, :n] for b, n in enumerate(batch.lengths().tolist())]),
                              torch.cat([torch.zeros(1, dtype=torch.int64), batch.lengths().cumsum(0)]))
        expect("packed_not_shared", lambda: r3.prepare_batch(batch.replace(routed_experts=packed)))
        r3.close()
        long_tokens = torch.zeros(B, 600, dtype=torch.int64)
        long_mask = torch.zeros(B, 600, dtype=torch.bool)
        long_mask[1, 5:600] = True
        expect("too_long", lambda: actor.compute_logprobs(batch.replace(
            tokens=long_tokens, response_mask=long_mask, sequence_lengths=torch.tensor([10, 600, 10, 10]))))
        expect("no_old", lambda: actor.train_step(batch))
        expect("r2_without_routes", lambda: actor.train_step(batch.replace(old_logprobs=old)))
        actor.close()
        # the training forward as the old policy (train.old_logprobs=auto, one optimizer step): a model whose forward
        # gives NaN is refused before the optimizer steps, and no weight moves
        own = Actor(ctx, model=ModelConfig(path=model_dir), optimizer=OptimizerConfig(lr=0.1), train=TrainConfig(),
                    algorithm=AlgorithmConfig(loss="gspo"))
        messages["own_source"] = own.old_logprobs_from
        # old logprobs the caller gives are used as given (here 0.05 nats below the policy: GSPO's ratio e^0.05)
        given = own.train_step(batch.replace(old_logprobs=own.compute_logprobs(batch) - 0.05 * batch.response_mask))
        messages["own_given_ratio"] = (given["ratio/min"], given["ratio/max"])
        norm = own.model[0].module.decoder.final_layernorm.weight
        with torch.no_grad():
            norm[0] = float("nan")
        before = {n: p.detach().clone() for n, p in own.model[0].named_parameters()}
        prepared, _ = own.prepare_batch(batch)
        messages["own_prepared_old"] = prepared.old_logprobs
        expect("nan_own", lambda: own.train_step(prepared))
        messages["own_unchanged"] = all(torch.equal(p.detach(), before[n]) or n.endswith("final_layernorm.weight")
                                        for n, p in own.model[0].named_parameters())
        messages["own_norm_kept"] = torch.equal(norm[1:].detach(), before["module.decoder.final_layernorm.weight"][1:])
        own.close()
        bypass = Actor(ctx, model=ModelConfig(path=model_dir), optimizer=OptimizerConfig(), train=TrainConfig(),
                       algorithm=AlgorithmConfig(loss="grpo", bypass_mode=True))
        expect("bypass_without_rollout", lambda: bypass.prepare_batch(batch))
        # a batch whose first mini-batch was left to the training forward, given to an actor that does not do that
        expect("foreign_prepared", lambda: bypass.train_step(prepared.replace(rollout_logprobs=torch.zeros(B, T))))

        def no_forward(*args, **kwargs):
            raise AssertionError("bypass mode ran the old-policy forward")

        bypass.compute_logprobs = no_forward
        engine_logprobs = torch.where(batch.response_mask, old - 0.01, 0.0)
        prepared, _ = bypass.prepare_batch(batch.replace(rollout_logprobs=engine_logprobs))
        messages["bypass_old_is_engine"] = prepared.old_logprobs is engine_logprobs
        messages["bypass_trains"] = bypass.train_step(prepared)["tokens/sum"]
        bypass.close()
    finally:
        destroy_parallel(ctx, keep_world=True)
    return messages


def test_bad_batches_are_refused_with_the_sample_and_the_fix(tmp_path):
    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = str(make_tiny_model_dir(tmp_path / "moe", "qwen3_moe", seed=1, with_tokenizer=False))
    m = run_distributed(_errors, 1, model_dir, timeout=120)[0]
    assert "sample 2" in m["nan_old"] and "old_logprobs[2, 6]" in m["nan_old"], m["nan_old"]
    assert "sample 3" in m["nan_rollout"] and "rollout engine" in m["nan_rollout"], m["nan_rollout"]
    assert "shape (4, 16, 3, 2)" in m["routes_shape"] and "2 x top-2" in m["routes_shape"], m["routes_shape"]
    assert "sample 1" in m["routes_missing"] and "routed_experts_include_prompt" in m["routes_missing"], m["routes_missing"]
    assert "sample 1 has 600 tokens" in m["too_long"] and "max_position_embeddings=512" in m["too_long"], m["too_long"]
    assert "compute_logprobs" in m["no_old"], m["no_old"]
    assert "R2" in m["r2_without_routes"] and "record_routes=True" in m["r2_without_routes"], m["r2_without_routes"]
    assert "bypass_mode needs batch.rollout_logprobs" in m["bypass_without_rollout"], m["bypass_without_rollout"]
    assert m["bypass_old_is_engine"] and m["bypass_trains"] == int(_batch().response_mask.sum())
    assert m["own_source"] == "training_forward" and m["own_prepared_old"] is None
    assert "takes them from the engine's (algorithm.bypass_mode)" in m["foreign_prepared"], m["foreign_prepared"]
    assert all(abs(r - math.exp(0.05)) < 1e-5 for r in m["own_given_ratio"]), m["own_given_ratio"]
    # every response token of the batch (4 rows: 12 + 8 + 5 + 10) is NaN; the message says where it came from and the fix
    assert "policy logprobs: 35 non-finite response token(s)" in m["nan_own"] and "lower the lr" in m["nan_own"], m["nan_own"]
    assert "did not step" in m["nan_own"] and m["own_unchanged"] and m["own_norm_kept"]
    assert "R3" in m["r3_without_routes"] and "return_routed_experts" in m["r3_without_routes"], m["r3_without_routes"]
    assert "packed by sample" in m["packed_not_shared"] and "give the step's batch to actor.distribute" in m["packed_not_shared"]
