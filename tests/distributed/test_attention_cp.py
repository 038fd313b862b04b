"""Context parallelism (CP2, real gloo processes) through LocalCoreAttention equals one process on the whole sequences.

One launch of 2 ranks:
1. attention alone: packed THD sequences (lengths padded to a multiple of 2 x CP, one of them
   not a multiple before padding) and an unpacked [s, b] batch, each rank holding chunks r and
   2 x CP - 1 - r of every sequence; outputs and q/k/v gradients, reassembled from the ranks'
   chunks, equal attention written out in float64 on the whole sequences;
2. a tiny megatron GPT (Qwen3-MoE) at CP2 on one packed microbatch, forward + backward of a
   random linear function of the logits: the logits of each rank's chunks equal those of each
   sequence run alone on one rank (CP1), and the parameter gradients summed over the CP ranks
   (what finalize_model_grads all-reduces) equal the single-rank ones; the same for an
   unpacked [b, s] batch (megatron's RoPE table sliced per CP rank, through the CPU layer).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.distributed.harness import run_distributed

HEADS, GROUPS, HEAD_DIM = 4, 2, 16
ATTN_LENGTHS = [6, 16, 1, 11]  # padded to multiples of 4: 8, 16, 4, 12
MODEL_LENGTHS = [7, 18, 3]  # padded: 8, 20, 4
VOCAB = 256


def reference_attention(q, k, v, scale: float) -> torch.Tensor:
    """One sequence: q [s, np, hn], k/v [s, ng, hn] -> [s, np * hn], causal, float64."""
    q, k, v = (t.double() for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qnd,knd->nqk", q, k) * scale
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    return torch.einsum("nqk,knd->qnd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v).reshape(q.shape[0], -1)


def attention_inputs(total: int, seed: int):
    """Full q, k, v [total, heads, hn] and an upstream gradient [total, heads * hn], the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(total, GROUPS, HEAD_DIM, generator=gen)
    v = torch.randn(total, GROUPS, HEAD_DIM, generator=gen)
    return q, k, v, torch.randn(total, HEADS * HEAD_DIM, generator=gen)


def local_indices(offsets: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global packed positions this CP rank holds, in its local order."""
    from megatron_rl.models.attention import cp_chunk_indices

    return torch.cat([start + cp_chunk_indices(end - start, cp_size, cp_rank) for start, end in zip(offsets[:-1], offsets[1:])])


def _attention_cp(ctx) -> dict:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.attention import LocalCoreAttention, packed_seq_params

    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS, kv_channels=HEAD_DIM,
        attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True, context_parallel_size=ctx.cp_size,
    )  # fmt: skip
    attention = LocalCoreAttention(config, 1, AttnMaskType.causal, "self")
    params = packed_seq_params(ATTN_LENGTHS, multiple=2 * ctx.cp_size)
    offsets = params.cu_seqlens_q_padded.tolist()
    mine = local_indices(offsets, ctx.cp_size, ctx.cp_rank)
    results = {"packed_index": mine}
    q, k, v, upstream = attention_inputs(offsets[-1], seed=1)
    local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    out = attention(*local, None, packed_seq_params=params)
    (out * upstream[mine]).sum().backward()
    results["packed"] = (out.detach(), *(t.grad for t in local))

    # Unpacked [s, b, n, hn]: each batch row is one sequence of 16 tokens split over the CP ranks.
    seq, batch = 16, 2
    mine = local_indices([0, seq], ctx.cp_size, ctx.cp_rank)
    q, k, v, upstream = attention_inputs(seq * batch, seed=2)
    local = [t.reshape(seq, batch, *t.shape[1:])[mine].clone().requires_grad_() for t in (q, k, v)]
    out = attention(*local, None)
    (out * upstream.reshape(seq, batch, -1)[mine]).sum().backward()
    results["unpacked_index"] = mine
    results["unpacked"] = (out.detach(), *(t.grad for t in local))

    # Sequences not padded to a multiple of 2 x CP: refused on every rank before any communication.
    unpadded = packed_seq_params(ATTN_LENGTHS)
    tokens = sum(ATTN_LENGTHS) // ctx.cp_size
    try:
        attention(torch.zeros(tokens, HEADS, HEAD_DIM), *(torch.zeros(tokens, GROUPS, HEAD_DIM),) * 2, None, packed_seq_params=unpadded)
        results["unpadded_error"] = None
    except ValueError as exc:
        results["unpadded_error"] = str(exc)
    return results


def model_inputs():
    """Sequences, and a random weight per logit (the function whose gradient is compared)."""
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen) for n in MODEL_LENGTHS]
    weights = [torch.randn(n, VOCAB, generator=gen) for n in MODEL_LENGTHS]
    return sequences, weights


def _model_cp(ctx, model_dir: str) -> dict:
    """Packed microbatch at CP: this rank's chunks of tokens/positions in, its logits and the CP-summed gradients out."""
    from megatron_rl.config import ModelConfig
    from megatron_rl.models import build_model
    from megatron_rl.models.attention import packed_seq_params

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (model,) = build_model(ModelConfig(path=model_dir), ctx)
    sequences, weights = model_inputs()
    params = packed_seq_params(MODEL_LENGTHS, multiple=2 * ctx.cp_size)
    offsets = params.cu_seqlens_q_padded.tolist()
    tokens = torch.full((offsets[-1],), 3, dtype=torch.long)
    positions = torch.cat([torch.arange(end - start) for start, end in zip(offsets[:-1], offsets[1:])])
    weight = torch.zeros(offsets[-1], VOCAB)  # padding tokens' logits do not enter the function
    for start, sequence, w in zip(offsets, sequences, weights):
        tokens[start : start + len(sequence)] = sequence
        weight[start : start + len(sequence)] = w
    mine = local_indices(offsets, ctx.cp_size, ctx.cp_rank)
    logits = model(tokens[mine][None], positions[mine][None], attention_mask=None, packed_seq_params=params)
    (logits[0, :, :VOCAB] * weight[mine]).sum().backward()
    results = {"index": mine, "logits": logits[0, :, :VOCAB].detach(), "offsets": offsets, "grads": cp_summed_grads(model, ctx)}

    # Unpacked [b, s]: each row one sequence split over the CP ranks (megatron's RoPE slices its table per rank).
    model.zero_grad()
    rows, row_weights = unpacked_inputs()
    mine = local_indices([0, rows.shape[1]], ctx.cp_size, ctx.cp_rank)
    logits = model(rows[:, mine], mine[None].expand(rows.shape[0], -1), attention_mask=None)
    (logits[..., :VOCAB] * row_weights[:, mine]).sum().backward()
    results["unpacked"] = {"index": mine, "logits": logits[..., :VOCAB].detach(), "grads": cp_summed_grads(model, ctx)}
    return results


def cp_summed_grads(model, ctx) -> dict:
    """Parameter gradients summed over the CP group (as finalize_model_grads' DP x CP all-reduce)."""
    import torch.distributed as dist

    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad, group=ctx.cp_group)
    return grads


def unpacked_inputs():
    """Two rows of 16 tokens and a random weight per logit."""
    gen = torch.Generator().manual_seed(8)
    return torch.randint(0, VOCAB, (2, 16), generator=gen), torch.randn(2, 16, VOCAB, generator=gen)


def _model_alone(ctx, model_dir: str) -> dict:
    """Each sequence run alone on this rank (no CP, no packing): logits and the accumulated gradients."""
    from megatron_rl.config import ModelConfig
    from megatron_rl.models import build_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (model,) = build_model(ModelConfig(path=model_dir), ctx)
    logits = []
    for sequence, w in zip(*model_inputs()):
        out = model(sequence[None], torch.arange(len(sequence))[None], attention_mask=None)[0, :, :VOCAB]
        (out * w).sum().backward()
        logits.append(out.detach())
    results = {"logits": logits, "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}
    model.zero_grad()
    rows, row_weights = unpacked_inputs()
    out = model(rows, torch.arange(rows.shape[1])[None].expand_as(rows), attention_mask=None)[..., :VOCAB]
    (out * row_weights).sum().backward()
    results["unpacked"] = {"logits": out.detach(), "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}
    return results


def _worker(rank: int, world_size: int, model_dir: str) -> dict:
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(context_parallel=world_size))
    try:
        results = {"attention": _attention_cp(ctx), "model": _model_cp(ctx, model_dir)}
    finally:
        destroy_parallel(ctx, keep_world=True)
    # The single-process reference: every rank joins the CP1 (DP) layout, rank 0 computes.
    ctx = init_parallel(ParallelConfig())
    try:
        if rank == 0:
            results["alone"] = _model_alone(ctx, model_dir)
    finally:
        destroy_parallel(ctx)
    return results


def _check_attention(results: list) -> None:
    from megatron_rl.models.attention import packed_seq_params

    for rank_result in results:
        assert "padded length 6 is not a multiple of 2 x CP = 4" in (rank_result["attention"]["unpadded_error"] or "")
        assert "multiple=4" in rank_result["attention"]["unpadded_error"]

    scale = HEAD_DIM**-0.5
    offsets = packed_seq_params(ATTN_LENGTHS, multiple=2 * len(results)).cu_seqlens_q_padded.tolist()
    for layout, spans, seed, shape in (
        ("packed", list(zip(offsets[:-1], offsets[1:])), 1, None),
        ("unpacked", [(0, 16)], 2, (16, 2)),
    ):
        q, k, v, upstream = attention_inputs(offsets[-1] if shape is None else shape[0] * shape[1], seed)
        if shape is not None:  # [s, b, ...]: the batch rows are the sequences
            q, k, v, upstream = (t.reshape(*shape, *t.shape[1:]).transpose(0, 1).flatten(0, 1) for t in (q, k, v, upstream))
            spans = [(b * shape[0], (b + 1) * shape[0]) for b in range(shape[1])]
        q, k, v = (t.double().requires_grad_() for t in (q, k, v))
        expected = torch.cat([reference_attention(q[a:b], k[a:b], v[a:b], scale) for a, b in spans])
        (expected * upstream.double()).sum().backward()
        got = [torch.zeros_like(t, dtype=torch.float64) for t in (expected, q, k, v)]
        for rank_result in results:
            index = rank_result["attention"][f"{layout}_index"]
            for full, part in zip(got, rank_result["attention"][layout]):
                if shape is not None:  # [s_local, b, ...] -> rows of the [b * s] layout
                    rows = (torch.arange(shape[1])[:, None] * shape[0] + index[None, :]).flatten()
                    full[rows] = part.transpose(0, 1).flatten(0, 1).double()
                else:
                    full[index] = part.double()
        for name, full, ref in zip("out q k v".split(), got, (expected, q.grad, k.grad, v.grad)):
            torch.testing.assert_close(full, ref.detach(), atol=1e-6, rtol=1e-6, msg=lambda m, where=f"CP2 {layout} {name}": f"{where}: {m}")


def _check_grads(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        scale = max(ref.abs().max().item(), 1.0)
        torch.testing.assert_close(got[name], ref, atol=1e-5 * scale, rtol=1e-5, msg=lambda m, name=name: f"{what} grad {name}: {m}")


def _check_model(results: list) -> None:
    alone = results[0]["alone"]
    offsets = results[0]["model"]["offsets"]
    logits = torch.zeros(offsets[-1], VOCAB)
    for rank_result in results:
        logits[rank_result["model"]["index"]] = rank_result["model"]["logits"]
    for start, expected in zip(offsets, alone["logits"]):
        torch.testing.assert_close(logits[start : start + len(expected)], expected, atol=1e-5, rtol=0)
    for rank_result in results:
        _check_grads(rank_result["model"]["grads"], alone["grads"], "CP2 packed")

    logits = torch.zeros_like(alone["unpacked"]["logits"])
    for rank_result in results:
        logits[:, rank_result["model"]["unpacked"]["index"]] = rank_result["model"]["unpacked"]["logits"]
    torch.testing.assert_close(logits, alone["unpacked"]["logits"], atol=1e-5, rtol=0)
    for rank_result in results:
        _check_grads(rank_result["model"]["unpacked"]["grads"], alone["unpacked"]["grads"], "CP2 unpacked")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("attention_cp") / "qwen3_moe", "qwen3_moe", seed=6, with_tokenizer=False))


def test_context_parallel_attention_and_model_equal_one_process(model_dir):
    results = run_distributed(_worker, 2, model_dir, timeout=240)
    _check_attention(results)
    _check_model(results)
