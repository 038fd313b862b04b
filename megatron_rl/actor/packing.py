"""Where each position of a microbatch's model input comes from: padded rows or packed sequences (THD).

A `TokenLayout` maps every input position of one microbatch to (row of the
batch, position in that row), -1 where it holds padding. Everything that moves
per-token data in or out of the model goes through it: input ids and targets,
position ids, routes to replay or record, and logprobs back to the batch's
[B, T] rows. Two layouts:

* padded rows (``Microbatch.packed`` False): input [B_m, W], row i position t is
  (mb.rows[i], t); every row pads to W.
* packed (THD, ``Microbatch.packed`` True): input [1, W / CP]. The microbatch's
  sequences are laid back to back, each padded at its end only to ``multiple``
  (TP under sequence parallelism x 2 CP under context parallelism; 1 otherwise),
  the last one also up to the microbatch's width W (which may be raised to a
  common width across DP ranks). Position ids restart at 0 for each sequence;
  megatron's PackedSeqParams carries the offsets (models.attention.packed_seq_params),
  so attention is block-diagonal causal and padding is inert. With CP the rank
  holds, of each sequence, the chunks `cp_chunk_indices` gives (2 x CP chunks,
  rank r: chunks r and 2 CP - 1 - r, megatron's load-balanced order).

E.g. lengths 3 and 5, multiple 2, W = 8: sequences at offsets 0 and 4,
position ids [0 1 2 3 0 1 2 3 4 5 ...] (8 + the last's padding), cu_seqlens [0 3 8],
cu_seqlens_padded [0 4 8 + ...].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.actor.microbatches import Microbatch
from megatron_rl.algorithms.metrics import fraction_metric


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass
class TokenLayout:
    """Input positions of one microbatch ([N_in, W_in]: [B_m, W] padded, [1, W / CP] packed)."""

    rows: torch.Tensor
    """[N_in, W_in] int64: the batch row each input position holds (-1: padding)."""
    positions: torch.Tensor
    """[N_in, W_in] int64: its position in that row (-1: padding)."""
    position_ids: torch.Tensor
    """[N_in, W_in] int64: the model's position ids (restarting per packed sequence)."""
    packed_seq_params: object | None = None
    """megatron's PackedSeqParams for a packed microbatch, None for padded rows."""

    def real(self, lengths: torch.Tensor) -> torch.Tensor:
        """[N_in, W_in] bool: the position holds a real token of its row."""
        return (self.rows >= 0) & (self.positions < lengths[self.rows.clamp(min=0)]) & (self.positions >= 0)


def padded_layout(mb: Microbatch) -> TokenLayout:
    num_rows = len(mb.rows)
    rows = torch.tensor(mb.rows, dtype=torch.int64).unsqueeze(1).expand(-1, mb.width)
    positions = torch.arange(mb.width, dtype=torch.int64).unsqueeze(0).expand(num_rows, -1)
    positions = torch.where(rows >= 0, positions, -1)
    position_ids = torch.arange(mb.width, dtype=torch.int64).unsqueeze(0).expand(num_rows, -1).contiguous()
    return TokenLayout(rows=rows.contiguous(), positions=positions.contiguous(), position_ids=position_ids)


def packed_layout(mb: Microbatch, lengths: torch.Tensor, *, multiple: int, cp_size: int = 1, cp_rank: int = 0) -> TokenLayout:
    """The THD layout of a packed microbatch on this CP rank (see the module docstring).

    Built with a few whole-microbatch tensor ops (no per-sequence tensor work, no per-sequence
    scalar reads): the host cost of a microbatch does not grow with the number of its sequences.
    """
    from megatron_rl.models.attention import packed_seq_params

    seq_lengths = lengths[list(mb.rows)].tolist() if mb.rows else []
    padded = [_round_up(n, multiple) for n in seq_lengths]
    if not seq_lengths:  # an empty microbatch (a DP rank with fewer): one inert sequence of padding
        seq_lengths, padded = [1], [mb.width]
    extra = mb.width - sum(padded)
    if extra < 0 or extra % multiple:
        raise ValueError(f"packed microbatch width {mb.width} cannot hold sequences padded to {padded} (multiple {multiple})")
    padded[-1] += extra  # a common width across DP ranks: the last sequence's padding grows
    if cp_size > 1 and any(n % (2 * cp_size) for n in padded):
        raise ValueError(
            f"sequence lengths {padded} are not all multiples of 2 x CP = {2 * cp_size}: pad each sequence to a multiple "
            f"of {2 * cp_size} (packed_seq_params(lengths, multiple={2 * cp_size}))"
        )
    params = packed_seq_params(seq_lengths, multiple=1)
    cu_padded = torch.tensor([0] + padded, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    params.cu_seqlens_q_padded = params.cu_seqlens_kv_padded = cu_padded
    params.max_seqlen_q = params.max_seqlen_kv = max(padded)
    # Per input position of this rank: its sequence's row, real length, and index j within the rank's share.
    local_sizes = torch.tensor(padded, dtype=torch.int64) // cp_size
    row = torch.repeat_interleave(torch.tensor(list(mb.rows) if mb.rows else [-1], dtype=torch.int64), local_sizes)
    real_length = torch.repeat_interleave(torch.tensor(seq_lengths, dtype=torch.int64), local_sizes)
    starts = local_sizes.cumsum(0) - local_sizes
    j = torch.arange(int(local_sizes.sum())) - torch.repeat_interleave(starts, local_sizes)
    if cp_size > 1:  # chunks cp_rank and 2 CP - 1 - cp_rank of each sequence (models.attention.cp_chunk_indices)
        from megatron_rl.models.attention import cp_global_positions

        local = cp_global_positions(j, torch.repeat_interleave(local_sizes // 2, local_sizes), cp_size, cp_rank)
    else:
        local = j
    inside = local < real_length
    return TokenLayout(
        rows=torch.where(inside, row, -1).unsqueeze(0),
        positions=torch.where(inside & (row >= 0), local, -1).unsqueeze(0),
        position_ids=local.unsqueeze(0),
        packed_seq_params=params,
    )


def microbatch_layout(mb: Microbatch, lengths: torch.Tensor, *, multiple: int = 1, cp_size: int = 1, cp_rank: int = 0) -> TokenLayout:
    """The layout of `mb` (padded rows or packed sequences) on this CP rank."""
    if mb.packed:
        return packed_layout(mb, lengths, multiple=multiple, cp_size=cp_size, cp_rank=cp_rank)
    return padded_layout(mb)


def gather_positions(values: torch.Tensor, layout: TokenLayout, valid: torch.Tensor, fill=0) -> torch.Tensor:
    """values[rows, positions] ([N_in, W_in, ...]) where `valid`, else `fill`."""
    rows = torch.where(valid, layout.rows, 0)
    positions = torch.where(valid, layout.positions, 0).clamp(max=values.shape[1] - 1)
    out = values[rows, positions]
    mask = valid.reshape(*valid.shape, *([1] * (out.dim() - valid.dim())))
    return torch.where(mask, out, torch.as_tensor(fill, dtype=values.dtype))


def unpack_index(layout: TokenLayout, mb: Microbatch, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [B_m, width] into the flattened input, valid [B_m, width]) for token-aligned per-row values.

    Row i's token t is predicted at input position (row, t - 1): its logprob lives
    there. valid is False where that position is not on this rank (CP), t = 0, or past the row.
    """
    num_rows = max(1, len(mb.rows))
    flat_rows, flat_pos = layout.rows.reshape(-1), layout.positions.reshape(-1)
    index = torch.zeros(num_rows, width + 1, dtype=torch.int64)
    valid = torch.zeros(num_rows, width + 1, dtype=torch.bool)
    here = torch.nonzero(flat_rows >= 0).flatten()
    if here.numel():
        # slot of each batch row in mb.rows, looked up as a tensor (padding rows, -1, are never looked up). Sized by
        # mb.rows, not by the rows this rank's positions hold: under CP a short sequence can lie wholly in the other
        # rank's chunks (1 token padded to 4: chunks 1 and 2 are padding), and it may be the microbatch's last row.
        mb_rows = torch.tensor(list(mb.rows), dtype=torch.int64)
        slot_of = torch.zeros(max(mb.rows) + 1, dtype=torch.int64)
        real_slots = torch.nonzero(mb_rows >= 0).flatten()
        slot_of[mb_rows[real_slots]] = real_slots
        rows_here = flat_rows[here]
        slots = slot_of[rows_here]
        targets = flat_pos[here] + 1  # the token this position predicts
        keep = (targets <= width - 1) & (targets < lengths[rows_here])
        index[slots[keep], targets[keep]] = here[keep]
        valid[slots[keep], targets[keep]] = True
    return index[:, :width], valid[:, :width]


def write_rows(dest: torch.Tensor, values: torch.Tensor, rows: tuple[int, ...], lengths: torch.Tensor) -> None:
    """dest[rows[i], t] = values[i, t] for t below row rows[i]'s length (padding rows, -1, skipped): whole-tensor
    ops, no per-row Python or scalar read."""
    index = torch.tensor(rows, dtype=torch.int64)
    real = torch.nonzero(index >= 0).flatten()
    if not real.numel():
        return
    width = min(values.shape[1], dest.shape[1])
    target = index[real]
    inside = torch.arange(width)[None] < lengths[target][:, None]
    dest[target, :width] = torch.where(inside, values[real, :width], dest[target, :width])


def layout_metrics(items: list, lengths: torch.Tensor, device) -> dict[str, torch.Tensor]:
    """How this rank's microbatches were laid out, as exact fractions over the step's ranks.

    ``batch/packed_fraction``: microbatches packed (THD) / microbatches; ``batch/padding_fraction``:
    model input positions holding no real token / input positions (under CP, each rank's chunks).
    A run with train.pack_sequences=true shows packed_fraction 1; padded rows of uneven lengths
    show the padding they cost.
    """
    packed = sum(1 for item in items if item.mb.packed)
    positions = sum(item.layout.rows.numel() for item in items)
    real = sum(int(item.layout.real(lengths).sum()) for item in items)
    counts = torch.tensor([packed, len(items), positions - real, positions], dtype=torch.float64, device=device)
    return {
        "batch/packed_fraction": fraction_metric(counts[0], counts[1]),
        "batch/padding_fraction": fraction_metric(counts[2], counts[3]),
    }


__all__ = ["TokenLayout", "gather_positions", "layout_metrics", "microbatch_layout", "packed_layout", "padded_layout",
           "unpack_index", "write_rows"]
