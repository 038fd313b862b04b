"""LocalCoreAttention (packed THD, causal) against attention written out per sequence, and the packing helpers.

The reference is softmax(s q k^T + causal mask) v computed in float64 on each
sequence alone (unpacked), with GQA as megatron does it (key/value groups
repeated over their query heads); gradients come from autograd on that
reference. The model-level test runs a tiny megatron GPT on one packed
microbatch and on each sequence alone.
"""

from __future__ import annotations

import warnings
from itertools import pairwise

import pytest
import torch

HEADS, GROUPS, HEAD_DIM = 4, 2, 16


@pytest.fixture(scope="module")
def parallel_ctx():
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig())
    yield ctx
    destroy_parallel(ctx)


def make_attention(softmax_scale=None):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rl.models.attention import LocalCoreAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
    )
    return LocalCoreAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=softmax_scale)


def reference_attention(q, k, v, scale: float) -> torch.Tensor:
    """One sequence: q [s, np, hn], k/v [s, ng, hn] -> [s, np * hn], causal, float64."""
    q, k, v = (t.double() for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qnd,knd->nqk", q, k) * scale
    causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return torch.einsum("nqk,knd->qnd", probs, v).reshape(q.shape[0], -1)


def random_qkv(total: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(total, GROUPS, HEAD_DIM, generator=gen)
    v = torch.randn(total, GROUPS, HEAD_DIM, generator=gen)
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("multiple, softmax_scale", [(1, None), (8, 0.3)])
def test_packed_attention_equals_each_sequence_alone(parallel_ctx, multiple, softmax_scale):
    from megatron_rl.models.attention import packed_seq_params

    lengths = [1, 37, 3, 64, 9]  # very different lengths, a single-token sequence among them
    params = packed_seq_params(lengths, multiple=multiple)
    offsets = params.cu_seqlens_q_padded.tolist()
    attention = make_attention(softmax_scale)
    scale = softmax_scale if softmax_scale is not None else HEAD_DIM**-0.5
    q, k, v = random_qkv(offsets[-1], seed=multiple)
    out = attention(q, k, v, None, packed_seq_params=params)
    assert out.shape == (offsets[-1], HEADS * HEAD_DIM)

    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    real = torch.zeros(offsets[-1], dtype=torch.bool)  # padding rows get no gradient from the loss
    for start, n in zip(offsets, lengths):
        real[start : start + n] = True
    (out.double() * upstream * real[:, None]).sum().backward()

    for start, n in zip(offsets, lengths):
        span = slice(start, start + n)
        q1, k1, v1 = (t.detach()[span].clone().requires_grad_() for t in (q, k, v))
        expected = reference_attention(q1, k1, v1, scale)
        (expected * upstream[span]).sum().backward()
        torch.testing.assert_close(out[span].double(), expected, atol=1e-6, rtol=0)
        for packed, alone in ((q, q1), (k, k1), (v, v1)):
            torch.testing.assert_close(packed.grad[span].double(), alone.grad.double(), atol=1e-6, rtol=1e-6)
    # Padding is inert: no real token's output depends on a padding key or value.
    for tensor in (k, v):
        assert torch.all(tensor.grad[~real] == 0)


def test_unpacked_attention_is_causal_or_follows_megatrons_mask(parallel_ctx):
    attention = make_attention()
    scale = HEAD_DIM**-0.5
    seq, batch = 12, 2
    q, k, v = (t.detach().reshape(seq, batch, *t.shape[1:]) for t in random_qkv(seq * batch, seed=5))
    out = attention(q, k, v, None)
    for b in range(batch):
        torch.testing.assert_close(out[:, b].double(), reference_attention(q[:, b], k[:, b], v[:, b], scale), atol=1e-6, rtol=0)
    # megatron's convention: True = masked out. Hiding the first 4 keys of row 1 from every query but the first 4.
    mask = torch.ones(seq, seq, dtype=torch.bool).tril().logical_not().expand(batch, 1, seq, seq).clone()
    mask[1, 0, 4:, :4] = True
    out = attention(q, k, v, mask)
    torch.testing.assert_close(out[:, 0].double(), reference_attention(q[:, 0], k[:, 0], v[:, 0], scale), atol=1e-6, rtol=0)
    tail = reference_attention(q[4:, 1], k[4:, 1], v[4:, 1], scale)
    torch.testing.assert_close(out[4:, 1].double(), tail, atol=1e-6, rtol=0)


def test_bad_packed_input_is_named(parallel_ctx):
    from megatron_rl.models.attention import packed_seq_params

    attention = make_attention()
    q, k, v = (t.detach() for t in random_qkv(10, seed=0))
    with pytest.raises(ValueError, match=r"packed query has 10 tokens but cu_seqlens cover 12 tokens"):
        attention(q, k, v, None, packed_seq_params=packed_seq_params([4, 8]))
    with pytest.raises(ValueError, match="take no attention_mask"):
        attention(q, k, v, torch.zeros(10, 10, dtype=torch.bool), packed_seq_params=packed_seq_params([4, 6]))


def test_cp_chunk_indices_follow_megatrons_load_balanced_order():
    from megatron_rl.models.attention import cp_chunk_indices

    assert cp_chunk_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_chunk_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_chunk_indices(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert cp_chunk_indices(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    every = torch.cat([cp_chunk_indices(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    with pytest.raises(ValueError, match=r"length 6 is not a multiple of 2 x CP = 4.*multiple=4"):
        cp_chunk_indices(6, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2 with cp_size=2"):
        cp_chunk_indices(8, 2, 2)


def test_packed_seq_params_pads_each_sequence_to_the_multiple():
    from megatron_rl.models.attention import packed_seq_params

    params = packed_seq_params([3, 5, 8], multiple=4)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 8, 16]
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv_padded.tolist() == [0, 4, 12, 20]
    assert params.cu_seqlens_q.dtype == params.cu_seqlens_q_padded.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == 8
    assert packed_seq_params(torch.tensor([2, 1])).cu_seqlens_q_padded.tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match=r"lengths \[0\] are not positive"):
        packed_seq_params([3, 0])
    with pytest.raises(ValueError, match="multiple=0"):
        packed_seq_params([3], multiple=0)
    with pytest.raises(ValueError, match="lengths is empty"):
        packed_seq_params([])


def test_packed_microbatch_gives_each_sequences_logits_and_gradients(parallel_ctx, tmp_path):
    """A tiny megatron GPT (Qwen3-MoE: GQA, q/k norm, experts) on one packed THD microbatch."""
    from megatron_rl.config import ModelConfig
    from megatron_rl.models import build_model
    from megatron_rl.models.attention import packed_seq_params
    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "tiny", "qwen3_moe", seed=2, with_tokenizer=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # float32 on every device (auto would be bfloat16 on a GPU): the 1e-5 tolerances below are fp32's.
        (model,) = build_model(ModelConfig(path=str(model_dir), dtype="float32"), parallel_ctx)
    device = parallel_ctx.device  # the model's device; inputs go there
    lengths = [2, 29, 6, 11]
    gen = torch.Generator().manual_seed(11)
    sequences = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    params = packed_seq_params(lengths, multiple=4, device=device)  # padding inside the pack, as CP/SP layouts have
    offsets = params.cu_seqlens_q_padded.tolist()
    tokens = torch.full((1, offsets[-1]), 3, dtype=torch.long)  # pad id between sequences
    positions = torch.cat([torch.arange(end - start) for start, end in pairwise(offsets)])[None]
    for start, sequence in zip(offsets, sequences):
        tokens[0, start : start + len(sequence)] = sequence
    weights = [torch.randn(n, 256, generator=gen).to(device) for n in lengths]  # a random linear function of the logits
    tokens, positions = tokens.to(device), positions.to(device)

    packed = model(tokens, positions, attention_mask=None, packed_seq_params=params)
    sum(((packed[0, start : start + n] * w).sum() for start, n, w in zip(offsets, lengths, weights))).backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for start, sequence, w in zip(offsets, sequences, weights):
        alone = model(sequence[None].to(device), torch.arange(len(sequence), device=device)[None], attention_mask=None)
        torch.testing.assert_close(packed[0, start : start + len(sequence)], alone[0], atol=1e-5, rtol=0)
        (alone[0] * w).sum().backward()  # gradients accumulate over the sequences
    alone_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert alone_grads.keys() == packed_grads.keys() and len(alone_grads) > 10
    for name, grad in alone_grads.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5 * max(scale, 1.0), rtol=1e-5, msg=name)


def test_single_query_sees_every_key(parallel_ctx):
    """One query against several keys (a KV-cache decode step), as megatron's softmax treats sq == 1: no causal mask."""
    attention = make_attention()
    q, k, v = (t.detach() for t in random_qkv(6, seed=4))
    out = attention(q[-1:, None], k[:, None], v[:, None], None)
    expected = reference_attention(q, k, v, HEAD_DIM**-0.5)[-1:]  # the last query of the causal sequence sees all 6 keys
    torch.testing.assert_close(out[:, 0].double(), expected, atol=1e-6, rtol=0)


def _varlen_math(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size):
    """varlen_attn's contract (T, H, D tensors, cu_seqlens, causal window (-1, 0)) written out per sequence in
    float64: torch has no CPU flash kernel, so this checks what LocalCoreAttention hands the GPU kernel (layout,
    offsets, scale, causality, heads), not the kernel itself (tests/gpu run that)."""
    assert window_size == (-1, 0) and torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    # one head dim D for query, key and value (the docstring's shapes; flash checks v against q's head size)
    assert query.shape[-1] == key.shape[-1] == value.shape[-1], (query.shape, key.shape, value.shape)
    offsets = cu_seq_q.tolist()
    assert max_q == max_k == max(b - a for a, b in pairwise(offsets))
    outputs = [reference_attention(query[a:b], key[a:b], value[a:b], scale) for a, b in pairwise(offsets)]
    return torch.cat(outputs).reshape(query.shape).to(query.dtype)


def varlen_kernel_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1)):
    """torch 2.11's varlen_attn signature, exactly (no enable_gqa: its flash call needs as many key as query heads)."""
    assert key.shape[1] == value.shape[1] == query.shape[1], "2.11's varlen_attn has no grouped-query heads"
    return _varlen_math(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size)


def varlen_kernel_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's varlen_attn signature, exactly."""
    assert enable_gqa == (query.shape[1] != key.shape[1])
    return _varlen_math(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size)


@pytest.mark.parametrize("kernel", [varlen_kernel_2_11, varlen_kernel_2_13], ids=["torch2.11", "torch2.13"])
@pytest.mark.parametrize("multiple", [1, 8])
def test_varlen_packed_attention_gives_the_per_sequence_values_and_gradients(parallel_ctx, multiple, kernel):
    """packed_kernel="varlen" (the GPU choice) sends the whole microbatch to the varlen kernel in one call, with the
    padded offsets, bound as that torch release's signature allows (models.varlen): values and gradients equal the
    per-sequence path's (the CPU and CP choice), grouped-query heads included."""
    from megatron_rl.models.attention import packed_seq_params
    from megatron_rl.models.varlen import varlen_binding

    assert GROUPS < HEADS  # the grouped-query case is the one torch 2.11 cannot take as is
    params = packed_seq_params([1, 37, 3, 64, 9], multiple=multiple)
    per_sequence, varlen = make_attention(0.3), make_attention(0.3)
    varlen.packed_kernel = "varlen"
    varlen.varlen_binding, _ = varlen_binding(kernel)
    calls = []
    varlen.varlen_kernel = lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
    results = []
    for attention in (per_sequence, varlen):
        q, k, v = random_qkv(params.cu_seqlens_q_padded[-1].item(), seed=5)
        out = attention(q, k, v, None, packed_seq_params=params)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)))
        results.append((out.detach(), q.grad, k.grad, v.grad))
    assert calls == [1]  # one kernel call for the five sequences
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
