"""megatron's (distributed) optimizer and LR schedule from megatron_rl's OptimizerConfig."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from megatron_rl.config.core import ConfigError
from megatron_rl.config.schema import OptimizerConfig

SAME_NAMED_FIELDS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "clip_grad",
                     "use_distributed_optimizer")
"""OptimizerConfig fields that megatron's OptimizerConfig names alike and takes as they are."""

def build_optimizer(cfg: OptimizerConfig, model_chunks: list, *, dtype: torch.dtype):
    """megatron.core.optimizer.get_megatron_optimizer for the chunks (Adam or SGD, clipping, weight decay).

    bf16 parameters train with fp32 main parameters and gradients (megatron's
    mixed-precision optimizer); fp16 would need loss scaling and is refused.
    """
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    cfg.validate()
    if cfg.name == "sgd" and cfg.use_distributed_optimizer:
        raise ConfigError(
            "optimizer.name=sgd with optimizer.use_distributed_optimizer=true: megatron's distributed optimizer "
            "supports Adam only; set optimizer.use_distributed_optimizer=false for SGD"
        )
    if dtype == torch.float16:
        raise ConfigError("model.dtype=float16 needs dynamic loss scaling, which the actor does not do: use bfloat16 or float32")
    megatron_cfg = MegatronOptimizerConfig(
        optimizer=cfg.name,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        **{name: getattr(cfg, name) for name in SAME_NAMED_FIELDS},
    )
    optimizer = get_megatron_optimizer(megatron_cfg, model_chunks, use_gloo_process_groups=False)
    _, why = fuse_torch_adam(optimizer)
    if why:
        print(f"megatron_rl: optimizer: {why}", flush=True)
    return optimizer


def fuse_torch_adam(optimizer, device: torch.device | None = None) -> tuple[int, str]:
    """Run torch's Adam / AdamW inside megatron's optimizer as its fused kernel where it runs: (groups fused, why).

    megatron-core takes Transformer Engine's or apex's FusedAdam when one imports and torch's Adam
    otherwise, built with its default (foreach on a GPU: several launches per tensor group). torch's
    fused Adam is one kernel per group, the same update (Loshchilov & Hutter 2019 for AdamW); it is
    chosen by one tiny fused step on the device (`device`: the parameters' by default), never on CPU
    unless asked, where the actor's reference tests pin the foreach path's numbers.
    """
    groups = [group for opt in _torch_adams(optimizer) for group in opt.param_groups
              if group["params"] and not group.get("fused")]
    if not groups:
        return 0, ""
    if device is None:  # the parameters' device, on a GPU only (see above)
        device = groups[0]["params"][0].device
        if device.type != "cuda":
            return 0, ""
    failed = _fused_adam_fails(device.type, device.index)
    if failed:
        return 0, f"torch's Adam stays foreach ({failed})"
    for group in groups:
        group["fused"], group["foreach"] = True, False
    return len(groups), f"torch's fused Adam on {device.type} ({len(groups)} parameter group(s))"


def _torch_adams(optimizer) -> list:
    """The torch Adam / AdamW optimizers inside megatron's (chained) optimizer."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if type(getattr(opt, "optimizer", None)) in (torch.optim.Adam, torch.optim.AdamW)]


@contextlib.contextmanager
def kernel_choice_kept(optimizer) -> Iterator[None]:
    """Around a load: torch's and megatron's loads replace the param groups with the saved ones, `fused` and
    `foreach` included; this build's choice (fuse_torch_adam, made on this machine) is put back after it."""
    adams = _torch_adams(optimizer)
    chosen = [[(group.get("fused"), group.get("foreach")) for group in opt.param_groups] for opt in adams]
    yield
    for opt, flags in zip(adams, chosen):
        for group, (fused, foreach) in zip(opt.param_groups, flags):
            group["fused"], group["foreach"] = fused, foreach


@functools.cache
def _fused_adam_fails(device_type: str, index: int | None) -> str | None:
    """None where a fused AdamW step runs on the device, else the error (one line)."""
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        param = torch.zeros(8, device=device, requires_grad=True)
        param.grad = torch.ones(8, device=device)
        torch.optim.AdamW([param], lr=0.1, fused=True).step()
        if not bool(torch.isfinite(param).all()) or float(param.detach().abs().sum()) == 0:
            return "a probe step gave no update"
    except Exception as err:  # noqa: BLE001 - any failure: keep torch's default kernel
        return f"{type(err).__name__}: {' '.join(str(err).split())[:160]}"
    return None


def build_scheduler(cfg: OptimizerConfig, optimizer, *, total_optimizer_steps: int):
    """megatron's OptimizerParamScheduler: linear warmup from 0 over warmup_steps, then decay_style to min_lr.

    Stepped once *before* each optimizer step (`Actor` does it), so optimizer
    step k uses the rate at k: k / warmup_steps x lr during warmup (never 0),
    lr at the end of warmup, min_lr after lr_decay_steps (default: the run's
    optimizer steps).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = cfg.lr_decay_steps or total_optimizer_steps
    decay_steps = max(decay_steps, cfg.warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.warmup_steps > 0 else cfg.lr,
        max_lr=cfg.lr,
        min_lr=min(cfg.min_lr, cfg.lr),
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=cfg.decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        # A resumed run follows this config's schedule (e.g. more train.steps extends the decay).
        override_opt_param_scheduler=True,
    )


def ddp_config(cfg: OptimizerConfig, *, overlap_grad_reduce: bool = False):
    """DDP settings of the actor: fp32 gradient reduction, overlapped with backward where models.kernels.choose_overlap
    says so (GPUs, DP > 1), else one reduction after the last microbatch.

    megatron's defaults are kept on purpose: DDP scales gradients by 1 / (DP x CP)
    before its reduction (calculate_per_token_loss stays False); the loss is scaled
    up to cancel it (see megatron_rl.actor.step).
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        average_in_collective=False,
    )


def unshare_step_counters(optimizer) -> None:
    """Give each parameter's Adam `step` the loaded count, in a tensor of its own, after a load.

    megatron's distributed optimizer without apex / Transformer Engine saves the step count in each param group
    (torch's Adam keeps it per parameter). Its load puts one `step` tensor into the state of every parameter; torch's
    Adam adds 1 to each parameter's counter in place, so a shared one grows by the number of parameters per
    optimizer step and the bias correction (Kingma & Ba 2015, Alg. 1) goes wrong after a resume. And megatron
    0.16.1's dp_reshardable load then writes every bucket's placeholder `step` (0, from the state the load was
    described with) over the count: a resume would start Adam's bias correction again from step 1. So each
    counter is made again here from its group's loaded count (where the group has one), else cloned.
    The fused kernel (actor.optim.fuse_torch_adam) wants each counter on its parameter's device.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            on_device = bool(group.get("fused") or group.get("capturable"))
            loaded = group.get("step")  # the checkpoint's count (torch's own groups have no "step")
            for param in group["params"]:
                param_state = inner.state.get(param, {})
                if isinstance(param_state.get("step"), torch.Tensor):
                    step = torch.tensor(float(loaded)) if loaded is not None else param_state["step"].clone()
                    param_state["step"] = step.to(param.device, torch.float32) if on_device else step


def init_optimizer_state(optimizer) -> None:
    """Give every parameter an (empty) optimizer state, with its per-parameter `step` counter."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if opt.init_state_fn is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.tensor(0.0))


def zero_bucket_padding(optimizer_state) -> None:
    """Zero the gaps between parameters megatron's dp_reshardable state writes for each bucket.

    megatron fills them with torch.empty (nothing is loaded back from them), so a checkpoint would hold whatever
    memory was there: two runs that end in the same weights and moments would not write the same bytes.
    """
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(optimizer_state, dict):
        padding = optimizer_state.get("padding")
        if isinstance(padding, LocalNonpersistentObject) and padding.unwrap() is True:
            for value in optimizer_state.values():
                if isinstance(value, ShardedTensor) and value.data is not None:
                    value.data.zero_()
            return
        children = optimizer_state.values()
    elif isinstance(optimizer_state, (list, tuple)):
        children = optimizer_state
    else:
        return
    for child in children:
        zero_bucket_padding(child)


def sharded_state(model_chunks: list, optimizer, *, is_loading: bool, optimizer_format: str) -> dict:
    """The model chunks (``model{i}``) and the optimizer as one megatron sharded state dict.

    With is_loading=True every parameter first gets an (empty) optimizer state: megatron's distributed optimizer
    builds its sharded state from the inner torch optimizer's, which is empty before the first step; the loaded
    values replace these placeholders in place.
    """
    if is_loading:
        init_optimizer_state(optimizer)
    # megatron's DDP has no sharded_state_dict of its own (the generic one would prefix every
    # key with "module."), while its load_state_dict goes to the wrapped module: use that module.
    state = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model_chunks)}
    state["optimizer"] = optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": optimizer_format}
    )
    if not is_loading:
        zero_bucket_padding(state["optimizer"])
    return state


def load_sharded_state(model_chunks: list, optimizer, state: dict) -> None:
    """Load what `sharded_state(..., is_loading=True)` described, after dist checkpointing filled it."""
    for i, chunk in enumerate(model_chunks):
        chunk.module.load_state_dict(state[f"model{i}"])
    # no_grad: fp32 main parameters are views of the model's (leaf) parameters, which the load copies into
    with kernel_choice_kept(optimizer), torch.no_grad():  # the saved groups' fused / foreach flags are not this machine's
        optimizer.load_state_dict(state["optimizer"])
    unshare_step_counters(optimizer)


__all__ = [
    "build_optimizer", "build_scheduler", "ddp_config", "fuse_torch_adam", "init_optimizer_state", "kernel_choice_kept",
    "load_sharded_state", "sharded_state", "unshare_step_counters", "zero_bucket_padding",
]
