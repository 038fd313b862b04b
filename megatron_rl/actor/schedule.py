"""megatron's pipeline schedule over one mini-batch's microbatches, and the forward-only logprob pass built on it.

    outputs = run_schedule(chunks, items, forward_step, forward_only=False)       # the training step's forward-backward
    logprobs = forward_logprobs(chunks, batch, mini_batches, make_inputs, settings, ctx)   # no gradient, [B, T]

The forward-only pass (the old policy's or the reference model's logprobs) runs one schedule per mini-batch, since
microbatch shapes agree within one. Each row's logprobs are written on one rank of its model-parallel group (the
last pipeline stage's TP rank 0) and `assemble_rows` sums them onto every rank that needs them.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import TrainBatch
from megatron_rl.actor.packing import write_rows
from megatron_rl.actor.microbatches import Microbatch
from megatron_rl.actor.step import LogprobSettings, inference_loss


def run_schedule(chunks: list, items: list, forward_step, *, forward_only: bool) -> list:
    """megatron's forward_backward_func over the microbatch inputs `items` (one mini-batch: one width, one size)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(items),
        model=chunks,
        num_microbatches=len(items),
        seq_length=items[0].mb.width,
        micro_batch_size=items[0].tokens.shape[0],
        forward_only=forward_only,
    )


def is_logprob_owner(ctx) -> bool:
    """Whether this rank writes the logprobs its model-parallel group computed: the last stage's TP rank 0."""
    return ctx.is_pipeline_last_stage() and ctx.tp_rank == 0


def assemble_rows(ctx, batch: TrainBatch, values: torch.Tensor) -> torch.Tensor:
    """Values of this rank's rows, written on one rank of its model-parallel group (and, with CP, each
    position on the CP rank that computed it), on every rank that needs them: summed over TP x PP and
    CP (the share's rows, O(B/D)); for a whole batch also over DP."""
    values = values.to(ctx.device)
    if ctx.tp_size * ctx.pp_size > 1:
        dist.all_reduce(values, group=ctx.model_parallel_group)
    if ctx.cp_size > 1:  # each CP rank wrote the positions of its chunks
        dist.all_reduce(values, group=ctx.cp_group)
    if batch.row_ids is None and ctx.dp_size > 1:
        dist.all_reduce(values, group=ctx.dp_group)
    return values.cpu()


@torch.no_grad()
def forward_logprobs(
    chunks: list,
    batch: TrainBatch,
    mini_batches: list[list[Microbatch]],
    make_inputs: Callable[[Microbatch, torch.Tensor], object],
    settings: LogprobSettings,
    ctx,
    *,
    routing=None,
    record: bool = False,
    recorder=None,
    replay=None,
    drift_reference=None,
) -> torch.Tensor:
    """Forward-only pass of `chunks` over the microbatches of `mini_batches`; logprobs [B, T] aligned with `batch`
    (0 on rows not in them), on every rank.

    make_inputs(mb, lengths): the microbatch's inputs (actor.step.microbatch_inputs). routing: the policy's
    `routing.RoutingControl` (None for the reference model), which replays `replay`, compares with
    `drift_reference`, and with `record` adds the routes its routers used to `recorder` (a `routing.RouteRecorder`).
    """
    lengths = batch.lengths()

    def forward_step(data_iterator, model):
        inputs = next(data_iterator)
        if routing is not None:
            routing.begin_microbatch(inputs.layout, lengths, replay=replay, reference=drift_reference, record=record)
        output = model(inputs.tokens, inputs.position_ids, attention_mask=None, packed_seq_params=inputs.layout.packed_seq_params)
        if routing is not None:
            routing.end_microbatch(inputs.layout, recorder)
        return output, inference_loss(inputs, settings)

    for chunk in chunks:
        chunk.eval()
    logprobs = torch.zeros(batch.batch_size, batch.seq_len, dtype=torch.float32)
    for microbatches in mini_batches:  # one schedule per mini-batch: shapes agree within one
        items = [make_inputs(mb, lengths) for mb in microbatches]
        try:
            outputs = run_schedule(chunks, items, forward_step, forward_only=True)
        finally:
            if routing is not None:
                routing.reset()
        if is_logprob_owner(ctx):
            for inputs, out in zip(items, outputs):
                write_rows(logprobs, out["logprobs"].float().cpu(), inputs.mb.rows, lengths)
    # Each row was written on one rank of its model-parallel group (last stage, TP rank 0).
    return assemble_rows(ctx, batch, logprobs)


__all__ = ["assemble_rows", "forward_logprobs", "is_logprob_owner", "run_schedule"]
