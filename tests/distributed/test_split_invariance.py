"""Split invariance of every policy loss over real gloo ranks and microbatches.

One batch (26 sequences of uneven lengths, 4 of them without response tokens,
NaN in padding and in one response token) is split over D = 2 and D = 4
processes x M = 1, 2, 3 microbatches per rank, with uneven rank and microbatch
sizes, each microbatch padded to its own width, and (M >= 2) one microbatch
holding only sequences without response tokens (with D = 4, M = 3 rank 0 also
gets a microbatch with no rows at all). Each rank sums its
microbatches' ``loss_sum``, backpropagates into a parameter shared by all ranks,
and the gradients are summed over ranks (the contract: the caller cancels
megatron's 1/M and DDP's 1/D, see megatron_rl.algorithms.normalization). The
result must equal the gradient of the single-process whole-batch loss within
1e-6 (float64; in practice the difference is round-off, ~1e-16), and the
metrics merged over microbatches and all-reduced over ranks must equal the
whole batch's.

Each D is launched once; the ranks loop over every loss, option set (including every
importance-sampling correction, whose dropped tokens leave the denominators) and M.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed

LOSSES = ["grpo", "dapo", "dr_grpo", "gspo", "gspo_token"]
OPTION_SETS = {
    "plain": dict(),
    "kl_k3+entropy+tis_token+dual_clip": dict(beta=0.1, kl_estimator="k3", entropy_coeff=0.01, tis_mode="token", tis_cap=1.05, dual_clip_c=1.5),
    "kl_k2+tis_sequence": dict(beta=0.05, kl_estimator="k2", tis_mode="sequence", tis_cap=1.02),
    "icepop+kl_k3+entropy": dict(beta=0.05, entropy_coeff=0.01, tis_mode="icepop", is_lower=0.96, is_upper=1.04),
    "sequence_mask_tis": dict(tis_mode="sequence_mask_tis", is_lower=0.99, is_upper=1.01, tis_cap=1.002),
    "token_mask": dict(tis_mode="token_mask", is_upper=1.03),
    "sequence_mask": dict(tis_mode="sequence_mask", is_lower=0.985, is_upper=1.01),
}
B, T, K = 26, 10, 4
NUM_EMPTY = 4  # rows 0..3 have no response tokens
DT = torch.float64
TOLERANCE = 1e-6


def _batch():
    """The whole batch, identical on every rank (fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    lengths = torch.cat([torch.zeros(NUM_EMPTY, dtype=torch.int64), torch.randint(1, T + 1, (B - NUM_EMPTY,), generator=g)])
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)
    old = -torch.rand(B, T, generator=g, dtype=DT) * 3
    base = old + 0.08 * torch.randn(B, T, generator=g, dtype=DT)
    base = torch.where(mask, base, torch.full_like(base, float("nan")))  # garbage in the padding
    first_real = NUM_EMPTY + int(torch.nonzero(lengths[NUM_EMPTY:] >= 2)[0])
    base[first_real, 1] = float("nan")  # one non-finite response token
    return {
        "lengths": lengths,
        "mask": mask,
        "old": old,
        "base": base,
        "features": 0.05 * torch.randn(B, T, K, generator=g, dtype=DT),
        "entropy_base": torch.rand(B, T, generator=g, dtype=DT) * 2,
        "entropy_features": 0.1 * torch.randn(B, T, K, generator=g, dtype=DT),
        "ref": old + 0.1 * torch.randn(B, T, generator=g, dtype=DT),
        "rollout": old + 0.05 * torch.randn(B, T, generator=g, dtype=DT),
        "advantages": torch.randn(B, generator=g, dtype=DT),
        "token_advantages": torch.randn(B, T, generator=g, dtype=DT),
    }


def _uneven_chunks(items: list[int], parts: int) -> list[list[int]]:
    """Split into `parts` non-empty chunks of sizes roughly 1 : 2 : ... : parts."""
    weights = list(range(1, parts + 1))
    bounds, acc = [], 0
    for w in weights[:-1]:
        acc += max(1, round(len(items) * w / sum(weights)))
        bounds.append(min(acc, len(items) - (parts - len(bounds) - 1)))
    edges = [0] + bounds + [len(items)]
    return [items[edges[i] : edges[i + 1]] for i in range(parts)]


def _layout(world_size: int, num_microbatches: int) -> list[list[list[int]]]:
    """rows[rank][microbatch]: uneven ranks and microbatches; with M >= 2 the last rank has a microbatch without tokens."""
    g = torch.Generator().manual_seed(100 * world_size + num_microbatches)
    real = (torch.randperm(B - NUM_EMPTY, generator=g) + NUM_EMPTY).tolist()
    empty = list(range(NUM_EMPTY))
    layout = []
    for rank, rows in enumerate(_uneven_chunks(real, world_size)):
        if num_microbatches == 1:
            micro = [rows + (empty if rank == 0 else [])]
        elif rank == world_size - 1:
            chunks = _uneven_chunks(rows, num_microbatches - 1)
            micro = chunks[:1] + [empty] + chunks[1:]
        else:
            micro = _uneven_chunks(rows, num_microbatches)
        layout.append(micro)
    assert sorted(r for rank in layout for mb in rank for r in mb) == list(range(B))
    return layout


def _inputs(batch, theta, rows, width, token_advantages):
    """One microbatch's loss inputs (rows, padded to `width`); logprobs and entropy depend on theta."""
    logprobs = batch["base"][rows, :width] + batch["features"][rows, :width] @ theta
    entropy = batch["entropy_base"][rows, :width] + batch["entropy_features"][rows, :width] @ theta
    advantages = batch["token_advantages"][rows, :width] if token_advantages else batch["advantages"][rows]
    return (logprobs, batch["old"][rows, :width], advantages, batch["mask"][rows, :width]), dict(
        ref_logprobs=batch["ref"][rows, :width], rollout_logprobs=batch["rollout"][rows, :width], entropy=entropy
    )


def _worker(rank: int, world_size: int) -> list[dict]:
    import torch.distributed as dist

    from megatron_rl.algorithms import (
        all_reduce_metrics,
        compute_loss_denominators,
        finalize_metrics,
        get_policy_loss,
        merge_metrics,
        rejection_response_mask,
    )
    from megatron_rl.config import AlgorithmConfig

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        batch = _batch()
        results = []
        for name in LOSSES:
            fn = get_policy_loss(name)
            for option_name, options in OPTION_SETS.items():
                cfg = AlgorithmConfig(loss=name, eps_low=0.05, eps_high=0.08, **options)
                for token_advantages in ([False, True] if name == "gspo_token" else [False]):
                    # The single-process whole-batch computation.
                    theta = torch.zeros(K, dtype=DT, requires_grad=True)
                    whole_kept = rejection_response_mask(cfg, batch["old"], batch["rollout"], batch["mask"])
                    whole_denom = compute_loss_denominators([whole_kept], max_response_tokens=T)
                    args, kwargs = _inputs(batch, theta, list(range(B)), T, token_advantages)
                    whole_loss, whole_metrics = fn(*args, cfg, whole_denom, **kwargs)
                    (whole_grad,) = torch.autograd.grad(whole_loss, theta)
                    whole_final = finalize_metrics(whole_metrics)
                    for num_microbatches in (1, 2, 3):
                        rows_per_mb = _layout(world_size, num_microbatches)[rank]
                        widths = [max([1] + [int(batch["lengths"][r]) for r in rows]) for rows in rows_per_mb]
                        masks = [
                            rejection_response_mask(cfg, batch["old"][rows, :w], batch["rollout"][rows, :w], batch["mask"][rows, :w])
                            for rows, w in zip(rows_per_mb, widths)
                        ]
                        denom = compute_loss_denominators(masks, group=dist.group.WORLD, max_response_tokens=T)
                        theta = torch.zeros(K, dtype=DT, requires_grad=True)
                        local_loss = torch.zeros((), dtype=DT)
                        metric_list = []
                        for rows, width in zip(rows_per_mb, widths):
                            args, kwargs = _inputs(batch, theta, rows, width, token_advantages)
                            loss_sum, metrics = fn(*args, cfg, denom, **kwargs)
                            loss_sum.backward()  # gradients accumulate over microbatches, as in the actor
                            local_loss = local_loss + loss_sum.detach()
                            metric_list.append(metrics)
                        grad = theta.grad.clone()
                        dist.all_reduce(grad)  # summed over ranks (the caller undoes DDP's 1/D)
                        dist.all_reduce(local_loss)
                        final = finalize_metrics(all_reduce_metrics(merge_metrics(metric_list), group=dist.group.WORLD))
                        metric_errors = {
                            k: abs(final[k] - v) / max(1.0, abs(v))
                            for k, v in whole_final.items()
                            if not (v != v and final[k] != final[k])  # both NaN (an empty mean) is equal
                        }
                        results.append({
                            "case": f"{name}/{option_name}{'/token_adv' if token_advantages else ''}/D{world_size}xM{num_microbatches}",
                            "grad_error": float((grad - whole_grad).abs().max()),
                            "grad_scale": float(whole_grad.abs().max()),
                            "loss_error": abs(float(local_loss) - float(whole_loss.detach())),
                            "metric_error": max(metric_errors.values()),
                            "worst_metric": max(metric_errors, key=metric_errors.get),
                            "same_keys": final.keys() == whole_final.keys(),
                            "tokens": denom.global_num_tokens,
                            "whole_tokens": whole_denom.global_num_tokens,
                            "masked_tokens": whole_final.get("is/masked_tokens/sum", 0.0),
                        })
        return results
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradient_of_split_batch_equals_whole_batch(world_size):
    per_rank = run_distributed(_worker, world_size, timeout=150, threads_per_rank=1)
    results = per_rank[0]
    assert len(results) == (len(LOSSES) + 1) * len(OPTION_SETS) * 3
    for other in per_rank[1:]:  # every rank sees the same summed gradient
        assert [r["grad_error"] for r in other] == pytest.approx([r["grad_error"] for r in results], abs=1e-15)
    failures = [
        r for r in results
        if not (r["grad_error"] <= TOLERANCE and r["loss_error"] <= TOLERANCE and r["metric_error"] <= 1e-9
                and r["same_keys"] and r["tokens"] == r["whole_tokens"])
    ]
    assert not failures, "\n".join(str(f) for f in failures)
    # The batch must exercise the gradient (a vacuous all-clipped batch would pass trivially).
    assert all(r["grad_scale"] > 1e-4 for r in results), [r for r in results if r["grad_scale"] <= 1e-4]
    # The masking options must drop some tokens, and not all (both would make their cases vacuous).
    masking = [r for r in results if "mask" in r["case"] or "icepop" in r["case"]]
    assert masking and not [r for r in masking if not 0 < r["masked_tokens"] < r["whole_tokens"] + r["masked_tokens"]], [
        (r["case"], r["masked_tokens"], r["whole_tokens"]) for r in masking if not 0 < r["masked_tokens"] < r["whole_tokens"] + r["masked_tokens"]
    ]
