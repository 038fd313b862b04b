"""models.rope's packed RoPE against megatron-core's own THD RoPE (rope_utils._apply_rotary_pos_emb_thd) and a
hand-worked rotation: values and gradients, full and partial rotary dims, with and without yarn's mscale."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_rl.models.rope import _rotate_pair, packed_positions, packed_table, rotate


def test_positions_restart_at_each_sequence():
    assert packed_positions([0, 3, 5, 9]).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert packed_positions([0, 1]).tolist() == [0]


def test_a_hand_worked_rotation():
    """d = 2 at angle theta: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] (a plane rotation, RoFormer Eq. 13)."""
    theta = torch.tensor(0.3)
    x = torch.tensor([[[[2.0, 5.0]]]])
    cos, sin = torch.cos(theta), torch.sin(theta)
    table = (torch.stack([cos, cos]).view(1, 1, 1, 2), torch.stack([-sin, sin]).view(1, 1, 1, 2))
    want = torch.stack([2 * cos - 5 * sin, 5 * cos + 2 * sin])
    torch.testing.assert_close(rotate(x, table).flatten(), want)


@pytest.mark.parametrize("rot_dim, mscale", [(16, 1.0), (8, 1.0), (16, 1.3)])
def test_packed_rotation_equals_megatrons_thd_rope(rot_dim, mscale):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    g = torch.Generator().manual_seed(rot_dim)
    offsets = [0, 5, 12, 20]
    freqs = torch.rand(32, 1, 1, rot_dim // 2, generator=g) * 3
    freqs = torch.cat([freqs, freqs], dim=-1)  # megatron's RotaryEmbedding: the half-split layout
    query = torch.randn(offsets[-1], 1, 3, 16, generator=g)
    grad = torch.randn_like(query)
    params = types.SimpleNamespace()
    table = packed_table(params, offsets, freqs, torch.float32, mscale)
    assert packed_table(params, offsets, freqs, torch.float32, mscale) is table  # made once per microbatch

    x = query.clone().requires_grad_()
    out = rotate(x, table)
    out.backward(grad)
    ref = query.clone().requires_grad_()
    # megatron's THD RoPE: each sequence its own positions 0..L-1 (rope_utils._apply_rotary_pos_emb_thd, CASE 2)
    pieces = [_apply_rotary_pos_emb_bshd(ref[a:b], freqs[: b - a], mscale=mscale) for a, b in zip(offsets, offsets[1:])]
    want = torch.cat(pieces)
    want.backward(grad)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-6, atol=1e-6)
    if rot_dim == 16:  # the compiled region's plain form: the same numbers
        key = torch.randn(offsets[-1], 1, 2, 16, generator=g)
        pair = _rotate_pair(query, key, *table)
        torch.testing.assert_close(pair[0], rotate(query, table))
        torch.testing.assert_close(pair[1], rotate(key, table))
