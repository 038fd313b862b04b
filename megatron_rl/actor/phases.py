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

Each piece of work is counted once, in the innermost range around it: on a GPU every device
kernel, in the phase of the op that launched it (forward and backward threads alike: the
profiler links each kernel to its op); on CPU every outermost op. The phases partition the
device's busy time: nested ranges (the router and experts inside the MoE layer) are not
counted twice. The profiler itself slows a step down: the breakdown is for proportions, the
step's own timing comes unprofiled.
"""

from __future__ import annotations

import contextlib
import time

import torch

EXPERT_MODULES = ("SequentialMLP", "GroupedMLP", "TEGroupedMLP")
ATTENTION_MODULES = ("LocalCoreAttention", "DotProductAttention", "TEDotProductAttention")
ROUTER_MODULES = ("TopKRouter", "SortedTopKRouter")
MOE_MODULES = ("MoELayer",)
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
    return phase_breakdown(prof.events(), wall_s=wall, cuda=cuda)


LABELS = {"experts": "experts", "attention": "attention", "router": "router", "moe_layer": "permutation",
          "logprobs": "logprobs", "optimizer": "optimizer"}
"""Labelled range -> phase: the innermost range around a piece of work names its phase (the MoE layer's own
work, outside its router and experts, is the permutation)."""


def _phase_of(evt) -> str:
    """The phase of the innermost labelled range around `evt` (itself included), "other" outside every range."""
    node = evt
    while node is not None:
        if node.name.startswith("phase::"):
            return LABELS.get(node.name.removeprefix("phase::"), "other")
        node = node.cpu_parent
    return "other"


def _is_range(evt) -> bool:
    """A labelled range or a user annotation (phase::..., Optimizer.step#...), not an op that does work."""
    return evt.name.startswith("phase::") or "#" in evt.name or bool(getattr(evt, "is_user_annotation", False))


def _work(events, cuda: bool):
    """(phase, seconds) of each piece of work, each counted once: on a GPU every device kernel, in the phase of the
    op that launched it; on CPU every outermost op (no op above it, only ranges), in the phase around it."""
    from torch.autograd import DeviceType

    for evt in events:
        if evt.device_type != DeviceType.CPU or _is_range(evt):
            continue
        if cuda:
            seconds = sum(k.duration for k in evt.kernels if not k.name.startswith("phase::") and "#" not in k.name)
            if seconds:
                yield _phase_of(evt), seconds / 1e6
            continue
        parent = evt.cpu_parent
        while parent is not None and _is_range(parent):
            parent = parent.cpu_parent
        if parent is None:
            yield _phase_of(evt), evt.cpu_time_total / 1e6


def phase_breakdown(events, *, wall_s: float, cuda: bool) -> dict:
    """Phase times (seconds) from the profiler's events, exclusive: each kernel (GPU) or outermost op (CPU) is
    counted once, in the innermost labelled range around the op that ran it (the router and the experts inside
    the MoE layer are theirs, not the permutation's too), so the phases add up to the device's busy time."""
    phases = dict.fromkeys(PHASES, 0.0)
    for phase, seconds in _work(events, cuda):
        phases[phase] += seconds
    attributed = sum(phases.values())
    if cuda:
        from torch.autograd import DeviceType

        busy = sum(evt.time_range.elapsed_us() for evt in events if _is_kernel(evt, DeviceType)) / 1e6
        phases["other"] += max(0.0, busy - attributed)  # kernels no op of this process launched (none expected)
    else:
        busy = attributed
    return {
        "wall_s": wall_s,
        "device_busy_s": busy if cuda else None,
        "host_overhead_s": max(0.0, wall_s - busy) if cuda else None,
        "phases_s": phases,
        "phases_fraction": {name: phases[name] / max(busy, 1e-12) for name in PHASES},
        "top_kernels": top_kernels(events) if cuda else [],
    }


def phases_check(breakdown: dict) -> tuple[bool, str]:
    """(ok, detail) of `make gpu-check`'s phases check: the phases add up to no more than the step's wall time."""
    named = sum(breakdown.get("phases_s", {}).values())
    wall = breakdown.get("wall_s", 0.0)
    ok = bool(breakdown.get("phases_s")) and named <= wall * 1.05 + 1e-3
    return ok, f"phases {sorted(breakdown.get('phases_s', {}))}: {named:.3f} s of a {wall:.3f} s profiled step"


def rederived_phases(breakdown: dict) -> dict:
    """A breakdown recorded before device time counted kernels only, corrected from what it recorded.

    Those runs counted the labelled ranges' own spans on the GPU timeline (phase::..., Optimizer.step#...) as
    device work, and "other" was the busy time left over; the record lists them among its top kernels. Taking
    them out of the busy time and "other" gives the kernels' time again: an upper bound where a range was too
    short to be listed (each unlisted one is shorter than the last listed entry). Unchanged when none is listed.
    """
    ranges = sum(k["seconds"] for k in breakdown.get("top_kernels", [])
                 if k["kernel"].startswith("phase::") or "#" in k["kernel"])
    if not ranges or breakdown.get("device_busy_s") is None:
        return breakdown
    busy = breakdown["device_busy_s"] - ranges
    phases = dict(breakdown["phases_s"])
    named = sum(v for k, v in phases.items() if k != "other")
    phases["other"] = max(0.0, busy - named)
    return {**breakdown, "device_busy_s": busy, "host_overhead_s": max(0.0, breakdown["wall_s"] - busy),
            "phases_s": phases, "phases_fraction": {k: v / max(busy, 1e-12) for k, v in phases.items()},
            "top_kernels": [k for k in breakdown["top_kernels"] if not (k["kernel"].startswith("phase::") or "#" in k["kernel"])],
            "rederived": f"{ranges:.6f} s of labelled ranges' spans taken out of the device busy time and other"}


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


__all__ = ["PHASES", "phase_breakdown", "phases_check", "profile_train_step", "rederived_phases", "top_kernels"]
