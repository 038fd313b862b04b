"""Where one training step's time goes: experts, attention, router and permutation, logprobs, optimizer, host.

    breakdown = profile_train_step(actor, batch)      # batch: a share with old_logprobs (actor.prepare_batch)
    breakdown["phases_s"]                             # {"experts": 0.41, "attention": 0.12, ...}

One `Actor.train_step` runs under torch's profiler with a labelled range around
the forward and the backward of each piece (module hooks, removed afterwards):

* experts: the routed experts' module (SequentialMLP, GroupedMLP, TEGroupedMLP);
* attention: the core attention (softmax(QK^T)V, not the projections);
* router: the MoE router (gating GEMM, top-k, aux losses);
* permutation: the MoE layer minus its router and experts (token dispatch / combine,
  the all-to-all or all-gather, permute / unpermute);
* logprobs: the output layer and the vocab-parallel logprobs / entropy (forward; the
  loss's backward falls in "other");
* optimizer: the optimizer step (gradient clipping, Adam, parameter copies);
* other: every other device op of the step (QKV / output projections, norms, embeddings, the
  loss, the gradient all-reduce);
* host overhead: the step's wall time minus the time the device was busy (CUDA: the sum of
  kernel times; on CPU there is no separate device and it is reported as None).

Phase times are device times (CUDA kernels launched inside the range, forward and backward
threads alike) on a GPU, and CPU times of the ranges on CPU. The profiler itself slows a
step down: the breakdown is for proportions, the step's own timing comes unprofiled.
"""

from __future__ import annotations

import contextlib
import time

import torch

EXPERT_MODULES = ("SequentialMLP", "GroupedMLP", "TEGroupedMLP")
ATTENTION_MODULES = ("LocalCoreAttention", "DotProductAttention", "TEDotProductAttention")
ROUTER_MODULES = ("TopKRouter",)
MOE_MODULES = ("MoELayer",)
OUTPUT_MODULES = ("ColumnParallelLinear",)  # the output layer (matched by name below)
PHASES = ("experts", "attention", "router", "permutation", "logprobs", "optimizer", "other")


def _label_of(name: str, module: torch.nn.Module) -> str | None:
    kind = type(module).__name__
    if kind in EXPERT_MODULES:
        return "experts"
    if kind in ATTENTION_MODULES:
        return "attention"
    if kind in ROUTER_MODULES:
        return "router"
    if kind in MOE_MODULES:
        return "moe_layer"
    if name.endswith("output_layer"):
        return "logprobs"
    return None


class _Ranges:
    """Labelled profiler ranges opened and closed by module hooks, forward and backward."""

    def __init__(self) -> None:
        self.open: dict[int, list] = {}
        self.handles: list = []

    def enter(self, key: int, label: str) -> None:
        rf = torch.autograd.profiler.record_function(f"phase::{label}")
        rf.__enter__()
        self.open.setdefault(key, []).append(rf)

    def exit(self, key: int) -> None:
        stack = self.open.get(key)
        if stack:
            stack.pop().__exit__(None, None, None)

    def attach(self, model_chunks: list) -> None:
        for chunk in model_chunks:
            for name, module in chunk.named_modules():
                label = _label_of(name, module)
                if label is None:
                    continue
                fwd, bwd = 2 * id(module), 2 * id(module) + 1
                self.handles += [
                    module.register_forward_pre_hook(lambda m, a, k=fwd, lab=label: self.enter(k, lab)),
                    module.register_forward_hook(lambda m, a, o, k=fwd: self.exit(k)),
                ]
                if label != "logprobs":  # the output layer's backward starts the loss's: left to "other"
                    self.handles += [
                        module.register_full_backward_pre_hook(lambda m, g, k=bwd, lab=label: self.enter(k, lab)),
                        module.register_full_backward_hook(lambda m, gi, go, k=bwd: self.exit(k)),
                    ]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        for stack in self.open.values():
            while stack:
                stack.pop().__exit__(None, None, None)


@contextlib.contextmanager
def _labelled_optimizer(actor):
    step = actor.optimizer.step

    def labelled(*args, **kwargs):
        with torch.autograd.profiler.record_function("phase::optimizer"):
            return step(*args, **kwargs)

    actor.optimizer.step = labelled
    try:
        yield
    finally:
        actor.optimizer.step = step


def profile_train_step(actor, batch) -> dict:
    """One train_step of `actor` on `batch` under the profiler; the per-phase breakdown (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = actor.ctx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    ranges = _Ranges()
    ranges.attach(actor.model)
    try:
        with _labelled_optimizer(actor), profile(activities=activities) as prof:
            if cuda:
                torch.cuda.synchronize(actor.ctx.device)
            start = time.perf_counter()
            actor.train_step(batch)
            if cuda:
                torch.cuda.synchronize(actor.ctx.device)
            wall = time.perf_counter() - start
    finally:
        ranges.detach()
    return phase_breakdown(prof.key_averages(), prof.events(), wall_s=wall, cuda=cuda)


def phase_breakdown(averages, events, *, wall_s: float, cuda: bool) -> dict:
    """Phase times (seconds) from the profiler's labelled ranges; nested ranges (router and experts inside the
    MoE layer) are subtracted from the enclosing one, so the phases do not overlap."""
    def total(event) -> float:
        return (event.device_time_total if cuda else event.cpu_time_total) / 1e6

    labelled = {evt.key.removeprefix("phase::"): total(evt) for evt in averages if evt.key.startswith("phase::")}
    phases = {name: labelled.get(name, 0.0) for name in ("experts", "attention", "router", "logprobs", "optimizer")}
    phases["permutation"] = max(0.0, labelled.get("moe_layer", 0.0) - phases["experts"] - phases["router"])
    if cuda:
        from torch.autograd import DeviceType

        busy = sum(evt.time_range.elapsed_us() for evt in events if _is_kernel(evt, DeviceType)) / 1e6
    else:
        busy = min(wall_s, sum(total(evt) for evt in events if evt.cpu_parent is None))  # top-level ops, ranges included
    named = sum(phases.values())
    phases["other"] = max(0.0, busy - named)
    kernels = top_kernels(events) if cuda else []
    return {
        "wall_s": wall_s,
        "device_busy_s": busy if cuda else None,
        "host_overhead_s": max(0.0, wall_s - busy) if cuda else None,
        "phases_s": {name: phases[name] for name in PHASES},
        "phases_fraction": {name: phases[name] / max(busy, named, 1e-12) for name in PHASES},
        "top_kernels": kernels,
    }


def _is_kernel(evt, device_types) -> bool:
    """A device kernel or copy, not a labelled range's projection onto the GPU timeline (phase::..., Optimizer.step#...)."""
    return evt.device_type == device_types.CUDA and not getattr(evt, "is_user_annotation", False) and not (
        evt.name.startswith("phase::") or "#" in evt.name)


def top_kernels(events, count: int = 20) -> list[dict]:
    """The device kernels that took the most time in the step: name (cut to 100 characters), seconds, launches."""
    from torch.autograd import DeviceType

    totals: dict[str, list] = {}
    for evt in events:
        if _is_kernel(evt, DeviceType):
            entry = totals.setdefault(evt.name[:100], [0.0, 0])
            entry[0] += evt.time_range.elapsed_us() / 1e6
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return [{"kernel": name, "seconds": seconds, "launches": launches} for name, (seconds, launches) in ranked]


__all__ = ["PHASES", "phase_breakdown", "profile_train_step", "top_kernels"]
