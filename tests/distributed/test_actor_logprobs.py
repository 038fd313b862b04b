"""Vocab-parallel logprobs and entropy over a real TP2 gloo group equal the full-vocabulary log_softmax.

Each rank holds half of a padded vocabulary (2 x 160 columns, 290 real:
rank 1 holds 130 real and 30 padded ones); values and gradients of
logprobs and entropy (temperature 0.7, tiny row chunks so the chunk loop runs)
must equal the single-process reference on the full logits within 1e-5.
"""

from __future__ import annotations

import torch

from tests.distributed.harness import run_distributed

N, SHARD, REAL = 37, 160, 290
TEMPERATURE = 0.7


def _full():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, N, 2 * SHARD, generator=g) * 4
    targets = torch.randint(0, REAL, (2, N), generator=g)
    grad_lp = torch.randn(2, N, generator=g)
    grad_ent = torch.randn(2, N, generator=g)
    return logits, targets, grad_lp, grad_ent


def _worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from megatron_rl.actor.logprobs import vocab_parallel_logprobs

    dist.init_process_group("gloo")
    try:
        logits, targets, grad_lp, grad_ent = _full()
        out = {}
        for inplace in (True, False):
            shard = logits[..., rank * SHARD : (rank + 1) * SHARD].clone().requires_grad_()
            view = shard * 1.0  # a non-leaf, as the model's output is (the in-place backward writes into it)
            lp, ent = vocab_parallel_logprobs(
                view, targets, group=dist.group.WORLD, vocab_start=rank * SHARD, vocab_size=REAL,
                temperature=TEMPERATURE, with_entropy=True, chunk_bytes=7 * SHARD * 4, inplace_backward=inplace,
            )
            ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
            out[inplace] = {"logprobs": lp.detach(), "entropy": ent.detach(), "grad": shard.grad}
        return out
    finally:
        dist.destroy_process_group()


def test_tp2_logprobs_equal_full_log_softmax():
    logits, targets, grad_lp, grad_ent = _full()
    full = logits.clone().requires_grad_()
    categorical = torch.distributions.Categorical(logits=full[..., :REAL] / TEMPERATURE)  # the definition
    ref_lp, ref_ent = categorical.log_prob(targets), categorical.entropy()
    ((ref_lp * grad_lp).sum() + (ref_ent * grad_ent).sum()).backward()
    results = run_distributed(_worker, 2)
    for inplace in (True, False):
        for rank, result in enumerate(results):
            r = result[inplace]
            assert (r["logprobs"] - ref_lp).abs().max() <= 1e-5
            assert (r["entropy"] - ref_ent).abs().max() <= 1e-5
            expected_grad = full.grad[..., rank * SHARD : (rank + 1) * SHARD]
            assert (r["grad"] - expected_grad).abs().max() <= 1e-5, (inplace, rank)
        assert torch.all(results[1][inplace]["grad"][..., REAL - SHARD :] == 0)  # padded columns get no gradient
