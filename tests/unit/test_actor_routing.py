"""Global [B, T, L, K] routes <-> megatron's per-rank local-token order, and the microbatch tensors."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.actor.microbatches import Microbatch
from megatron_rl.actor.routing import local_tokens, microbatch_positions, microbatch_routes
from megatron_rl.actor.step import loss_scale, microbatch_inputs, take_rows, token_aligned
from megatron_rl.actor import TrainBatch


def test_local_tokens_follow_megatrons_sequence_parallel_order():
    B, W, TP = 3, 8, 2
    coords = torch.stack(torch.meshgrid(torch.arange(B), torch.arange(W), indexing="ij"), dim=-1)  # [B, W, 2] = (b, t)
    for rank in range(TP):
        local = local_tokens(coords, tp_rank=rank, tp_size=TP, sequence_parallel=True)
        # megatron: embeddings [s, b, h], scattered along s to TP ranks, flattened to [s_local * b, h] by the router
        expected = [(b, t) for t in range(rank * W // TP, (rank + 1) * W // TP) for b in range(B)]
        assert [tuple(x) for x in local.tolist()] == expected
    whole = local_tokens(coords, tp_rank=0, tp_size=1, sequence_parallel=False)
    assert [tuple(x) for x in whole.tolist()] == [(b, t) for t in range(W) for b in range(B)]


def test_microbatch_routes_fill_padding_with_valid_experts():
    routes = torch.randint(0, 8, (4, 6, 2, 2), dtype=torch.int16)
    routes[1, 4:] = -1  # sample 1 ends at 4
    mb = Microbatch(rows=(1, 3, -1), width=8)
    out = microbatch_routes(routes, mb, topk=2)
    assert out.shape == (3, 8, 2, 2) and out.dtype == torch.int64
    assert torch.equal(out[0, :4], routes[1, :4].long()) and torch.equal(out[1, :6], routes[3].long())
    assert torch.equal(out[0, 4:], torch.tensor([0, 1]).expand(4, 2, 2))  # -1 and beyond T: experts 0..K-1
    assert torch.equal(out[2], torch.tensor([0, 1]).expand(8, 2, 2))  # a padding row
    rows, positions, counted = microbatch_positions(mb, torch.tensor([6, 4, 6, 6]))
    assert counted[0].tolist() == [True] * 3 + [False] * 5  # t < length - 1
    assert not counted[2].any()


def test_microbatch_routes_widen_only_the_microbatchs_positions():
    # R3: a rank holds [B_share, T, L, K] int16 routes; each microbatch needs a few rows of them. Nothing the size of
    # the share may be copied (widened to int64) per microbatch: watched at torch's own dispatch of every op.
    from torch.overrides import TorchFunctionMode

    routes = torch.randint(0, 8, (64, 32, 4, 2), dtype=torch.int16)
    largest = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                largest.append(out.numel())
            return out

    with Watch():
        out = microbatch_routes(routes, Microbatch(rows=(5, 9), width=32), topk=2)
    assert torch.equal(out, routes[[5, 9]].long())
    assert max(largest) <= 2 * 32 * 4 * 2, max(largest)  # the microbatch's [2, 32, L, K]; the share is 32x that


def test_microbatch_inputs_shift_targets_and_pad():
    tokens = torch.arange(1, 25).reshape(3, 8)
    positions = torch.arange(8)
    lengths = torch.tensor([8, 5, 6])
    batch = TrainBatch(tokens=tokens, response_mask=(positions[None] >= 2) & (positions[None] < lengths[:, None]),
                       advantages=torch.tensor([1.0, 2.0, 3.0]), old_logprobs=-torch.rand(3, 8), sequence_lengths=lengths)
    mb = Microbatch(rows=(1, -1), width=6)
    inputs = microbatch_inputs(batch, mb, lengths, torch.device("cpu"), with_loss_inputs=True)
    assert inputs.tokens[0].tolist() == [9, 10, 11, 12, 13, 0]  # past the length: 0
    assert inputs.targets[0].tolist() == [10, 11, 12, 13, 0, 0]
    assert inputs.tokens[1].tolist() == [0] * 6 and not inputs.response_mask[1].any()
    assert inputs.advantages.tolist() == [2.0, 0.0]
    assert torch.equal(inputs.old_logprobs[0], batch.old_logprobs[1, :6])
    assert take_rows(torch.tensor([[1, 2]]), Microbatch(rows=(0,), width=4), per_token=True).tolist() == [[1, 2, 0, 0]]
    assert token_aligned(torch.tensor([[1.0, 2.0, 3.0]])).tolist() == [[0.0, 1.0, 2.0]]


def test_loss_scale_cancels_megatrons_averaging():
    # schedule: x CP / M; DDP: / (D x CP)  ->  the loss function returns loss_sum x M x D
    for m, d, cp in ((1, 1, 1), (3, 2, 1), (4, 4, 2)):
        assert loss_scale(m, d) * cp / m / (d * cp) == 1


def test_rank_routes_are_keyed_by_row_and_position_whatever_the_microbatch_order():
    from megatron_rl.actor.routing import RouteRecorder

    B, T, L, K = 3, 5, 4, 2
    recorder = RouteRecorder((B, T), num_moe_layers=L, topk=K, num_experts=8)
    # two "microbatches" of this rank's layers 1 and 3: (row 2, t 0..1) then (row 0, t 3), (row 2, t 1) again
    recorder.add(torch.tensor([2 * T + 0, 2 * T + 1]), torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 0]]]))
    recorder.add(torch.tensor([0 * T + 3, 2 * T + 1]), torch.tensor([[[6, 7], [1, 0]], [[2, 3], [4, 5]]]))
    routes = recorder.finish([1, 3])
    assert routes.keys.tolist() == [3, 10, 11] and routes.experts.dtype == torch.uint8
    assert routes.nbytes == 3 * 8 + 3 * 2 * K
    # looked up in another order, with a token never recorded (row 1) and padding (-1)
    experts, found = routes.lookup(torch.tensor([2, 0, 1, -1, 2]), torch.tensor([1, 3, 0, 0, 0]))
    assert found.tolist() == [True, True, False, False, True]
    assert experts[0].tolist() == [[2, 3], [4, 5]]  # the later record of (2, 1) wins
    assert experts[1].tolist() == [[6, 7], [1, 0]] and experts[4].tolist() == [[1, 2], [3, 4]]
    # a position past T is not an alias of the next row's first token
    assert not bool(routes.lookup(torch.tensor([1]), torch.tensor([T]))[1][0])
    # the whole tensor (one rank: no group): layers 0 and 2 were computed elsewhere
    whole = routes.gather([])
    assert whole.shape == (B, T, L, K) and whole[2, 1, 3].tolist() == [4, 5] and whole[0, 3, 1].tolist() == [6, 7]
    assert int((whole >= 0).all(dim=-1).sum()) == 3 * 2


def test_set_differs_matches_comparing_whole_expert_maps():
    from megatron_rl.actor.routing import set_differs

    g = torch.Generator().manual_seed(0)
    N, E, K = 200, 8, 3
    used = torch.rand(N, E, generator=g).topk(K, dim=1).indices
    reference = torch.where(torch.rand(N, 1, generator=g) < 0.5, used.flip(1), torch.rand(N, E, generator=g).topk(K, dim=1).indices)
    routing_map = torch.zeros(N, E, dtype=torch.bool).scatter_(1, used, True)
    dropped = routing_map.clone()
    dropped[::7, used[::7, 0]] = False  # capacity dropping: fewer than K experts used
    for marked in (routing_map, dropped):
        # the definition: the [N, E] maps of both sets differ somewhere
        expected = (marked != torch.zeros(N, E, dtype=torch.bool).scatter_(1, reference, True)).any(dim=1)
        assert torch.equal(set_differs(marked, reference), expected)
    assert 0 < int(set_differs(routing_map, reference).sum()) < N


def test_replay_routes_keep_a_ranks_tokens_and_layers_from_padded_and_packed_routes():
    # R3's cut for one rank (actor.distribute): of a share's [B, T, L, K] engine routes, the real tokens its
    # routers see (TP2 sequence-parallel slice x CP2 chunks of packed microbatches) at its stage's layers (1, 3).
    # Independent of the code: each kept route equals the engine's at (key // T, key % T), and the ranks together
    # keep every real token exactly once per TP x CP split.
    from functools import partial

    from megatron_rl.actor import PackedRoutes
    from megatron_rl.actor.packing import microbatch_layout
    from megatron_rl.actor.microbatches import plan_step
    from megatron_rl.actor.routing import replay_routes

    g = torch.Generator().manual_seed(0)
    B, T, L, K, layers = 6, 12, 4, 2, (1, 3)
    lengths = torch.tensor([12, 5, 9, 3, 7, 11])
    routes = torch.randint(0, 8, (B, T, L, K), generator=g, dtype=torch.int16)
    packed = PackedRoutes(torch.cat([routes[b, :n] for b, n in enumerate(lengths.tolist())]),
                          torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
    tp, cp = 2, 2
    plan = plan_step(lengths.tolist(), mini_batches=1, dp_size=1, max_tokens_per_microbatch=24, width_multiple=tp * 2 * cp,
                     pack_sequences=True)
    seen = torch.zeros(B, T, dtype=torch.int64)
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            local = partial(local_tokens, tp_rank=tp_rank, tp_size=tp, sequence_parallel=True)
            kept = [replay_routes(source, (microbatch_layout(mb, lengths, multiple=tp * 2 * cp, cp_size=cp, cp_rank=cp_rank)
                                           for mb in plan[0][0]), lengths, batch_shape=(B, T), layer_ids=layers, local=local,
                                  num_moe_layers=L, topk=K, num_experts=8) for source in (routes, packed)]
            assert torch.equal(kept[0].keys, kept[1].keys) and torch.equal(kept[0].experts, kept[1].experts)
            rows, positions = kept[0].keys // T, kept[0].keys % T
            assert kept[0].experts.dtype == torch.uint8 and kept[0].layer_ids == layers
            assert torch.equal(kept[0].experts.long(), routes[rows, positions][:, list(layers)].long())
            assert bool((positions < lengths[rows]).all())  # real tokens only
            seen[rows, positions] += 1
    real = torch.arange(T)[None] < lengths[:, None]
    assert bool((seen[real] == 1).all()) and bool((seen[~real] == 0).all())


@pytest.mark.parametrize("num_experts,wire", [(256, torch.uint8), (257, torch.int16), (512, torch.int16)])
def test_replayed_ids_cross_the_host_link_narrow_and_reach_the_routers_as_int64(monkeypatch, num_experts, wire):
    """Each microbatch's replay ids go to the device in their narrowest type (1 or 2 bytes, not int64's 8) and are
    widened there: the routers get the same ids, one contiguous int64 [N, K] per layer."""
    from types import SimpleNamespace

    from megatron_rl.actor import routing

    sent = []
    monkeypatch.setattr(routing, "host_to_device", lambda t, device: sent.append(t.dtype) or t.to(device))
    g = torch.Generator().manual_seed(0)
    routes = torch.randint(0, num_experts, (10, 3, 4), generator=g, dtype=torch.int64)
    routes[0, 0, 0] = num_experts - 1  # the largest id survives the narrow type
    control = SimpleNamespace(num_experts=num_experts, ctx=SimpleNamespace(device=torch.device("cpu")))
    per_layer = routing.RoutingControl._to_routers(control, routes)
    assert sent == [wire]
    assert len(per_layer) == 3
    for layer, got in enumerate(per_layer):
        assert got.dtype == torch.int64 and got.is_contiguous() and torch.equal(got, routes[:, layer])
