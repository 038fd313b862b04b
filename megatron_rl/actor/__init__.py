"""The actor: megatron-core policy, vocab-parallel logprobs, the RL training step, routing replay.

    from megatron_rl.actor import Actor, TrainBatch, train_batch_from_rollouts

    actor = Actor.from_config(cfg, ctx)
    share = actor.distribute(train_batch_from_rollouts(padded, advantages) if rank == 0 else None)
    batch, metrics = actor.prepare_batch(share)
    metrics |= actor.train_step(batch)

Modules: batch (TrainBatch and its checks), logprobs (vocab-parallel logprobs and
entropy), microbatches (mini-batches, DP shares, microbatches), step (microbatch tensors,
the loss function given to megatron's schedule and its scale factor), schedule
(megatron's schedule over a mini-batch, the forward-only logprob pass), routing
(RouterReplay R2/R3 and drift metrics), optim (optimizer, LR schedule), actor.
Importing this package does not import megatron-core (building an Actor does).
"""

from megatron_rl.actor.actor import Actor, LogprobsWithRoutes
from megatron_rl.actor.batch import BatchError, PackedRoutes, TrainBatch, train_batch_from_rollouts, validate_batch
from megatron_rl.actor.logprobs import reference_logprobs, vocab_parallel_logprobs
from megatron_rl.actor.microbatches import Microbatch, plan_step


__all__ = [
    "Actor",
    "BatchError",
    "LogprobsWithRoutes",
    "Microbatch",
    "PackedRoutes",
    "TrainBatch",
    "plan_step",
    "reference_logprobs",
    "train_batch_from_rollouts",
    "validate_batch",
    "vocab_parallel_logprobs",
]
