"""The old policy from the training forward (train.old_logprobs): one forward less per step, the same step.

With one optimizer step per RL step the training forward runs at the old policy's weights, so its own
logprobs, detached, are the old logprobs. Per layout (two real ranks over gloo, the trainer's calls:
distribute, prepare_batch, train_step), two actors from the same weights train the same batch:
`forward` (a forward of its own in prepare_batch) and `training_forward`. What is checked:

- with one mini-batch, training_forward ran no forward in prepare_batch (forward hooks on the policy's chunks),
  forward did; with two, training_forward's forward ran over the second mini-batch's microbatches only;
- every loss metric, the gradient norm and every weight after the step (SGD: the update is the gradient)
  equal forward's within 1e-6 relative, for GSPO on PP2 (with R2, whose replay of the recorded routes must
  equal the training forward's own routes, and with R3's engine routes), DAPO with token TIS against engine
  logprobs on EP2 (DP2) packed, and GSPO on CP2 packed;
- the ratio is exactly 1 where the training forward is the old policy (GSPO's sequence ratio: exp(0));
- routing/drift: 0 under R2 (the second mini-batch replays what its forward recorded), else over the second
  mini-batch only (the first's is 0 by construction);
- the engine-vs-trainer routing metrics, measured in the training forward, equal those of forward's
  old-policy forward (the same weights and routers).

`forward` gets the engine routes padded to [B, T, L, K], `training_forward` packed by sample as the trainer's
step batch holds them (`PackedRoutes`): R3's replay (PP2) and the metrics-only routes (EP2) give the same step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.test_actor_replay import B, T
from tests.distributed.test_actor_replay import make_batch as replay_batch
PACKED = {"pack_sequences": True, "max_tokens_per_microbatch": 48}
CASES = {
    # name: (layout, train, algorithm, engine routes, engine logprobs)
    "PP2/gspo": ({"pipeline_parallel": 2}, {"micro_batch_size": 2}, {"loss": "gspo"}, False, False),
    "PP2/gspo/R2": ({"pipeline_parallel": 2}, {"micro_batch_size": 2}, {"loss": "gspo", "routing_replay": "R2"}, False, False),
    "PP2/gspo/R3": ({"pipeline_parallel": 2}, {"micro_batch_size": 2}, {"loss": "gspo", "routing_replay": "R3"}, True, False),
    "EP2/dapo/tis/packed": ({"expert_parallel": 2}, PACKED, {"loss": "dapo", "tis_mode": "token"}, True, True),
    "CP2/gspo/packed": ({"context_parallel": 2}, PACKED, {"loss": "gspo"}, False, False),
    # two optimizer steps: the first mini-batch's old logprobs from its training forward, the second's from a forward
    # over its rows only (R2: the second replays the routes that forward recorded)
    "PP2/gspo/R2/2 mini-batches": ({"pipeline_parallel": 2}, {"micro_batch_size": 2, "mini_batches_per_step": 2},
                                   {"loss": "gspo", "routing_replay": "R2"}, False, False),
    "DP2/dapo/tis/2 mini-batches": ({}, {"micro_batch_size": 2, "mini_batches_per_step": 2},
                                    {"loss": "dapo", "tis_mode": "token"}, False, True),
}
TOLERANCE = 1e-6


def make_batch(engine_routes: bool, engine_logprobs: bool, packed: bool = False):
    """The routing-replay test's batch (8 rows of 9-24 tokens, random engine routes), routes int8 as compact_routes
    makes them for 8 experts (packed: without padding, as the trainer's step batch holds them), and engine logprobs
    near, not equal to, the trainer's (TIS weights other than 1)."""
    batch = replay_batch(engine_routes, packed=packed)
    g = torch.Generator().manual_seed(3)
    routes = batch.routed_experts
    if engine_routes:
        routes = dataclasses.replace(routes, values=routes.values.to(torch.int8)) if packed else routes.to(torch.int8)
    return batch.replace(
        routed_experts=routes,
        rollout_logprobs=torch.where(batch.response_mask, -5.0 + 0.3 * torch.rand(B, T, generator=g), 0.0) if engine_logprobs else None,
    )


def _step(ctx, model_dir, rank, train, algorithm, source, engine_routes, engine_logprobs) -> dict:
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, TrainConfig

    actor = Actor(ctx, model=ModelConfig(path=model_dir), optimizer=OptimizerConfig(name="sgd", lr=0.1, clip_grad=0.0, use_distributed_optimizer=False),
                  train=TrainConfig(old_logprobs=source, **train), algorithm=AlgorithmConfig(**algorithm))
    try:
        forwards = [0]
        hooks = [chunk.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1)) for chunk in actor.model]
        # the engine routes padded for `forward`, packed (the trainer's) for `training_forward`: the same step
        packed = source == "training_forward"
        share = actor.distribute(make_batch(engine_routes, engine_logprobs, packed) if rank == 0 else None)
        share, prepare_metrics = actor.prepare_batch(share)
        prepare_forwards = forwards[0]
        for hook in hooks:
            hook.remove()
        first = len(actor._my_microbatches(share)[0])
        metrics = actor.train_step(share)
        weights = {name: p.detach().float().clone() for chunk in actor.model for name, p in chunk.named_parameters()}
        return {"source": actor.old_logprobs_from, "prepare_forwards": prepare_forwards, "prepare": prepare_metrics,
                "first_mini_batch_microbatches": first,
                "train": metrics, "weights": weights}
    finally:
        actor.close()


def _worker(rank: int, world_size: int, model_dir: str) -> dict:
    from megatron_rl.config import ParallelConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    shape = model_shape(load_hf_config(model_dir))
    out = {}
    for name, (layout, train, algorithm, engine_routes, engine_logprobs) in CASES.items():
        ctx = init_parallel(ParallelConfig(timeout_s=120, **layout), shape=shape)
        try:
            out[name] = {source: _step(ctx, model_dir, rank, train, algorithm, source, engine_routes, engine_logprobs)
                         for source in ("forward", "training_forward")}
        finally:
            destroy_parallel(ctx, keep_world=True)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = str(make_tiny_model_dir(tmp_path_factory.mktemp("old") / "moe", "qwen3_moe", seed=7, with_tokenizer=False))
    return run_distributed(_worker, 2, model_dir, timeout=300)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_the_training_forward_as_old_policy_gives_the_step_of_a_forward_of_its_own(ranks, name):
    for rank, result in enumerate(ranks):
        forward, own = result[name]["forward"], result[name]["training_forward"]
        assert (forward["source"], own["source"]) == ("forward", "training_forward")
        mini_batches = CASES[name][1].get("mini_batches_per_step", 1)
        if mini_batches == 1:
            assert forward["prepare_forwards"] > 0 and own["prepare_forwards"] == 0, (rank, forward["prepare_forwards"], own["prepare_forwards"])
        else:  # each mini-batch's forward calls: its microbatches (x PP stages' chunks on this rank: one)
            assert own["prepare_forwards"] == forward["prepare_forwards"] - own["first_mini_batch_microbatches"] > 0, (
                rank, forward["prepare_forwards"], own["prepare_forwards"], own["first_mini_batch_microbatches"])
        f, o = forward["train"], own["train"]
        assert f["tokens/sum"] == o["tokens/sum"] > 0 and f["grad_norm"] > 0
        compared = [k for k in f if k.startswith(("loss", "grad_norm", "tokens", "sequences", "ratio", "clip", "is/", "mismatch/",
                                                  "kl", "entropy"))]
        assert "loss/sum" in compared and "ratio/max" in compared, sorted(f)
        if CASES[name][4]:
            assert "is/weight" in compared and "mismatch/abs_logprob_diff" in compared, sorted(f)
        differ = {k: (f[k], o.get(k)) for k in compared if k not in o or not _close(f[k], o[k])}
        assert not differ, (rank, differ)
        worst = max(float(((forward["weights"][n] - w).abs() / (w.abs() + 1e-3)).max()) for n, w in own["weights"].items())
        assert worst <= TOLERANCE, (rank, worst)
        if CASES[name][2]["loss"] == "gspo" and mini_batches == 1:
            assert o["ratio/min"] == o["ratio/max"] == 1.0, (o["ratio/min"], o["ratio/max"])
        if CASES[name][3]:
            # forward measured the engine's routes in its old-policy forward, training_forward in its training forward
            for key in ("routing/engine_vs_trainer", "routing/engine_vs_trainer_used"):
                assert _close(forward["prepare"][key], o[key]), (key, forward["prepare"][key], o[key])
            assert o["routing/engine_vs_trainer"] > 0
        elif mini_batches == 1:  # no engine routes: old-vs-new drift is 0 by construction and not logged
            assert not any(k.startswith("routing/") for k in o), sorted(o)
        elif CASES[name][2].get("routing_replay") == "R2":  # the second mini-batch replays the routes its forward recorded
            assert o["routing/drift"] == f["routing/drift"] == 0.0
        else:  # over the second mini-batch only (the first's, 0 by construction, is in forward's mean)
            assert o["routing/drift"] >= f["routing/drift"] > 0
