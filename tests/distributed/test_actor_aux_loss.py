"""The MoE load-balancing loss keeps megatron's scaling: its gradient is the average over microbatches and DP ranks.

The actor scales the policy loss so that megatron's 1/M and DDP's 1/(D x CP)
cancel for it, but leaves megatron's MoEAuxLossAutoScaler alone (see
megatron_rl.actor.step). With zero advantages the policy loss has zero
gradient, so one SGD step at lr 1 moves the weights by minus the aux-loss
gradient alone. A set S of 4 sequences:

  (a) 1 rank, S in one microbatch;
  (b) 1 rank, S twice (8 rows, micro_batch_size 4): two microbatches, each S;
  (c) DP2, S twice: each rank gets one S.

Averages over microbatches and ranks give the same gradient in all three; a
sum (or an aux loss scaled like the policy loss) would double it in (b) and (c).
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_distributed

S, T = 4, 20


def make_batch(copies: int):
    from megatron_rl.actor import TrainBatch

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (S, T), generator=g)
    lengths = torch.tensor([20, 14, 17, 9])
    positions = torch.arange(T)
    mask = (positions[None] >= 3) & (positions[None] < lengths[:, None])
    return TrainBatch(
        tokens=tokens.repeat(copies, 1),
        response_mask=mask.repeat(copies, 1),
        advantages=torch.zeros(S * copies),
        sequence_lengths=lengths.repeat(copies),
        old_logprobs=torch.zeros(S * copies, T),
    )


def _worker(rank: int, world_size: int, model_dir: str, copies_list: list[int]) -> list | None:
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models import export_hf_state_dict
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(timeout_s=120))
    results = []
    try:
        for copies in copies_list:
            actor = Actor(
                ctx,
                model=ModelConfig(path=model_dir, moe_aux_loss_coeff=0.1),
                optimizer=OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0, use_distributed_optimizer=False),
                train=TrainConfig(micro_batch_size=S, routing_drift_metrics=False),
                algorithm=AlgorithmConfig(loss="dapo"),
            )
            try:
                metrics = actor.train_step(actor.distribute(make_batch(copies) if rank == 0 else None))  # as the trainer
                results.append((metrics["microbatches_per_rank"], export_hf_state_dict(actor.model, ctx)))
            finally:
                actor.close()
    finally:
        destroy_parallel(ctx, keep_world=True)
    return results if rank == 0 else None


def test_aux_loss_gradient_is_the_per_microbatch_average(tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = str(make_tiny_model_dir(tmp_path / "moe", "qwen3_moe", seed=9, with_tokenizer=False))
    initial = load_file(f"{model_dir}/model.safetensors")
    (one_mb, a), (two_mb, b) = run_distributed(_worker, 1, model_dir, [1, 2], timeout=180)[0]
    ((dp_mb, c),) = run_distributed(_worker, 2, model_dir, [2], timeout=180)[0]
    assert (one_mb, two_mb, dp_mb) == (1, 2, 1)

    def update(params):
        return torch.cat([(params[k] - initial[k]).flatten() for k in sorted(initial)])

    ua, ub, uc = update(a), update(b), update(c)
    assert ua.norm() > 1e-4, "the aux loss produced no gradient"
    router = torch.cat([(a[k] - initial[k]).flatten() for k in sorted(initial) if k.endswith("mlp.gate.weight")])
    assert router.norm() > 0, "the aux loss must reach the router"
    for name, other in (("two microbatches", ub), ("DP2", uc)):
        err = ((other - ua).norm() / ua.norm()).item()
        assert err <= 1e-5, f"{name}: aux-loss gradient differs from one microbatch's by {err:.3g} (a sum would be 1.0)"
