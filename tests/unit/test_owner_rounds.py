"""Owner-parallel push rounds that follow the model's layers: what an engine worker holds stays within two layers.

A worker loads a layer once every tensor of it has arrived and keeps each received bucket (its tensors are views of
it) until every layer it touches is loaded (vLLM's layerwise reload). Simulated here on a MoE model's parameter
list (8 decoder layers of 32 experts, the owners the greedy assignment gives): the most a worker holds at once,
against the senders' count. Rounds of every owner's r-th bucket of the whole model mix layers, and a worker held
about a bucket per sender; owner_rounds' hold at most two layers, for 4 senders as for 32.
"""

from __future__ import annotations

from megatron_rl.models.export import _order_key
from megatron_rl.models.export_owners import _Param, assign_owners, layer_of, owner_rounds

LAYERS, EXPERTS, HIDDEN, FFN = 8, 32, 256, 128
BUCKET = 4 * HIDDEN * FFN * 2 * 3  # bytes: about a dozen experts' weights


def _model(senders: int) -> list[_Param]:
    """Dense weights on every rank (TP1: any rank may send them); expert e on rank e % senders."""
    params = []

    def add(name, shape, ranks):
        param = _Param(name, 1, shape, "bfloat16")
        for rank in ranks:
            param.rows[rank] = {0: rank}
        params.append(param)

    everyone = range(senders)
    add("embedding.word_embeddings.weight", (1024, HIDDEN), everyone)
    for layer in range(LAYERS):
        pre = f"decoder.layers.{layer}."
        add(pre + "self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), everyone)
        add(pre + "self_attention.linear_proj.weight", (HIDDEN, HIDDEN), everyone)
        add(pre + "mlp.router.weight", (EXPERTS, HIDDEN), everyone)
        for e in range(EXPERTS):
            add(pre + f"mlp.experts.local_experts.{e}.linear_fc1.weight", (2 * FFN, HIDDEN), [e % senders])
            add(pre + f"mlp.experts.local_experts.{e}.linear_fc2.weight", (HIDDEN, FFN), [e % senders])
    add("decoder.final_layernorm.weight", (HIDDEN,), everyone)
    add("output_layer.weight", (1024, HIDDEN), everyone)
    params.sort(key=lambda p: _order_key(p.name))
    assign_owners(params, senders)
    return params


def _most_held(rounds) -> int:
    """The most bytes a worker keeps at once: each round's buckets arrive together, and a bucket is let go once
    every layer it holds a tensor of is complete."""
    need: dict = {}
    for parts in rounds:
        for _, bucket in parts:
            for param in bucket:
                need[layer_of(param.name)] = need.get(layer_of(param.name), 0) + 1
    have, kept, most = {}, [], 0
    for parts in rounds:
        for _, bucket in parts:
            for param in bucket:
                have[layer_of(param.name)] = have.get(layer_of(param.name), 0) + 1
            kept.append((sum(p.nbytes for p in bucket), {layer_of(p.name) for p in bucket}))
        most = max(most, sum(size for size, _ in kept))
        kept = [(size, layers) for size, layers in kept if any(have[layer] < need[layer] for layer in layers)]
    return most


def _mixed_rounds(params, bucket_bytes):
    """Every owner's r-th bucket of the whole model in model order (how the rounds were cut before)."""
    from megatron_rl.models.export import _buckets

    per_owner = {o: _buckets([p for p in params if p.owner == o], bucket_bytes) for o in sorted({p.owner for p in params})}
    return [[(o, b[r]) for o, b in per_owner.items() if r < len(b)] for r in range(max(len(b) for b in per_owner.values()))]


def test_a_worker_holds_at_most_two_layers_whatever_the_senders():
    for senders in (4, 32):
        params = _model(senders)
        rounds = owner_rounds(params, BUCKET)
        # every parameter once, each owner's own, and no round mixes layers
        sent = [(owner, p.name) for parts in rounds for owner, bucket in parts for p in bucket]
        assert sorted(name for _, name in sent) == sorted(p.name for p in params)
        assert all(owner == {p.name: p.owner for p in params}[name] for owner, name in sent)
        assert all(len({layer_of(p.name) for p in bucket}) == 1 for parts in rounds for _, bucket in parts)
        assert all(len({owner for owner, _ in parts}) == len(parts) for parts in rounds)  # a bucket per owner a round
        for owner in {o for parts in rounds for o, _ in parts}:  # each owner in model order
            order = [layer_of(bucket[0].name) for parts in rounds for o, bucket in parts if o == owner]
            assert order == sorted(order), owner
        assert all(sum(p.nbytes for p in bucket) <= BUCKET for parts in rounds for _, bucket in parts
                   if len(bucket) > 1)
        layers: dict = {}
        for p in params:
            layers[layer_of(p.name)] = layers.get(layer_of(p.name), 0) + p.nbytes
        largest = max(layers.values())
        mixed_rounds = _mixed_rounds(params, BUCKET)
        held, mixed = _most_held(rounds), _most_held(mixed_rounds)
        print(f"{senders} senders: a worker holds at most {held} bytes (largest layer {largest}) in {len(rounds)} "
              f"rounds; {mixed} in {len(mixed_rounds)} rounds of every owner's r-th bucket of the model")
        assert held <= 2 * largest, (senders, held, largest)
        if senders == 32:
            assert mixed > 4 * largest  # what the layer-wise rounds avoid: it grows with the senders


def test_at_most_n_senders_own_everything_and_receive_what_they_do_not_hold():
    """rollout.weight_senders_max: only every world / N-th rank owns; a parameter none of them holds goes to the
    least loaded sender, which receives every shard. By hand: 4 ranks, senders [0, 2]."""
    from megatron_rl.config.rollout import sender_ranks

    assert sender_ranks(8, 0) is None and sender_ranks(8, 8) is None and sender_ranks(8, 16) is None
    assert sender_ranks(8, 2) == [0, 4] and sender_ranks(8, 3) == [0, 3, 6] and sender_ranks(256, 32) == list(range(0, 256, 8))
    a = _Param("decoder.layers.0.self_attention.linear_qkv.weight", 2, (4, 4), "float32")  # 2 TP shards, 64 B each
    a.rows = {0: {0: 1, 1: 3}}  # held by ranks 1 and 3 only
    b = _Param("decoder.layers.0.pre_mlp_layernorm.weight", 1, (4,), "float32")  # 16 B
    b.rows = {1: {0: 1}, 2: {0: 2}}  # held whole by ranks 1 and 2
    load = assign_owners([a, b], 4, sender_ranks(4, 2))
    # a first (larger): no sender holds it; senders 0 and 2 equally idle -> 0, receiving both shards (128 B)
    assert a.owner == 0 and a.sources == {0: 1, 1: 3}
    # b: sender 2 holds it whole (16 B, nothing to receive) against sender 0's 256 B so far
    assert b.owner == 2 and b.sources == {0: 2}
    assert load == [128 + 128, 64, 16, 64]  # owner: its bytes out + in; each holder: the shard it sends
