"""Check a parallel layout against the world size and the model before any process group exists.

megatron-core asserts these deep inside initialisation (or hangs in a
collective); here each clash is named with the numbers and a way out.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.core import ConfigError
from megatron_rl.config.schema import ParallelConfig


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """The numbers of a model that a layout must divide."""

    num_layers: int
    """Transformer layers."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups)."""
    num_experts: int = 0
    """Routed experts per MoE layer (0 = dense)."""
    hidden_size: int = 0
    """Model width (for messages only)."""
    vocab_size: int = 0
    """Vocabulary size (padded by megatron to a multiple of 128 x TP)."""


def data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    """DP = world / (TP x PP x CP)."""
    return world_size // (parallel.tensor_parallel * parallel.pipeline_parallel * parallel.context_parallel)


def check_layout(parallel: ParallelConfig, world_size: int, shape: ModelShape | None = None, num_microbatches: int | None = None) -> int:
    """Raise ConfigError for an impossible layout; return the data-parallel size."""
    parallel.validate()  # sizes >= 1 (a 0 would otherwise surface as ZeroDivisionError below)
    if world_size < 1:
        raise ConfigError(f"world size {world_size}: launch at least one process")
    tp, pp, ep, cp, etp = (
        parallel.tensor_parallel,
        parallel.pipeline_parallel,
        parallel.expert_parallel,
        parallel.context_parallel,
        parallel.expert_tensor_parallel,
    )
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} = {model_parallel}: "
            f"launch a multiple of {model_parallel} processes or lower parallel.tensor_parallel/pipeline_parallel/context_parallel"
        )
    dp = world_size // model_parallel
    # megatron carves the expert layout out of the same ranks: ETP x EP x expert-DP x PP = world.
    expert_span = etp * ep * pp
    if world_size % expert_span:
        raise ConfigError(
            f"world size {world_size} is not divisible by expert TP x EP x PP = {etp} x {ep} x {pp} = {expert_span}: "
            f"choose parallel.expert_parallel so that {etp * pp} x EP divides {world_size}"
        )
    if ep > dp * cp * tp // etp:
        raise ConfigError(
            f"parallel.expert_parallel={ep} exceeds the ranks available to experts (DP x CP x TP / expert TP = "
            f"{dp} x {cp} x {tp} / {etp} = {dp * cp * tp // etp}): lower expert_parallel or add processes"
        )
    if shape is None:
        return dp
    if shape.num_layers % pp:
        raise ConfigError(
            f"num_layers={shape.num_layers} is not divisible by parallel.pipeline_parallel={pp}: "
            f"choose a pipeline size among {[d for d in range(1, shape.num_layers + 1) if shape.num_layers % d == 0]}"
        )
    if shape.num_attention_heads % tp or shape.num_query_groups % tp:
        raise ConfigError(
            f"attention heads ({shape.num_attention_heads} query, {shape.num_query_groups} key/value) are not divisible by "
            f"parallel.tensor_parallel={tp}: choose a TP size that divides both"
        )
    if shape.num_experts:
        if shape.num_experts % ep:
            raise ConfigError(
                f"num_experts={shape.num_experts} is not divisible by parallel.expert_parallel={ep}: "
                f"choose EP among {[d for d in range(1, shape.num_experts + 1) if shape.num_experts % d == 0]}"
            )
        if ep == 1 and etp != tp:
            # megatron-core (0.16.1, tensor_parallel/layers.py:886) marks expert weights
            # `allreduce=True` when EP == 1, so DDP reduces their gradients over the dense
            # DP group, while an expert TP != TP replicates them over a different group
            # (expert DP): the replicas drift apart after the first step.
            raise ConfigError(
                f"parallel.expert_parallel=1 with parallel.expert_tensor_parallel={etp} != parallel.tensor_parallel={tp}: "
                f"without expert parallelism megatron treats experts as dense weights, so expert TP must equal TP; "
                f"set parallel.expert_tensor_parallel={tp} (or use expert_parallel > 1)"
            )
    elif ep > 1:
        raise ConfigError(f"parallel.expert_parallel={ep} but the model is dense (no experts): set parallel.expert_parallel=1")
    if num_microbatches is not None and pp > 1 and num_microbatches < pp:
        raise ConfigError(
            f"{num_microbatches} microbatches with parallel.pipeline_parallel={pp}: the pipeline needs at least {pp} "
            "microbatches per step to fill; lower train.micro_batch_size or max_tokens_per_microbatch"
        )
    return dp
