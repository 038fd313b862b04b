"""Log-probabilities and entropy of sampled tokens from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for a slice of the vocabulary,
``[N, V / TP]``. The full ``[N, V]`` logits are never gathered and no
full-vocabulary float32 log-softmax is ever built: the statistics the answer
needs are reduced over the TP group instead, and the per-vocabulary work runs
in row chunks of at most ``chunk_bytes`` of float32.

With z = logits / temperature (the rollout engine samples from
softmax(logits / temperature), so the trainer scores tokens the same way) and
the real vocabulary only (megatron pads the output layer to a multiple of
128 x TP rows; padded columns are excluded, as the engine never sees them):

    1. m_n   = max_v z_nv                 all-reduce MAX over TP
    2. S_n   = sum_v exp(z_nv - m_n)      } one all-reduce SUM over TP
       W_n   = sum_v exp(z_nv - m_n) (z_nv - m_n)   } (stacked with the pick)
       z_n,y = the target's logit, picked on the rank that owns it (0 elsewhere)
    3. lse_n = m_n + log S_n
       logprob_n = z_n,y - lse_n
       entropy_n = lse_n - E_p[z_n] = log S_n - W_n / S_n     (H = -sum p log p)

Backward (p = exp(z - lse), recomputed chunk by chunk from the saved logits):

    d logprob / d z = onehot(y) - p
    d entropy / d z = -p (z - E_p[z]) = -p (log p + H)      (E_p[z] - lse = -H)
    d / d logits    = (1 / temperature) d / d z

By default the gradient is written into the logits' own storage (as megatron's
vocab_parallel_cross_entropy does): the logits are not needed after this
backward, and the [N, V / TP] gradient then costs no memory of its own. Pass
``inplace_backward=False`` if anything else will backpropagate through the
same logits tensor.

Memory: besides the logits, forward and backward hold O(N) float32 statistics
and at most two float32 row chunks of ``chunk_bytes`` (default: an eighth of
the logits, at most 128 MiB); bench/logprobs.py measures the peak against
gather + log_softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_CHUNK_BYTES = 128 << 20
"""Largest float32 row chunk (128 MiB: 256 rows of a 128k vocabulary shard). Each chunk costs a few kernel
launches forward and backward: 16k tokens of a 32k vocabulary shard take 8 chunks, not 64 as at 32 MiB."""


def _rows_per_chunk(vocab_columns: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // max(1, 4 * vocab_columns))


def default_chunk_bytes(logits: torch.Tensor) -> int:
    """min(128 MiB, logits bytes / 8): at most two float32 chunks live at once, so the working set
    stays within a quarter of the logits shard (bf16 logits included)."""
    return int(min(DEFAULT_CHUNK_BYTES, max(1 << 16, logits.numel() * logits.element_size() // 8)))


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class _VocabParallelLogprobs(torch.autograd.Function):
    """(logprobs [N], entropy [N] or None) of targets [N] from vocab-parallel logits [N, V_shard].

    Per row chunk the forward runs 3 ops (5 with the entropy) and the backward 4 to 5, whatever the
    temperature and dtype: per-row factors are prepared once per call as [N, 1] columns, and the
    target's one-hot term is a scatter (no boolean indexing, so no host synchronisation).
    """

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, num_real, inv_temperature, chunk_bytes, with_entropy, inplace_backward):
        ctx.set_materialize_grads(False)
        num_rows = logits.shape[0]
        real = logits[:, :num_real]  # a view: the padded vocabulary columns are left out
        stats_dtype = torch.promote_types(logits.dtype, torch.float32)  # float64 logits keep float64
        device = logits.device

        # 1. Row maxima of z over the whole vocabulary (scaling by 1/T > 0 keeps the argmax).
        if num_real > 0:
            row_max = real.max(dim=-1).values.to(stats_dtype) * inv_temperature
        else:
            row_max = torch.full((num_rows,), -torch.inf, dtype=stats_dtype, device=device)
        _all_reduce(row_max, dist.ReduceOp.MAX, group)

        # 2. Sum of exp, sum of exp * (z - m) (entropy) and the target logit, in row chunks.
        local_targets = targets - vocab_start
        owned = (local_targets >= 0) & (local_targets < num_real)
        safe_targets = torch.where(owned, local_targets, 0)
        sums = torch.zeros((3, num_rows), dtype=stats_dtype, device=device)
        if num_real > 0:
            picked = real.gather(1, safe_targets.unsqueeze(1)).squeeze(1).to(stats_dtype) * inv_temperature
            sums[2] = torch.where(owned, picked, 0.0)
            neg_max = row_max.neg().unsqueeze(1)  # [N, 1]
            step = _rows_per_chunk(num_real, chunk_bytes)
            for start in range(0, num_rows, step):
                stop = min(start + step, num_rows)
                # z - m = x / T - m in one op, in stats_dtype (float32 chunk 1)
                shifted = torch.add(neg_max[start:stop], real[start:stop], alpha=inv_temperature)
                weights = shifted.exp() if with_entropy else shifted.exp_()  # float32 chunk 2 (entropy only)
                torch.sum(weights, dim=1, out=sums[0, start:stop])
                if with_entropy:
                    torch.sum(weights.mul_(shifted), dim=1, out=sums[1, start:stop])
                del shifted, weights
        _all_reduce(sums, dist.ReduceOp.SUM, group)

        # 3. logprob = z_y - lse; entropy = log S - W / S.
        log_sum = sums[0].log()
        lse = row_max + log_sum
        logprobs = sums[2] - lse
        entropy = (log_sum - sums[1] / sums[0]) if with_entropy else None

        ctx.save_for_backward(logits, safe_targets, owned, lse, *([entropy] if with_entropy else []))
        ctx.num_real = num_real
        ctx.inv_temperature = inv_temperature
        ctx.chunk_bytes = chunk_bytes
        ctx.with_entropy = with_entropy
        ctx.inplace_backward = inplace_backward
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        """With lp = z - lse (log p), H the entropy and E_p[z] - lse = -H:

            d logprob / dz = onehot(y) - p,   d entropy / dz = -p (z - E_p[z]) = -p (lp + H),
            d / d logits = (1/T) [g_l onehot(y) - p (g_e (lp + H) + g_l)] = p (a lp + b) + (g_l / T) onehot(y)

        with the per-row columns a = -g_e / T and b = -(g_e H + g_l) / T.
        """
        logits, safe_targets, owned, lse, *rest = ctx.saved_tensors
        entropy = rest[0] if rest else None
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 9
        num_rows = logits.shape[0]
        num_real = ctx.num_real
        inv_t = ctx.inv_temperature
        grad = logits if ctx.inplace_backward else torch.empty_like(logits)
        if num_real < logits.shape[1]:
            grad[:, num_real:] = 0  # padded vocabulary: no gradient
        if num_real == 0:
            return grad, None, None, None, None, None, None, None, None
        grad_lp = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.to(lse.dtype)
        b = grad_lp * -inv_t
        a = None
        if grad_entropy is not None:
            grad_ent = grad_entropy.to(lse.dtype)
            a = (grad_ent * -inv_t).unsqueeze(1)
            b = b.addcmul(grad_ent, entropy, value=-inv_t)
        b = b.unsqueeze(1)
        neg_lse = lse.neg().unsqueeze(1)
        hit = (grad_lp * inv_t * owned).unsqueeze(1)  # the one-hot term, 0 where another rank owns the target
        targets = safe_targets.unsqueeze(1)
        step = _rows_per_chunk(num_real, ctx.chunk_bytes)
        for start in range(0, num_rows, step):
            stop = min(start + step, num_rows)
            log_p = torch.add(neg_lse[start:stop], logits[start:stop, :num_real], alpha=inv_t)  # z - lse
            probs = log_p.exp()
            chunk = torch.addcmul(b[start:stop], log_p, a[start:stop]) if a is not None else b[start:stop]
            chunk = probs.mul_(chunk)
            chunk.scatter_add_(1, targets[start:stop], hit[start:stop])
            grad[start:stop, :num_real] = chunk
            del log_p, probs, chunk  # free this chunk before the next one is allocated
        return grad, None, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_bytes: int | None = None,
    inplace_backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of ``targets`` under softmax(logits / temperature).

    Args:
        logits: ``[..., V_shard]`` this rank's vocabulary slice (any float dtype); it
            must be contiguous in its last two dimensions' flattening (megatron's
            GPTModel output is).
        targets: ``[...]`` int64 global token ids (same leading shape as ``logits``).
        group: the tensor-parallel group the vocabulary is split over (None: not split).
        vocab_start: global id of this shard's first column (``tp_rank * V_shard``).
        vocab_size: the real vocabulary size (the model's, before megatron's padding);
            columns with global id >= vocab_size are excluded. None: every column is real.
        temperature: the sampling temperature (> 0).
        with_entropy: also return the entropy of softmax(logits / temperature) per row.
        chunk_bytes: bytes of one float32 row chunk (default: `default_chunk_bytes`).
        inplace_backward: write the gradient into the logits' storage (see the module docstring).

    Returns:
        ``(logprobs [...], entropy [...] or None)`` in float32 (float64 for float64 logits);
        differentiable w.r.t. logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on the leading dimensions")
    shard = logits.shape[-1]
    if vocab_size is None:
        num_real = shard
    else:
        num_real = max(0, min(shard, vocab_size - vocab_start))
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(logits)
    flat_logits = logits.reshape(-1, shard)
    flat_targets = targets.reshape(-1).to(torch.int64)
    logprobs, entropy = _VocabParallelLogprobs.apply(
        flat_logits, flat_targets, group, vocab_start, num_real, 1.0 / temperature, chunk_bytes, with_entropy, inplace_backward
    )
    logprobs = logprobs.view(targets.shape)
    if entropy is not None:
        entropy = entropy.view(targets.shape)
    return logprobs, entropy


def reference_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int | None = None, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain full-vocabulary log_softmax (logprobs, entropy) in float32: the definition, for tests and benchmarks."""
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    logprobs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logprobs, entropy


__all__ = ["DEFAULT_CHUNK_BYTES", "default_chunk_bytes", "reference_logprobs", "vocab_parallel_logprobs"]
