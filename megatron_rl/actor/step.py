"""One microbatch through megatron's schedule: its input tensors, and the loss function the schedule calls.

How the normalisation contract meets megatron-core (the scale factor)
--------------------------------------------------------------------
Every policy loss returns ``loss_sum``: the microbatch's share of the
whole-step loss, already divided by the step's global token or sequence
count (`megatron_rl.algorithms.normalization`), so the gradient the optimizer
must see is the *sum* of d loss_sum / d theta over all microbatches and
ranks. megatron-core, as the actor configures it (calculate_per_token_loss
False, DDP average_in_collective False), instead:

  * multiplies a loss function's ``(loss, metrics)`` result by CP and divides
    it by M, the number of microbatches (schedules.forward_step_calc_loss);
  * scales every gradient by 1 / (D x CP) before summing it over the DP x CP
    group (DDP's gradient_scaling_factor, dense and expert parameters alike);
  * finalize_model_grads then applies no further scaling (no token count is
    passed without calculate_per_token_loss).

The loss function therefore returns ``loss_sum x M x D`` (= `loss_scale`):
CP x (1/M) x 1/(D x CP) x M x D = 1. This keeps megatron's own handling of the
MoE auxiliary losses exactly as in pre-training: MoEAuxLossAutoScaler scales
their gradient by CP / M and DDP by 1 / (D x CP), i.e. the aux-loss gradient
is the average over microbatches and DP ranks of the per-microbatch aux-loss
gradients (with calculate_per_token_loss=True megatron would instead weight
each microbatch's aux loss by its token count and rely on a division by the
global token count that a sequence-level loss does not want).
tests/distributed/test_actor_layouts.py proves the result on six layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.actor.batch import BatchError
from megatron_rl.actor.logprobs import vocab_parallel_logprobs
from megatron_rl.actor.packing import TokenLayout, gather_positions, microbatch_layout, unpack_index
from megatron_rl.actor.microbatches import Microbatch
from megatron_rl.algorithms import all_reduce_metrics, finalize_metrics, merge_metrics
from megatron_rl.algorithms.metrics import max_metric, mean_metric
from megatron_rl.parallel.devices import host_to_device


def loss_scale(num_microbatches: int, data_parallel_size: int) -> int:
    """M x D: what the returned loss is multiplied by so megatron's 1/M and DDP's 1/(D x CP) cancel (see above)."""
    return num_microbatches * data_parallel_size


@dataclass
class MicrobatchInputs:
    """Tensors of one microbatch on the model's device.

    Model inputs follow the microbatch's `TokenLayout` ([B_m, W] padded rows, or
    [1, W / CP] packed sequences); loss inputs are per row of the batch
    ([B_m, W_row], token-aligned like TrainBatch), whatever the layout.
    """

    mb: Microbatch
    layout: TokenLayout
    tokens: torch.Tensor
    """Model input ids (0 on padding)."""
    position_ids: torch.Tensor
    """Model position ids (restarting per packed sequence)."""
    targets: torch.Tensor
    """The token each input position predicts (the next token of its row; 0 past the row)."""
    response_mask: torch.Tensor
    """[B_m, W_row] bool: response tokens whose logprob this rank computes (False on padding rows)."""
    sequence_mask: torch.Tensor
    """[B_m, W_row] bool: the rows' response tokens, wherever computed (differs under CP: the counts)."""
    advantages: torch.Tensor | None = None
    """[B_m] or [B_m, W_row]."""
    old_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    token_staleness: torch.Tensor | None = None
    """[B_m, W_row] int64: the batch's policy version minus the weight version each token was sampled with
    (when the batch carries both; `stale_tokens` are already out of response_mask and sequence_mask)."""
    stale_tokens: torch.Tensor | None = None
    """[B_m, W_row] bool: response tokens of this rank older than the staleness bound, left out of the loss."""
    row_index: torch.Tensor | None = None
    """Packed only: [B_m, W_row] int64, the flattened input position whose output scores row token t."""
    row_valid: torch.Tensor | None = None
    """Packed only: [B_m, W_row] bool, row_index points at a position of this rank."""

    def to_rows(self, per_position: torch.Tensor) -> torch.Tensor:
        """Per-input-position values (computed at t for the token at t + 1) -> token-aligned [B_m, W_row]."""
        if self.row_index is None:
            return token_aligned(per_position)
        picked = per_position.reshape(-1)[self.row_index]
        return torch.where(self.row_valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def take_rows(values: torch.Tensor | None, mb: Microbatch, *, per_token: bool, fill=0) -> torch.Tensor | None:
    """values[rows] ([B_m, ...]), and for per-token tensors columns [:W]; padding rows/columns are `fill`."""
    if values is None:
        return None
    num_rows, width = len(mb.rows), mb.width
    tail = values.shape[2:] if per_token else values.shape[1:]
    rows = torch.tensor(mb.rows, dtype=torch.int64)
    real = rows >= 0
    if per_token:  # every slot at once (padding slots are overwritten with `fill` below), only the width it needs
        span = min(width, values.shape[1])
        picked = values[rows.clamp(min=0), :span]
        if span < width:
            picked = torch.cat([picked, picked.new_full((num_rows, width - span, *tail), fill)], dim=1)
    else:
        picked = values[rows.clamp(min=0)]
    mask = real.reshape(num_rows, *([1] * (picked.dim() - 1)))
    return torch.where(mask, picked, torch.as_tensor(fill, dtype=values.dtype))


def params_on(params, device: torch.device):
    """A copy of PackedSeqParams with its cu_seqlens tensors on `device` (pinned, non-blocking copies)."""
    import dataclasses

    moved = {field.name: host_to_device(value, device) for field in dataclasses.fields(params)
             if isinstance(value := getattr(params, field.name), torch.Tensor)}
    return dataclasses.replace(params, **moved)


def microbatch_inputs(
    batch, mb: Microbatch, lengths: torch.Tensor, device: torch.device, *, with_loss_inputs: bool,
    multiple: int = 1, cp_size: int = 1, cp_rank: int = 0, max_staleness: int | None = None,
    params_device: torch.device | None = None,
) -> MicrobatchInputs:
    """The tensors of microbatch `mb` of `batch` (a TrainBatch); token ids past each row's length are 0.

    multiple, cp_size, cp_rank: the packed layout's padding multiple and this rank's CP chunks.
    params_device: where a packed layout's cu_seqlens go (Transformer Engine on CUDA), None: the host.
    max_staleness: with loss inputs and a batch carrying token_versions and policy_version, response
    tokens whose staleness (policy_version - token version) exceeds it leave both masks (`stale_tokens`).
    """
    layout = microbatch_layout(mb, lengths, multiple=multiple, cp_size=cp_size, cp_rank=cp_rank)
    if params_device is not None and layout.packed_seq_params is not None:  # models.kernels.packed_params_device
        layout.packed_seq_params = params_on(layout.packed_seq_params, params_device)
    real = layout.real(lengths)
    tokens = gather_positions(batch.tokens, layout, real)
    row_len = lengths[layout.rows.clamp(min=0)]
    following = TokenLayout(rows=layout.rows, positions=layout.positions + 1, position_ids=layout.position_ids)
    targets = gather_positions(batch.tokens, following, real & (layout.positions + 1 < row_len))
    row_mb, row_index, row_valid = mb, None, None
    if mb.packed:
        row_mb = Microbatch(mb.rows or (-1,), int(lengths[list(mb.rows)].max()) if mb.rows else 1)
        row_index, row_valid = unpack_index(layout, row_mb, lengths, row_mb.width)
    sequence_mask = take_rows(batch.response_mask, row_mb, per_token=True, fill=False)
    token_staleness = stale = None
    if with_loss_inputs and batch.token_versions is not None and batch.policy_version is not None:
        token_staleness = batch.policy_version - take_rows(batch.token_versions, row_mb, per_token=True, fill=batch.policy_version)
        if max_staleness is not None:
            stale = sequence_mask & (token_staleness > max_staleness)
            sequence_mask = sequence_mask & ~stale
    response_mask = sequence_mask if row_valid is None else sequence_mask & row_valid
    if stale is not None and row_valid is not None:
        stale = stale & row_valid  # counted on the CP rank that computes the token
    def to_device(t: torch.Tensor | None) -> torch.Tensor | None:  # pinned, non-blocking: no stream sync each
        return None if t is None else host_to_device(t, device)

    inputs = MicrobatchInputs(
        mb=mb,
        layout=layout,
        tokens=to_device(tokens),
        position_ids=to_device(layout.position_ids),
        targets=to_device(targets),
        response_mask=to_device(response_mask),
        sequence_mask=to_device(sequence_mask),
        row_index=to_device(row_index),
        row_valid=to_device(row_valid),
        token_staleness=to_device(token_staleness),
        stale_tokens=to_device(stale),
    )
    if with_loss_inputs:
        per_token_adv = batch.advantages.dim() == 2
        inputs.advantages = to_device(take_rows(batch.advantages, row_mb, per_token=per_token_adv))
        for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
            setattr(inputs, name, to_device(take_rows(getattr(batch, name), row_mb, per_token=True)))
    return inputs


def token_aligned(per_position: torch.Tensor) -> torch.Tensor:
    """[B, W] values computed at position t for token t + 1 -> aligned with the tokens (column 0 = 0)."""
    return F.pad(per_position[:, :-1], (1, 0))


@dataclass
class LogprobSettings:
    """How logits become log-probabilities (the same on every forward)."""

    tp_group: Any
    tp_rank: int
    vocab_size: int
    """The real vocabulary (megatron's output layer is padded beyond it)."""
    temperature: float


def logprobs_of(logits: torch.Tensor, inputs: MicrobatchInputs, settings: LogprobSettings, *, with_entropy: bool):
    """Token-aligned per-row (logprobs, entropy or None) [B_m, W_row] from this TP rank's vocab-parallel logits."""
    shard = logits.shape[-1]
    logprobs, entropy = vocab_parallel_logprobs(
        logits,
        inputs.targets,
        group=settings.tp_group,
        vocab_start=settings.tp_rank * shard,
        vocab_size=settings.vocab_size,
        temperature=settings.temperature,
        with_entropy=with_entropy,
    )
    return inputs.to_rows(logprobs), None if entropy is None else inputs.to_rows(entropy)


def inference_loss(inputs: MicrobatchInputs, settings: LogprobSettings) -> Callable:
    """Loss function of a no-grad forward: returns (0, {"logprobs": [B_m, W]})."""

    def loss_func(logits: torch.Tensor):
        logprobs, _ = logprobs_of(logits, inputs, settings, with_entropy=False)
        return logprobs.new_zeros(()), {"logprobs": logprobs.detach()}

    return loss_func


NONFINITE_POLICY_TOKENS = "policy/nonfinite_logprobs/sum"
"""Metric: response tokens whose logprob in the training forward is NaN/inf (where it is the old policy)."""


def policy_loss(
    inputs: MicrobatchInputs,
    settings: LogprobSettings,
    *,
    loss_fn: Callable,
    algorithm_cfg,
    denom,
    scale: int,
    compute_entropy: bool,
    count_nonfinite: bool = False,
) -> Callable:
    """Loss function of a training microbatch: (loss_sum x scale, metrics) with loss_sum from the registry.

    Without inputs.old_logprobs the forward's own logprobs, detached, are the old policy's (train.old_logprobs:
    the step runs at the old policy's weights); count_nonfinite adds NONFINITE_POLICY_TOKENS, this
    microbatch's response tokens whose logprob is NaN/inf (the actor refuses to step on any)."""
    train_entropy = bool(algorithm_cfg.entropy_coeff)

    def loss_func(logits: torch.Tensor):
        logprobs, entropy = logprobs_of(logits, inputs, settings, with_entropy=compute_entropy or train_entropy)
        if entropy is not None and not train_entropy:
            entropy = entropy.detach()  # a metric only: no backward through it
        old_logprobs = inputs.old_logprobs if inputs.old_logprobs is not None else logprobs.detach()
        loss_sum, metrics = loss_fn(
            logprobs,
            old_logprobs,
            inputs.advantages,
            inputs.response_mask,
            algorithm_cfg,
            denom,
            ref_logprobs=inputs.ref_logprobs,
            rollout_logprobs=inputs.rollout_logprobs,
            entropy=entropy,
        )
        if inputs.token_staleness is not None:
            metrics = {**metrics, **staleness_metrics(inputs)}
        if count_nonfinite:
            bad = inputs.response_mask & ~torch.isfinite(logprobs.detach())
            metrics = {**metrics, NONFINITE_POLICY_TOKENS: bad.sum(dtype=torch.float64)}
        return loss_sum * scale, metrics

    return loss_func


def staleness_metrics(inputs: MicrobatchInputs) -> dict[str, torch.Tensor]:
    """Per-token staleness over this rank's response tokens (those masked as too stale included).

    ``async/token_staleness`` (mean) and ``/max``; ``async/stale_tokens_masked/sum``: tokens older
    than the bound, left out of the loss and of the step's denominators.
    """
    stale = inputs.stale_tokens if inputs.stale_tokens is not None else torch.zeros_like(inputs.response_mask)
    arrived = inputs.response_mask | stale
    staleness = torch.where(arrived, inputs.token_staleness, 0).to(torch.float64)
    return {
        "async/token_staleness": mean_metric(staleness, arrived),
        "async/token_staleness/max": max_metric(staleness, arrived),
        "async/stale_tokens_masked/sum": stale.sum().to(torch.float64),
    }


def refuse_nonfinite_own_logprobs(outputs: list[dict], device: torch.device) -> None:
    """Before the optimizer steps on them: the training forward's own logprobs (the old policy's where
    train.old_logprobs takes them, NONFINITE_POLICY_TOKENS of each microbatch's `policy_loss`) must be finite on
    every response token, on every rank (the check the old-policy forward makes otherwise). Every rank calls it."""
    flag = torch.zeros((), dtype=torch.float64, device=device)
    for out in outputs:  # summed on the device: one host read below, once per step
        flag += out[NONFINITE_POLICY_TOKENS]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag)  # the last stage's counts reach every rank: all of them stop, or none
    bad = float(flag)
    if bad > 0:
        raise BatchError(
            f"policy logprobs: {bad:.0f} non-finite response token(s) in the training forward, which is the "
            "old policy here (train.old_logprobs): the model's forward produced NaN/inf (its weights or activations "
            "diverged: lower the lr, check the checkpoint); the optimizer did not step"
        )


def reduce_step_metrics(per_mini_batch: list[dict], ctx) -> dict[str, float]:
    """Exact metrics over microbatches, mini-batches and DP ranks, broadcast from the last stage to every rank."""
    result = [None]
    if ctx.is_pipeline_last_stage():
        merged = merge_metrics(per_mini_batch)
        merged = all_reduce_metrics(merged, group=ctx.dp_cp_group)
        result[0] = finalize_metrics(merged)
    if ctx.pp_size > 1:
        dist.broadcast_object_list(result, src=ctx.pp_last_rank, group=ctx.pp_group)
    return dict(result[0])


__all__ = [
    "NONFINITE_POLICY_TOKENS",
    "LogprobSettings",
    "MicrobatchInputs",
    "inference_loss",
    "logprobs_of",
    "loss_scale",
    "microbatch_inputs",
    "policy_loss",
    "reduce_step_metrics",
    "refuse_nonfinite_own_logprobs",
    "staleness_metrics",
    "take_rows",
    "token_aligned",
]
