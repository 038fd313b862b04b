"""The actor's LR schedule (megatron's OptimizerParamScheduler): linear warmup from 0, then decay to min_lr.

Run in a harness rank because importing megatron-core takes seconds (the harness's forkserver has it loaded).
"""

from __future__ import annotations

import pytest

from tests.distributed.harness import run_distributed


class _FakeOptimizer:
    """What OptimizerParamScheduler touches: param_groups."""

    def __init__(self) -> None:
        self.param_groups = [{"lr": None, "weight_decay": None}]


def _lrs(rank: int, world_size: int, cfg_fields: dict, total: int) -> list[float]:
    from megatron_rl.actor.optim import build_scheduler
    from megatron_rl.config import OptimizerConfig

    optimizer = _FakeOptimizer()
    scheduler = build_scheduler(OptimizerConfig(**cfg_fields), optimizer, total_optimizer_steps=total)
    lrs = []
    for _ in range(total + 2):
        scheduler.step(increment=1)  # the actor steps the schedule before each optimizer step
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_warmup_then_linear_decay():
    lrs = run_distributed(_lrs, 1, dict(lr=1e-3, min_lr=1e-4, warmup_steps=4, decay_style="linear"), 10)[0]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # optimizer step k (1-based) at k / 4 x lr: never 0
    assert lrs[6] == pytest.approx(1e-3 - (1e-3 - 1e-4) * 3 / 6)
    assert lrs[9:] == pytest.approx([1e-4] * 3)


def test_constant_without_warmup():
    lrs = run_distributed(_lrs, 1, dict(lr=2e-6, weight_decay=0.1), 3)[0]
    assert lrs == pytest.approx([2e-6] * 5)
