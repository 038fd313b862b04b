"""Where a profiled step's time goes (megatron_rl.actor.phases): each kernel counted once, in the innermost range.

A hand-made trace of torch's own profiler events (FunctionEvent: ranges, ops, the kernels each op launched, the
GPU timeline's own copies of the ranges) with durations chosen so that every way of counting a kernel twice or
counting a range's span gives a different total; and the committed H100 records, re-derived from what they hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from megatron_rl.actor.phases import PHASES, phase_breakdown, phases_check, rederived_phases

ROOT = Path(__file__).resolve().parents[2]


class Trace:
    """FunctionEvents nested as the profiler nests them (one host thread), kernels attached to the op that launched them."""

    def __init__(self) -> None:
        self.events: list[FunctionEvent] = []
        self.stack: list[FunctionEvent] = []

    def cpu(self, name: str, start: float, end: float) -> FunctionEvent:
        evt = FunctionEvent(id=len(self.events) + 1, name=name, thread=1, start_us=start, end_us=end, use_device="cuda",
                            is_user_annotation=name.startswith("phase::"))
        while self.stack and self.stack[-1].time_range.end <= start:
            self.stack.pop()
        if self.stack:
            evt.set_cpu_parent(self.stack[-1])
            self.stack[-1].append_cpu_child(evt)
        self.stack.append(evt)
        self.events.append(evt)
        return evt

    def kernel(self, op: FunctionEvent, name: str, start: float, microseconds: float) -> None:
        op.append_kernel(name, 0, microseconds)
        self.events.append(FunctionEvent(id=len(self.events) + 1, name=name, thread=7, start_us=start,
                                         end_us=start + microseconds, device_type=DeviceType.CUDA, use_device="cuda",
                                         linked_correlation_id=op.id))

    def gpu_range(self, name: str, start: float, end: float) -> None:
        """The GPU timeline's copy of a labelled range (a user annotation spanning its kernels and the gaps between)."""
        self.events.append(FunctionEvent(id=len(self.events) + 1, name=name, thread=7, start_us=start, end_us=end,
                                         device_type=DeviceType.CUDA, use_device="cuda", is_user_annotation=True))


def _moe_step() -> Trace:
    """An MoE layer (router and experts inside it, its own gather), an op outside every range, an optimizer step."""
    t = Trace()
    t.cpu("phase::moe_layer", 0, 100)
    t.cpu("phase::router", 10, 20)
    t.kernel(t.cpu("aten::mm", 11, 19), "gemm_router", 1000, 5)
    t.cpu("phase::experts", 30, 60)
    grouped = t.cpu("aten::_grouped_mm", 31, 59)
    t.kernel(grouped, "cutlass_grouped", 1010, 20)
    t.kernel(t.cpu("aten::index_select", 70, 80), "indexSelect", 1040, 7)
    t.kernel(t.cpu("aten::add", 110, 120), "add_kernel", 1060, 3)
    t.cpu("phase::optimizer", 130, 200)
    t.cpu("Optimizer.step#AdamW.step", 131, 199)
    t.kernel(t.cpu("aten::_fused_adamw_", 140, 190), "fused_adam", 1070, 9)
    t.gpu_range("phase::moe_layer", 1000, 1047)  # 47 us of span for 32 us of kernels
    t.gpu_range("phase::experts", 1010, 1030)
    t.gpu_range("Optimizer.step#AdamW.step", 1070, 1079)
    return t


def test_each_kernel_counts_once_in_the_innermost_range_of_the_op_that_launched_it():
    out = phase_breakdown(_moe_step().events, wall_s=250e-6, cuda=True)
    us = {name: round(seconds * 1e6, 9) for name, seconds in out["phases_s"].items()}
    # router 5, experts 20 (inside the MoE layer, not again in it), the MoE layer's own gather 7, the add outside every
    # range 3, Adam 9: 44 us of kernels; the ranges' own GPU spans (47 + 20 + 9 us) are no work
    assert us == {"experts": 20, "attention": 0, "router": 5, "permutation": 7, "logprobs": 0, "optimizer": 9, "other": 3}
    assert out["device_busy_s"] == pytest.approx(44e-6) == pytest.approx(sum(out["phases_s"].values()))
    assert out["host_overhead_s"] == pytest.approx(250e-6 - 44e-6)
    assert [k["kernel"] for k in out["top_kernels"]] == ["cutlass_grouped", "fused_adam", "indexSelect", "gemm_router", "add_kernel"]
    assert phases_check(out)[0]


def test_on_cpu_each_outermost_op_counts_once():
    t = Trace()
    t.cpu("phase::attention", 0, 50)
    t.cpu("aten::linear", 5, 25)
    t.cpu("aten::mm", 6, 24)  # inside linear: its time is linear's, not counted again
    t.cpu("aten::softmax", 30, 40)
    t.cpu("aten::add", 60, 64)
    out = phase_breakdown(t.events, wall_s=100e-6, cuda=False)
    assert round(out["phases_s"]["attention"] * 1e6, 9) == 30 and round(out["phases_s"]["other"] * 1e6, 9) == 4
    assert set(out["phases_s"]) == set(PHASES) and out["device_busy_s"] is None


@pytest.mark.parametrize("name", ["gpu-nvidia-h100-80gb-hbm3.json", "gpu-speed-nvidia-h100-80gb-hbm3.json"])
def test_the_committed_h100_records_pass_their_phases_check(name):
    record = json.loads((ROOT / "bench" / "results" / name).read_text())
    phases = record["speed"]["megatron_rl"]["phases"]
    spans = sum(k["seconds"] for k in phases["top_kernels"] if k["kernel"].startswith("phase::") or "#" in k["kernel"])
    fixed = rederived_phases(phases)
    named = sum(v for k, v in phases["phases_s"].items() if k != "other")
    assert fixed["device_busy_s"] == pytest.approx(phases["device_busy_s"] - spans)
    assert fixed["phases_s"]["other"] == pytest.approx(max(0.0, phases["device_busy_s"] - spans - named))
    assert sum(fixed["phases_s"].values()) <= fixed["wall_s"]
    assert phases_check(fixed)[0]
    assert record["checks"]["phases"]["ok"] and "phases" not in record["failed_checks"]
