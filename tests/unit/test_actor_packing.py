"""Packed (THD) microbatch layouts against a per-sequence, per-token reference written out here."""

from __future__ import annotations

import torch

from megatron_rl.actor.packing import packed_layout, unpack_index
from megatron_rl.actor.microbatches import Microbatch
from megatron_rl.models.attention import cp_chunk_indices


def _reference_layout(rows, lengths, padded, cp_size, cp_rank):
    """Sequence by sequence: this CP rank's chunk positions, real where inside the sequence."""
    out_rows, out_pos, out_ids = [], [], []
    for row, length, size in zip(rows, lengths, padded):
        for p in cp_chunk_indices(size, cp_size, cp_rank).tolist():
            inside = p < length
            out_rows.append(row if inside else -1)
            out_pos.append(p if inside and row >= 0 else -1)
            out_ids.append(p)
    return out_rows, out_pos, out_ids


def _reference_unpack(layout_rows, layout_pos, mb_rows, lengths, width):
    index = [[0] * width for _ in mb_rows]
    valid = [[False] * width for _ in mb_rows]
    for flat, (row, pos) in enumerate(zip(layout_rows, layout_pos)):
        if row < 0:
            continue
        slot, target = mb_rows.index(row), pos + 1
        if target < width and target < lengths[row]:
            index[slot][target], valid[slot][target] = flat, True
    return index, valid


def test_packed_layout_and_unpack_index_match_a_per_sequence_reference():
    lengths = torch.tensor([7, 3, 12, 5, 9, 1])
    cases = [  # (rows, multiple, cp_size, width)
        ((2, 0, 4), 1, 1, 28),
        ((5, 1, 3), 2, 1, 12),  # the last sequence's padding grows to the width
        ((0, 2, 3, 4), 4, 2, 40),
        ((1, 4), 8, 4, 32),
        ((), 1, 1, 6),  # an empty microbatch: one inert sequence
        ((0, 3, 5), 4, 2, 20),  # the last row, 1 token, lies wholly in chunk 0: CP rank 1 holds none of it
        ((5,), 4, 2, 8),  # a microbatch of that row alone (its padding grown to the width)
    ]
    for rows, multiple, cp_size, width in cases:
        mb = Microbatch(rows, width, packed=True)
        real = [int(lengths[r]) for r in rows] or [1]
        padded = [-(-n // multiple) * multiple for n in real]
        padded[-1] += width - sum(padded)
        row_ids = list(rows) or [-1]
        for cp_rank in range(cp_size):
            layout = packed_layout(mb, lengths, multiple=multiple, cp_size=cp_size, cp_rank=cp_rank)
            ref_rows, ref_pos, ref_ids = _reference_layout(row_ids, real, padded, cp_size, cp_rank)
            assert layout.rows[0].tolist() == ref_rows, (rows, cp_rank)
            assert layout.positions[0].tolist() == ref_pos, (rows, cp_rank)
            assert layout.position_ids[0].tolist() == ref_ids, (rows, cp_rank)
            assert layout.packed_seq_params.cu_seqlens_q_padded.tolist() == [sum(padded[:i]) for i in range(len(padded) + 1)]
            row_mb = Microbatch(rows or (-1,), max(real))
            index, valid = unpack_index(layout, row_mb, lengths, row_mb.width)
            ref_index, ref_valid = _reference_unpack(ref_rows, ref_pos, list(row_mb.rows), lengths.tolist(), row_mb.width)
            assert valid.tolist() == ref_valid and torch.where(valid, index, 0).tolist() == ref_index, (rows, cp_rank)


def test_packed_layout_refuses_sequences_cp_cannot_split():
    import pytest

    with pytest.raises(ValueError, match="multiples of 2 x CP = 4"):
        packed_layout(Microbatch((0, 1), 12, packed=True), torch.tensor([5, 6]), multiple=2, cp_size=2, cp_rank=0)


def test_logprobs_are_written_back_to_their_rows_up_to_each_length():
    from megatron_rl.actor.packing import write_rows

    lengths = torch.tensor([5, 2, 7, 4])
    values = torch.arange(1.0, 1.0 + 3 * 6).reshape(3, 6)  # microbatch rows (3, -1, 0), width 6
    dest = torch.full((4, 7), -1.0)
    write_rows(dest, values, (3, -1, 0), lengths)
    expected = torch.full((4, 7), -1.0)
    for i, row in enumerate((3, -1, 0)):  # the definition, row by row
        if row >= 0:
            span = min(6, 7, int(lengths[row]))
            expected[row, :span] = values[i, :span]
    assert torch.equal(dest, expected)
