"""How one step's rows are cut into mini-batches, data-parallel shares and microbatches.

Every rank holds the whole batch and computes the same plan, so no shapes
are exchanged:

    1. mini-batches: the rows split into `mini_batches` contiguous, near-equal
       parts (rollouts are prompt-major, so a group stays in one mini-batch
       when the sizes divide);
    2. data-parallel shares: each mini-batch's rows dealt to DP ranks, longest
       first, each to the rank with the fewest tokens so far (balanced work);
    3. microbatches per rank: `micro_batch_size` rows at a time, or, with a
       token budget, rows sorted by length and packed while
       rows x padded width <= max_tokens_per_microbatch (a row longer than the
       budget gets a microbatch of its own); or, packed (THD), whole sequences
       back to back while their padded lengths sum to at most the budget;
    4. every DP rank gets the same number of microbatches M (EP's token
       all-to-all runs once per microbatch on every rank): ranks with fewer
       get empty ones (one padding row, no response tokens).

A microbatch's width is its longest row rounded up to `width_multiple`
(TP under sequence parallelism: each TP rank holds width / TP positions).
With `equal_shapes_across_dp` (megatron's allgather token dispatcher with EP
needs the same token count on every rank of the EP group) microbatch m has
the same [rows, width] on every DP rank; with `uniform_shapes` (pipeline
parallelism without variable_seq_lengths) all microbatches of a mini-batch
share one shape.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Microbatch:
    """Rows of the step's batch (-1 = a padding row) padded to `width` tokens each, or, when `packed`,
    whole sequences laid back to back in one row of `width` tokens (actor.packing)."""

    rows: tuple[int, ...]
    width: int
    packed: bool = False

    @property
    def num_real_rows(self) -> int:
        return sum(1 for r in self.rows if r >= 0)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def split_contiguous(num_rows: int, parts: int) -> list[list[int]]:
    """range(num_rows) in `parts` contiguous chunks whose sizes differ by at most one."""
    if parts < 1:
        raise ValueError(f"parts={parts} must be >= 1")
    base, extra = divmod(num_rows, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def split_balanced(rows: list[int], lengths: list[int], parts: int) -> list[list[int]]:
    """Rows dealt to `parts` bins, longest first, each to the bin with the fewest tokens (ties: lowest bin)."""
    bins: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, 0, i) for i in range(parts)]  # (tokens, rows, bin): the least loaded bin on top, O(log parts) a row
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        load, count, target = heapq.heappop(heap)
        bins[target].append(row)
        heapq.heappush(heap, (load + lengths[row], count + 1, target))
    return [sorted(b) for b in bins]


def _pack(rows: list[int], lengths: list[int], *, micro_batch_size: int, max_tokens: int, multiple: int) -> list[list[int]]:
    if not rows:
        return []
    if max_tokens <= 0:
        return [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
    packs: list[list[int]] = []
    current: list[int] = []
    width = 0
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        new_width = max(width, _round_up(lengths[row], multiple))
        if current and (len(current) + 1) * new_width > max_tokens:
            packs.append(current)
            current, new_width = [], _round_up(lengths[row], multiple)
        current.append(row)
        width = new_width
    packs.append(current)
    return [sorted(p) for p in packs]


def _pack_sequences(rows: list[int], lengths: list[int], *, micro_batch_size: int, max_tokens: int, multiple: int) -> list[list[int]]:
    """Whole sequences per packed microbatch: padded lengths summing to at most max_tokens (first fit,
    longest first), or micro_batch_size sequences at a time without a budget."""
    if max_tokens <= 0:
        return [rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
    packs: list[list[int]] = []
    load: list[int] = []
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        size = _round_up(lengths[row], multiple)
        if size > max_tokens:
            raise ValueError(
                f"sequence {row} has {lengths[row]} tokens ({size} padded to a multiple of {multiple}), more than "
                f"train.max_tokens_per_microbatch={max_tokens}: raise the budget to at least {size} (with context "
                "parallelism each CP rank holds budget / CP tokens of it), or lower rollout.max_new_tokens"
            )
        fits = next((i for i, used in enumerate(load) if used + size <= max_tokens), None)
        if fits is None:
            packs.append([row])
            load.append(size)
        else:
            packs[fits].append(row)
            load[fits] += size
    return [sorted(p) for p in packs]


def plan_step(
    lengths: list[int],
    *,
    mini_batches: int,
    dp_size: int,
    micro_batch_size: int = 1,
    max_tokens_per_microbatch: int = 0,
    width_multiple: int = 1,
    equal_shapes_across_dp: bool = False,
    uniform_shapes: bool = False,
    pack_sequences: bool = False,
) -> list[list[list[Microbatch]]]:
    """plan[mini_batch][dp_rank] = that rank's microbatches (the same count on every rank of a mini-batch).

    pack_sequences: each microbatch is its sequences back to back (one row), each padded to
    `width_multiple` only; the budget counts those padded tokens and a sequence above it is an error.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    if len(lengths) < mini_batches:
        raise ValueError(f"{len(lengths)} sequences cannot fill {mini_batches} mini-batches: lower train.mini_batches_per_step")
    group = _pack_sequences if pack_sequences else _pack
    plan = []
    for mini_rows in split_contiguous(len(lengths), mini_batches):
        shares = split_balanced(mini_rows, lengths, dp_size)
        packs = [
            group(share, lengths, micro_batch_size=micro_batch_size, max_tokens=max_tokens_per_microbatch, multiple=width_multiple)
            for share in shares
        ]
        num_micro = max(1, max(len(p) for p in packs))
        for p in packs:
            p.extend([] for _ in range(num_micro - len(p)))

        def width_of(rows: list[int]) -> int:
            if pack_sequences:
                return max(width_multiple, sum(_round_up(lengths[r], width_multiple) for r in rows))
            return _round_up(max([lengths[r] for r in rows], default=1), width_multiple)

        def rows_of(rows: list[int]) -> int:
            return 1 if pack_sequences else max(1, len(rows))

        shapes = [[(rows_of(rows), width_of(rows)) for rows in p] for p in packs]
        if equal_shapes_across_dp:
            for m in range(num_micro):
                common = (max(s[m][0] for s in shapes), max(s[m][1] for s in shapes))
                for s in shapes:
                    s[m] = common
        if uniform_shapes:
            for s in shapes:
                common = (max(x[0] for x in s), max(x[1] for x in s))
                s[:] = [common] * num_micro
            if equal_shapes_across_dp:
                common = (max(s[0][0] for s in shapes), max(s[0][1] for s in shapes))
                for s in shapes:
                    s[:] = [common] * num_micro
        def microbatch(rows: list[int], shape: tuple[int, int]) -> Microbatch:
            if pack_sequences:
                return Microbatch(tuple(rows), shape[1], packed=True)
            return Microbatch(tuple(rows) + (-1,) * (shape[0] - len(rows)), shape[1])

        plan.append([[microbatch(rows, shape) for rows, shape in zip(p, s)] for p, s in zip(packs, shapes)])
    return plan


class PlanMismatch(ValueError):
    """A rank's microbatches differ from the step's plan (a share built for another plan or rank)."""


def rank_microbatches(planned: list[Microbatch], row_ids: list[int] | None) -> list[Microbatch]:
    """One DP rank's microbatches of one mini-batch, rows renumbered into the batch the rank holds.

    planned: ``plan[mini][dp_rank]``, rows indexed in the step's batch. row_ids: the step row of
    each row the rank holds (a share from ``Actor.distribute``), or None for the whole step's
    batch (rows keep their step index). This is the one place a rank's microbatches come from:
    every field of the plan's microbatch but ``rows`` (packing, width, anything added later) is
    kept by construction (``dataclasses.replace``), then checked field by field
    (`check_matches_plan`).
    """
    if row_ids is None:
        local = [mb for mb in planned]
    else:
        local_of = {int(g): i for i, g in enumerate(row_ids)}
        missing = sorted({r for mb in planned for r in mb.rows if r >= 0} - set(local_of))
        if missing:
            raise PlanMismatch(
                f"the plan trains step rows {missing[:8]}{'...' if len(missing) > 8 else ''} that this share does not "
                f"hold (it holds {sorted(local_of)[:8]}...): the share was made for another rank or another plan; "
                "make shares with actor.distribute on the same actor settings"
            )
        local = [dataclasses.replace(mb, rows=tuple(local_of[r] if r >= 0 else -1 for r in mb.rows)) for mb in planned]
    check_matches_plan(local, planned, row_ids)
    return local


def check_matches_plan(local: list[Microbatch], planned: list[Microbatch], row_ids: list[int] | None) -> None:
    """Raise PlanMismatch naming the first field in which a rank's microbatch differs from the plan's."""
    if len(local) != len(planned):
        raise PlanMismatch(f"this rank has {len(local)} microbatches, the plan {len(planned)}")
    for m, (mine, plan) in enumerate(zip(local, planned)):
        for field in dataclasses.fields(Microbatch):
            got, want = getattr(mine, field.name), getattr(plan, field.name)
            if field.name == "rows":
                got = tuple(int(row_ids[r]) if r >= 0 and row_ids is not None else r for r in got)
            if got != want:
                raise PlanMismatch(
                    f"microbatch {m}: field {field.name!r} is {got!r} on this rank but {want!r} in the step's plan: "
                    "a rank's microbatches must keep every property of the plan (packing, CP chunking, widths)"
                )


__all__ = ["Microbatch", "PlanMismatch", "check_matches_plan", "plan_step", "rank_microbatches", "split_balanced",
           "split_contiguous"]
