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
import torch.nn.functional as F

from megatron_rl.actor.logprobs import vocab_parallel_logprobs
from megatron_rl.actor.plan import Microbatch


def loss_scale(num_microbatches: int, data_parallel_size: int) -> int:
    """M x D: what the returned loss is multiplied by so megatron's 1/M and DDP's 1/(D x CP) cancel (see above)."""
    return num_microbatches * data_parallel_size


@dataclass
class MicrobatchInputs:
    """Tensors of one microbatch ([B_m, W]: B_m rows padded to W tokens), on the model's device."""

    mb: Microbatch
    tokens: torch.Tensor
    """[B_m, W] int64 input ids (0 on padding)."""
    position_ids: torch.Tensor
    """[B_m, W] int64."""
    targets: torch.Tensor
    """[B_m, W] int64: the token each position predicts (tokens shifted left; 0 at the last position)."""
    response_mask: torch.Tensor
    """[B_m, W] bool, aligned with tokens (False on padding rows)."""
    advantages: torch.Tensor | None = None
    """[B_m] or [B_m, W]."""
    old_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def take_rows(values: torch.Tensor | None, mb: Microbatch, *, per_token: bool, fill=0) -> torch.Tensor | None:
    """values[rows] ([B_m, ...]), and for per-token tensors columns [:W]; padding rows/columns are `fill`."""
    if values is None:
        return None
    num_rows, width = len(mb.rows), mb.width
    tail = values.shape[2:] if per_token else values.shape[1:]
    shape = (num_rows, width, *tail) if per_token else (num_rows, *tail)
    out = torch.full(shape, fill, dtype=values.dtype)
    real = [i for i, r in enumerate(mb.rows) if r >= 0]
    if real:
        rows = torch.tensor([mb.rows[i] for i in real])
        if per_token:
            span = min(width, values.shape[1])
            out[real, :span] = values[rows, :span]
        else:
            out[real] = values[rows]
    return out


def microbatch_inputs(batch, mb: Microbatch, lengths: torch.Tensor, device: torch.device, *, with_loss_inputs: bool) -> MicrobatchInputs:
    """The tensors of microbatch `mb` of `batch` (a TrainBatch); token ids past each row's length are 0."""
    tokens = take_rows(batch.tokens, mb, per_token=True)
    row_len = take_rows(lengths, mb, per_token=False)
    tokens = torch.where(torch.arange(mb.width).unsqueeze(0) < row_len.unsqueeze(1), tokens, 0)
    targets = F.pad(tokens[:, 1:], (0, 1))
    positions = torch.arange(mb.width, dtype=torch.int64).unsqueeze(0).expand(len(mb.rows), -1).contiguous()
    inputs = MicrobatchInputs(
        mb=mb,
        tokens=tokens.to(device),
        position_ids=positions.to(device),
        targets=targets.to(device),
        response_mask=take_rows(batch.response_mask, mb, per_token=True, fill=False).to(device),
    )
    if with_loss_inputs:
        per_token_adv = batch.advantages.dim() == 2
        inputs.advantages = take_rows(batch.advantages, mb, per_token=per_token_adv).to(device)
        for name in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
            value = take_rows(getattr(batch, name), mb, per_token=True)
            setattr(inputs, name, None if value is None else value.to(device))
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


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, settings: LogprobSettings, *, with_entropy: bool):
    """Token-aligned (logprobs, entropy or None) [B, W] from this TP rank's vocab-parallel logits [B, W, V/TP]."""
    shard = logits.shape[-1]
    logprobs, entropy = vocab_parallel_logprobs(
        logits,
        targets,
        group=settings.tp_group,
        vocab_start=settings.tp_rank * shard,
        vocab_size=settings.vocab_size,
        temperature=settings.temperature,
        with_entropy=with_entropy,
    )
    return token_aligned(logprobs), None if entropy is None else token_aligned(entropy)


def inference_loss(inputs: MicrobatchInputs, settings: LogprobSettings) -> Callable:
    """Loss function of a no-grad forward: returns (0, {"logprobs": [B_m, W]})."""

    def loss_func(logits: torch.Tensor):
        logprobs, _ = logprobs_of(logits, inputs.targets, settings, with_entropy=False)
        return logprobs.new_zeros(()), {"logprobs": logprobs.detach()}

    return loss_func


def policy_loss(
    inputs: MicrobatchInputs,
    settings: LogprobSettings,
    *,
    loss_fn: Callable,
    algorithm_cfg,
    denom,
    scale: int,
    compute_entropy: bool,
) -> Callable:
    """Loss function of a training microbatch: (loss_sum x scale, metrics) with loss_sum from the registry."""
    train_entropy = bool(algorithm_cfg.entropy_coeff)

    def loss_func(logits: torch.Tensor):
        logprobs, entropy = logprobs_of(logits, inputs.targets, settings, with_entropy=compute_entropy or train_entropy)
        if entropy is not None and not train_entropy:
            entropy = entropy.detach()  # a metric only: no backward through it
        loss_sum, metrics = loss_fn(
            logprobs,
            inputs.old_logprobs,
            inputs.advantages,
            inputs.response_mask,
            algorithm_cfg,
            denom,
            ref_logprobs=inputs.ref_logprobs,
            rollout_logprobs=inputs.rollout_logprobs,
            entropy=entropy,
        )
        return loss_sum * scale, metrics

    return loss_func


__all__ = [
    "LogprobSettings",
    "MicrobatchInputs",
    "inference_loss",
    "logprobs_of",
    "loss_scale",
    "microbatch_inputs",
    "policy_loss",
    "take_rows",
    "token_aligned",
]
