"""models.moe's sorted MoE path against megatron-core's own router and permutation, and a hand-worked dispatch.

* SortedTopKRouter's (probs, ids) equal megatron's TopKRouter's dense maps read at the same experts, for each
  score function (softmax after / before the top-k, sigmoid with an expert bias, group-limited top-k, scaling),
  record and replay included, and it counts the expert-bias tokens as megatron does;
* SortedTokenDispatcher's expert rows, per-expert counts and offsets equal megatron's ``permute`` (the same
  order), its combine equals megatron's ``unpermute``, and its gradients equal those of megatron's pair;
* a hand-worked dispatch of 3 tokens, top-2 of 3 experts;
* parallel.grouped_gemm_torch takes the dispatcher's device offsets without reading the counts on the host.
"""

from __future__ import annotations

import types

import pytest
import torch


@pytest.fixture(scope="module")
def parallel_ctx():
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig())
    yield ctx
    destroy_parallel(ctx)


def _config(**moe):
    from megatron.core.transformer import TransformerConfig

    fields = dict(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=8, moe_router_topk=2,
                  moe_ffn_hidden_size=8, use_cpu_initialization=True, add_bias_linear=False,
                  moe_router_dtype="fp32", moe_enable_routing_replay=True, moe_aux_loss_coeff=0.0,
                  moe_router_load_balancing_type="none")
    return TransformerConfig(**(fields | moe))


CASES = {
    "softmax after top-k": {},
    "softmax before top-k": {"moe_router_pre_softmax": True},
    "sigmoid, expert bias, groups, scaling": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                                              "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                                              "moe_router_topk_scaling_factor": 2.5},
}


def _routers(config):
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl.models.moe import SortedTopKRouter

    groups = get_default_pg_collection()
    theirs, ours = TopKRouter(config, pg_collection=groups), SortedTopKRouter(config, pg_collection=groups)
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        theirs.weight.normal_(generator=torch.Generator().manual_seed(1))
        ours.weight.copy_(theirs.weight)
        if theirs.expert_bias is not None:
            theirs.expert_bias.copy_(torch.linspace(-0.3, 0.3, config.num_moe_experts))
            ours.expert_bias.copy_(theirs.expert_bias)
    return theirs, ours


@pytest.mark.parametrize("case", CASES)
def test_sorted_router_equals_megatrons_dense_maps(parallel_ctx, case):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    theirs, ours = _routers(_config(**CASES[case]))
    hidden = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(2))
    for router in (theirs, ours):
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    dense_probs, routing_map = theirs(hidden)
    probs, ids = ours(hidden)
    assert ids.shape == probs.shape == (10, 2)
    assert torch.equal(torch.zeros_like(routing_map).scatter_(1, ids, True), routing_map)
    assert torch.equal(probs, dense_probs.gather(1, ids))
    assert torch.equal(ours.router_replay.get_recorded_indices(), ids)
    if theirs.local_tokens_per_expert is not None:
        assert torch.equal(ours.local_tokens_per_expert, theirs.local_tokens_per_expert)
        assert ours.local_tokens_per_expert.sum() == 10 * 2
    # replay: another router's experts come back, their probabilities read off this router's scores
    replayed = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(i))[:2] for i in range(10)])
    for router in (theirs, ours):
        router.router_replay.set_target_indices(replayed)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    dense_probs, routing_map = theirs(hidden)
    probs, ids = ours(hidden)
    assert torch.equal(ids, replayed) and torch.equal(probs, dense_probs.gather(1, replayed))


def _dispatcher(experts: int, topk: int):
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

    from megatron_rl.models.moe import SortedTokenDispatcher

    groups = get_default_pg_collection()
    config = types.SimpleNamespace(moe_router_topk=topk)
    return SortedTokenDispatcher(experts, config, groups)


def test_a_hand_worked_dispatch_and_combine(parallel_ctx):
    """3 tokens, top-2 of 3 experts: token 0 -> (2, 0), token 1 -> (0, 1), token 2 -> (2, 1)."""
    dispatcher = _dispatcher(3, 2)
    hidden = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]])
    rows, row_probs = dispatcher.dispatch_preprocess(hidden, ids, probs)
    rows, counts, row_probs = dispatcher.dispatch_postprocess(*dispatcher.token_dispatch(rows, row_probs))
    # expert 0: tokens 0, 1; expert 1: tokens 1, 2; expert 2: tokens 0, 2
    assert rows[:, 0].tolist() == [1.0, 2.0, 2.0, 3.0, 1.0, 3.0]
    assert row_probs.tolist() == pytest.approx([0.3, 0.6, 0.4, 0.1, 0.7, 0.9])
    assert counts.tolist() == [2, 2, 2] and counts.grouped_mm_offsets.tolist() == [2, 4, 6]
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(rows * row_probs[:, None])))
    # each token: the sum of its two copies times their probabilities = the token itself (probabilities sum to 1)
    assert torch.allclose(out, hidden)


@pytest.mark.parametrize("tokens, experts, topk", [(37, 8, 2), (20, 4, 3), (9, 16, 8)])
def test_sorted_dispatch_equals_megatrons_permute_and_unpermute(parallel_ctx, tokens, experts, topk):
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    probs = torch.rand(tokens, topk, generator=g)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, ids, True)
    dense_probs = torch.zeros(tokens, experts).scatter(1, ids, probs)
    hidden = torch.randn(tokens, 6, generator=g)
    grad = torch.randn(tokens, 6, generator=g)

    def megatron(h, p):
        rows, row_probs, mapping = permute(h, routing_map, probs=p, num_out_tokens=tokens * topk)
        out = unpermute(rows * row_probs[:, None] * 3.0, mapping, restore_shape=h.shape, routing_map=routing_map)
        return rows, row_probs, routing_map.sum(0), out

    def ours(h, p):
        dispatcher = _dispatcher(experts, topk)
        rows, row_probs = dispatcher.dispatch_preprocess(h, ids, p)
        rows, counts, row_probs = dispatcher.dispatch_postprocess(rows, row_probs)
        return rows, row_probs, counts, dispatcher.combine_postprocess(rows * row_probs[:, None] * 3.0)

    results = []
    for fn, p0 in ((megatron, dense_probs), (ours, probs)):
        h, p = hidden.clone().requires_grad_(), p0.clone().requires_grad_()
        rows, row_probs, counts, out = fn(h, p)
        out.backward(grad)
        results.append((rows, row_probs, counts, out, h.grad, p.grad if p.grad.shape == probs.shape else p.grad.gather(1, ids)))
    for name, want, got in zip(("rows", "row probs", "counts", "out", "hidden grad", "probs grad"), *results):
        torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-6, atol=1e-6, msg=name)


def test_grouped_mm_takes_device_offsets_without_reading_the_counts(parallel_ctx):
    from megatron_rl.parallel import grouped_gemm_torch

    if not grouped_gemm_torch.torch_grouped_mm_runs(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no CPU torch._grouped_mm")
    g = torch.Generator().manual_seed(0)
    sizes = [3, 0, 5, 4]
    a = torch.randn(sum(sizes), 16, generator=g)
    b = torch.randn(4, 16, 8, generator=g)
    counts = torch.tensor(sizes, dtype=torch.int32)
    counts.grouped_mm_offsets = torch.tensor([3, 3, 8, 12], dtype=torch.int32)
    reads = []
    with _ReadsOf(counts, reads):
        out = grouped_gemm_torch.gmm(a, b, counts)
    assert reads == []  # the counts were not read on the host
    want = torch.cat([rows @ b[e] for e, rows in enumerate(torch.split(a, sizes))])
    torch.testing.assert_close(out, want)


class _ReadsOf(torch.overrides.TorchFunctionMode):
    """Records host reads (tolist, item, int) of one tensor."""

    def __init__(self, tensor, reads):
        super().__init__()
        self.tensor, self.reads = tensor, reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and args[0] is self.tensor and getattr(func, "__name__", "") in ("tolist", "item", "__int__", "numpy"):
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))
