"""check_layout: every impossible layout is refused with the clashing numbers and a way out."""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError, ModelShape, ParallelConfig, check_layout, data_parallel_size

MOE = ModelShape(num_layers=4, num_attention_heads=8, num_query_groups=4, num_experts=8, hidden_size=64, vocab_size=128)
DENSE = ModelShape(num_layers=4, num_attention_heads=8, num_query_groups=4, num_experts=0)


def P(**kw) -> ParallelConfig:
    return ParallelConfig(**kw)


@pytest.mark.parametrize(
    "layout,world,dp",
    [
        (dict(), 1, 1),
        (dict(tensor_parallel=2, expert_tensor_parallel=2), 2, 1),
        (dict(pipeline_parallel=2), 2, 1),
        (dict(expert_parallel=2), 2, 2),
        (dict(), 2, 2),
        (dict(tensor_parallel=2, expert_parallel=2), 4, 2),
        (dict(pipeline_parallel=2, tensor_parallel=2, expert_tensor_parallel=2), 4, 1),
        (dict(pipeline_parallel=2, expert_parallel=2), 4, 2),
        (dict(tensor_parallel=2, pipeline_parallel=2, expert_parallel=2, expert_tensor_parallel=1), 4, 1),
        (dict(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=2), 4, 2),
        (dict(context_parallel=2), 4, 2),
        (dict(expert_parallel=8), 8, 8),
    ],
)
def test_valid_layouts_return_dp(layout, world, dp):
    assert check_layout(P(**layout), world, MOE, num_microbatches=4) == dp
    assert data_parallel_size(P(**layout), world) == dp


@pytest.mark.parametrize(
    "layout,world,shape,mbs,needles",
    [
        # world vs TP x PP x CP
        (dict(tensor_parallel=3), 4, None, None, ["world size 4", "TP x PP x CP = 3 x 1 x 1 = 3", "multiple of 3"]),
        (dict(tensor_parallel=2, pipeline_parallel=2), 6, None, None, ["world size 6", "2 x 2 x 1 = 4"]),
        # expert layout carved from the same ranks
        (dict(expert_parallel=4, pipeline_parallel=2), 4, None, None, ["expert TP x EP x PP = 1 x 4 x 2 = 8", "divides 4"]),
        (dict(expert_parallel=3), 4, None, None, ["= 1 x 3 x 1 = 3"]),
        # model shape
        (dict(pipeline_parallel=3), 3, MOE, None, ["num_layers=4", "pipeline_parallel=3", "[1, 2, 4]"]),
        (dict(tensor_parallel=3, expert_tensor_parallel=3), 3, MOE, None, ["8 query, 4 key/value", "tensor_parallel=3"]),
        (dict(tensor_parallel=8, expert_tensor_parallel=8), 8, MOE, None, ["4 key/value", "tensor_parallel=8"]),
        (dict(expert_parallel=3), 3, MOE, None, ["num_experts=8", "expert_parallel=3", "[1, 2, 4, 8]"]),
        (dict(expert_parallel=2), 2, DENSE, None, ["expert_parallel=2", "dense", "expert_parallel=1"]),
        (dict(pipeline_parallel=2), 2, MOE, 1, ["1 microbatches", "pipeline_parallel=2", "at least 2"]),
        # EP 1: megatron reduces expert grads over the dense DP group, so expert TP must be TP
        (dict(tensor_parallel=2, expert_tensor_parallel=1), 2, MOE, None, ["expert_tensor_parallel=1 != parallel.tensor_parallel=2", "expert_tensor_parallel=2"]),
        # sizes must be >= 1 (no ZeroDivisionError)
        (dict(tensor_parallel=0), 2, None, None, ["parallel.tensor_parallel=0", ">= 1"]),
        (dict(expert_tensor_parallel=-1), 2, None, None, ["parallel.expert_tensor_parallel=-1"]),
        (dict(), 0, None, None, ["world size 0"]),
    ],
)
def test_impossible_layouts_name_the_clash(layout, world, shape, mbs, needles):
    with pytest.raises(ConfigError) as info:
        check_layout(P(**layout), world, shape, num_microbatches=mbs)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {info.value}"


def test_shape_checks_need_a_shape():
    # Without a model shape only the world/layout arithmetic is checked.
    assert check_layout(P(tensor_parallel=2), 2) == 1
    assert check_layout(P(pipeline_parallel=2), 2, None, num_microbatches=1) == 1


def test_microbatches_only_matter_with_pipeline():
    assert check_layout(P(), 2, MOE, num_microbatches=1) == 2
    assert check_layout(P(pipeline_parallel=2), 2, MOE, num_microbatches=2) == 1


def test_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="timeout_s"):
        check_layout(P(timeout_s=0), 1)


def test_expert_tensor_parallel_defaults_follow_expert_parallel():
    # EP 1: experts are replicated over DP and must be split like the dense layers.
    assert ParallelConfig(tensor_parallel=2).expert_tensor_parallel == 2
    # EP > 1: experts are whole on each expert rank unless asked otherwise.
    assert ParallelConfig(tensor_parallel=2, expert_parallel=2).expert_tensor_parallel == 1
    assert ParallelConfig(tensor_parallel=2, expert_parallel=2, expert_tensor_parallel=2).expert_tensor_parallel == 2
