"""Validate a preset against its cluster and estimate per-device memory, without any GPU.

`plan(cfg)` runs, in order:
1. the cluster: trainer world size = nodes x GPUs per node - rollout GPUs, and
   rollout GPUs that leave every trainer node the same number of processes;
2. the model: its config.json read into a ModelSpec;
3. the batch: sequence length vs the model's context, sequences per optimizer
   step vs data-parallel ranks, microbatches per step;
4. the layout: megatron_rl.config.layout.check_layout (every parallel size
   against the world and the model), plus what only the cluster knows: TP and
   expert-TP groups inside a node, sequence parallelism for MoE with TP;
5. the rollout engine: its TP inside a node and dividing the heads, its GPUs
   dividing the GPUs it runs on, its KV cache holding at least one sequence;
6. memory: the worst pipeline stage's weights, gradients, optimizer state,
   activations, logits and this DP rank's batch share (logprobs, routes),
   on a CPU what the allocator keeps of a training step (resident through the push),
   and a colocated engine, in each phase of a step (generation, training,
   weight push: what train.offload and rollout.sleep_level free,
   plan.memory.phase_memory); the largest phase against what the device has
   after the runtime; CP needs packed sequences, and a packed token budget
   must hold one full-length sequence padded to the SP/CP multiple;
7. the weight push's time per step for each transport (plan.push_time).
Layout errors raise ConfigError; a layout that does not fit in memory returns
a Plan whose `fits` is False and whose `verdict()` names the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_rl.config.core import ConfigError
from megatron_rl.config.layout import check_layout
from megatron_rl.config.schema import RLConfig
from megatron_rl.config.placement import colocated_engines
from megatron_rl.plan.launch import LaunchShape, launch_shape
from megatron_rl.plan.push_time import PushTime, preset_push_times
from megatron_rl.plan.memory import (
    CPU_RUNTIME_OVERHEAD_GIB,
    GIB,
    EngineMemory,
    PhaseMemory,
    StageMemory,
    device_budget,
    engine_memory,
    phase_memory,
    precision_for,
    tokens_per_microbatch,
    worst_stage,
)

if TYPE_CHECKING:
    from megatron_rl.plan.model_spec import ModelSpec


@dataclass(kw_only=True)
class Plan:
    """Everything the planner found about one preset."""

    cfg: RLConfig
    spec: ModelSpec
    launch: LaunchShape
    data_parallel: int
    expert_data_parallel: int
    sequences_per_step: int
    """Sequences per optimizer step (all DP ranks)."""
    microbatches: int
    """Microbatches per optimizer step on one DP rank (an upper bound when packing by tokens)."""
    tokens_per_microbatch: int
    engines: int
    """Rollout engines (0: external servers)."""
    stage: StageMemory
    engine: EngineMemory | None
    phases: list[PhaseMemory]
    """What the worst device holds in each phase of a step (generation, training, push)."""
    budget: float
    """Bytes one device offers the trainer and a colocated engine, after the runtime."""
    push: list[PushTime] = field(default_factory=list)
    """Weight-push time per step, per transport (plan.push_time)."""
    warnings: list[str] = field(default_factory=list)

    @property
    def other_processes(self) -> int:
        """Trainer processes whose actors share the worst device's memory: on a CPU machine, every rank but the one
        with the engine (their memory is one); on GPUs none."""
        return self.launch.procs_per_node - 1 if self.cfg.cluster.gpus_per_node == 0 else 0

    def need(self, phase: PhaseMemory) -> float:
        """Bytes the device's memory must hold in `phase`: the worst rank's, and the other processes' actors on a CPU."""
        return phase.total + self.other_processes * phase.actor

    @property
    def peak(self) -> PhaseMemory:
        """The phase that needs the most memory."""
        return max(self.phases, key=self.need)

    @property
    def fits(self) -> bool:
        return self.need(self.peak) <= self.budget

    def verdict(self) -> str:
        peak = self.peak
        need, have = self.need(peak) / GIB, self.budget / GIB
        gpu = self.cfg.cluster.gpus_per_node > 0
        where = "per device" if gpu else (f"of this machine's memory after the runtime of {self.launch.procs_per_node} trainer "
                                          f"process(es) ({CPU_RUNTIME_OVERHEAD_GIB:g} GiB each)")
        if self.fits:
            return f"fits: {need:.1f} GiB of {have:.1f} GiB {where} at the peak ({peak.name}, {100 * need / have:.0f}%)"
        s = self.stage
        terms = (("weights", s.weights), ("grads", s.grads), ("optimizer", s.optimizer), ("activations", s.activations),
                 ("logits", s.logits), ("reference", s.reference), ("batch share", s.batch_share), ("heap kept", s.heap))
        if peak.name == "training":
            actor = ", ".join(f"{name} {value / GIB:.1f}" for name, value in terms if value)
        else:
            actor = f"actor {peak.actor / GIB:.1f}"
        parts = actor + (f", engine {peak.engine / GIB:.1f}" if peak.engine else "") + (
            f", push buckets {peak.push_buffers / GIB:.1f}" if peak.push_buffers else "")
        if not gpu:
            others = f", {self.other_processes} more actor(s) {self.other_processes * peak.actor / GIB:.1f}" if self.other_processes else ""
            return (
                f"does not fit: in the {peak.name} phase the run needs {need:.1f} GiB ({parts}{others}) but this machine "
                f"has {have:.1f} GiB after the runtime; {_hint(self)}"
            )
        return (
            f"does not fit: in the {peak.name} phase pipeline stage {s.stage} needs {need:.1f} GiB per device ({parts}) "
            f"but the device has {have:.1f} GiB after the runtime; {_hint(self)}"
        )


def _hint(plan: Plan) -> str:
    s, cfg, peak = plan.stage, plan.cfg, plan.peak
    if cfg.cluster.gpus_per_node == 0 and peak.engine > peak.actor:
        return (
            f"the in-process engine takes {peak.engine / GIB:.1f} GiB, {cfg.rollout.kv_cache_gib:g} of them its KV cache: "
            "lower rollout.kv_cache_gib"
        )
    colocated = plan.engine is not None and cfg.cluster.rollout_gpus == 0 and cfg.cluster.gpus_per_node > 0
    if colocated and peak.name != "training" and cfg.train.offload != "all":
        return (
            f"the actor's states stay on the device beside the engine (train.offload={cfg.train.offload}): set "
            "train.offload=all (or optimizer) and rollout.sleep_level=2, so that the actor and the engine take "
            "turns on the device, or lower rollout.gpu_memory_utilization"
        )
    if colocated and peak.name == "training" and not cfg.rollout.sleep_level:
        return (
            f"the engine keeps its {peak.engine / GIB:.1f} GiB while the actor trains (rollout.sleep_level=0): set "
            "rollout.sleep_level=2 (with train.offload=all) so that it releases them"
        )
    if colocated and peak.name != "training":
        return "lower rollout.gpu_memory_utilization or rollout.weight_bucket_mb"
    if colocated and not cfg.rollout.enforce_eager:
        from megatron_rl.plan.memory import ENGINE_CUDA_GRAPH_GIB

        return (
            f"the sleeping engine keeps its CUDA graphs (about {ENGINE_CUDA_GRAPH_GIB:.0f} GiB; vLLM's sleep mode does "
            "not release them): set rollout.enforce_eager=true, or spread the weights over more devices"
        )
    states = s.weights + s.grads + s.optimizer
    if states >= s.activations + s.logits + s.heap:
        return (
            "spread the weights over more devices (raise parallel.expert_parallel, pipeline_parallel or "
            "tensor_parallel), keep optimizer.use_distributed_optimizer=true, or add nodes"
        )
    if cfg.model.recompute != "full":
        better = "full" if cfg.model.recompute == "moe" else "moe (or full)"
        return f"set model.recompute={better}, or lower train.max_tokens_per_microbatch / micro_batch_size"
    return "lower train.max_tokens_per_microbatch or micro_batch_size, or raise tensor_parallel / context_parallel"


def _check_batch(cfg: RLConfig, spec: ModelSpec, dp: int) -> tuple[int, int, bool, list[str]]:
    """(sequences per optimizer step, microbatches per DP rank, packed?, warnings)."""
    train, rollout, warnings = cfg.train, cfg.rollout, []
    seq_len = rollout.max_prompt_tokens + rollout.max_new_tokens
    if spec.max_position_embeddings and seq_len > spec.max_position_embeddings:
        raise ConfigError(
            f"rollout.max_prompt_tokens + rollout.max_new_tokens = {rollout.max_prompt_tokens} + {rollout.max_new_tokens} "
            f"= {seq_len} exceeds the model's max_position_embeddings={spec.max_position_embeddings}"
        )
    if cfg.algorithm.overlong_buffer >= rollout.max_new_tokens:
        raise ConfigError(
            f"algorithm.overlong_buffer={cfg.algorithm.overlong_buffer} must be below rollout.max_new_tokens="
            f"{rollout.max_new_tokens}: the soft overlong punishment starts at max_new_tokens - overlong_buffer"
        )
    sequences = train.prompts_per_step * rollout.n_samples // train.mini_batches_per_step
    if sequences < dp:
        raise ConfigError(
            f"{train.prompts_per_step} prompts x {rollout.n_samples} samples / {train.mini_batches_per_step} mini-batches "
            f"= {sequences} sequences per optimizer step cannot feed {dp} data-parallel ranks: raise "
            "train.prompts_per_step or rollout.n_samples, lower train.mini_batches_per_step, or use fewer DP ranks"
        )
    if sequences % dp:
        warnings.append(f"{sequences} sequences per optimizer step do not split evenly over {dp} DP ranks")
    per_rank = -(-sequences // dp)
    cp = cfg.parallel.context_parallel
    if cp > 1 and not train.pack_sequences:
        raise ConfigError(
            f"parallel.context_parallel={cp} splits packed sequences over CP ranks: set train.pack_sequences=true"
        )
    packed = train.max_tokens_per_microbatch > 0
    if packed:
        multiple = (cfg.parallel.tensor_parallel if cfg.parallel.use_sequence_parallel() else 1) * (2 * cp if cp > 1 else 1)
        padded = -(-seq_len // multiple) * multiple if train.pack_sequences else seq_len
        if train.max_tokens_per_microbatch < padded:
            raise ConfigError(
                f"train.max_tokens_per_microbatch={train.max_tokens_per_microbatch} is below one full-length sequence "
                f"({rollout.max_prompt_tokens} + {rollout.max_new_tokens} = {seq_len} tokens, {padded} padded to a multiple "
                f"of {multiple}): raise it to at least {padded}"
            )
        microbatches = -(-per_rank * padded // train.max_tokens_per_microbatch)
    else:
        microbatches = -(-per_rank // train.micro_batch_size)
    return sequences, microbatches, packed, warnings


def _check_node_layout(cfg: RLConfig, spec: ModelSpec, launch: LaunchShape) -> list[str]:
    par, warnings = cfg.parallel, []
    tp, etp, ep = par.tensor_parallel, par.expert_tensor_parallel, par.expert_parallel
    if spec.is_moe and tp > 1 and not par.use_sequence_parallel():
        raise ConfigError(
            f"parallel.tensor_parallel={tp} on a MoE model needs sequence parallelism (megatron-core "
            "model_parallel_config.py: 'sequence parallelism must be used'): set parallel.sequence_parallel=true"
        )
    if cfg.cluster.gpus_per_node == 0:
        return warnings
    procs = launch.procs_per_node
    for name, size in (("tensor_parallel", tp), ("expert_tensor_parallel", etp)):
        if procs % size:
            raise ConfigError(
                f"parallel.{name}={size} does not divide the {procs} trainer processes per node: its groups would "
                f"straddle nodes (TP all-reduces every layer and needs NVLink); choose a divisor of {procs}"
            )
    if ep * etp > procs:
        warnings.append(f"expert parallel groups ({ep} x expert TP {etp}) span nodes: the MoE all-to-all crosses the network")
    return warnings


def _check_engine(cfg: RLConfig, spec: ModelSpec, world_gpus: int) -> tuple[int, EngineMemory | None, list[str]]:
    rollout, cluster, warnings = cfg.rollout, cfg.cluster, []
    etp, epp = rollout.tensor_parallel, rollout.pipeline_parallel
    if rollout.engine == "vllm_server" and cluster.rollout_gpus == 0:
        warnings.append("rollout.engine=vllm_server with no rollout GPUs in this cluster: engine memory not checked")
        return 0, None, warnings
    if cluster.gpus_per_node == 0:
        if etp * epp != 1:
            raise ConfigError(
                f"rollout.tensor_parallel={etp}, pipeline_parallel={epp}: the CPU engine runs in one process; set both to 1"
            )
    else:
        if cluster.gpus_per_node % etp:
            raise ConfigError(
                f"rollout.tensor_parallel={etp} does not divide gpus_per_node={cluster.gpus_per_node}: an engine's TP "
                "group stays inside a node; span nodes with rollout.pipeline_parallel instead"
            )
        if spec.num_attention_heads % etp:
            raise ConfigError(
                f"rollout.tensor_parallel={etp} does not divide the model's {spec.num_attention_heads} attention heads (vLLM needs it)"
            )
        if epp > spec.num_layers:
            raise ConfigError(f"rollout.pipeline_parallel={epp} exceeds the model's {spec.num_layers} layers")
        pool = cluster.rollout_gpus or world_gpus
        where = "cluster.rollout_gpus" if cluster.rollout_gpus else "GPUs of the cluster (engine colocated)"
        if pool % (etp * epp):
            raise ConfigError(
                f"{pool} {where} are not divisible by one engine's rollout.tensor_parallel x pipeline_parallel = "
                f"{etp} x {epp} = {etp * epp} GPUs"
            )
    if rollout.engine == "vllm_server":  # servers on the GPUs set aside (rollout_gpus > 0 here)
        engines = cluster.rollout_gpus // (etp * epp)
    else:  # as many as the trainer starts
        engines = colocated_engines(rollout, cluster, cluster.trainer_world_size)
        if engines == 1 and cluster.gpus_per_node and etp * epp > cluster.gpus_per_node and world_gpus > etp * epp:
            warnings.append(
                f"one colocated engine spans {etp * epp} GPUs over nodes (vLLM's multi-node executor): the other "
                f"{world_gpus - etp * epp} GPUs wait during generation; engines of one node each would use them all"
            )
    engine = engine_memory(spec, cfg)
    seq_len = rollout.max_prompt_tokens + rollout.max_new_tokens
    if engine.kv_tokens < seq_len:
        space = "rollout.kv_cache_gib" if cluster.gpus_per_node == 0 else "rollout.gpu_memory_utilization"
        raise ConfigError(
            f"the rollout engine's KV cache holds {engine.kv_tokens} tokens per engine (weights {engine.weights / GIB:.1f} GiB "
            f"of {engine.reserved / GIB:.1f} GiB per device), less than one {seq_len}-token sequence: raise {space}, "
            "rollout.tensor_parallel or pipeline_parallel"
        )
    if engine.kv_tokens < rollout.n_samples * seq_len:
        warnings.append(
            f"the engine's KV cache holds {engine.kv_tokens // seq_len} full-length sequences, fewer than one group of "
            f"{rollout.n_samples}: generation will be slow"
        )
    return engines, engine, warnings


def plan(cfg: RLConfig, spec: ModelSpec) -> Plan:
    """Check `cfg` against its cluster and `spec`; raise ConfigError for an impossible layout."""
    par = cfg.parallel
    launch = launch_shape(cfg)
    world = launch.world
    if world != cfg.cluster.trainer_world_size:  # the two must agree: the trainer reads the schema's number
        raise ConfigError(f"trainer world {world} differs from cluster.trainer_world_size {cfg.cluster.trainer_world_size}")
    dp = check_layout(par, world, spec.shape())
    sequences, microbatches, packed, warnings = _check_batch(cfg, spec, dp)
    if not packed:
        check_layout(par, world, spec.shape(), microbatches)  # now with the microbatches the pipeline must fill
    if packed and par.pipeline_parallel > 1 and microbatches < par.pipeline_parallel:
        warnings.append(
            f"at most {microbatches} microbatches per step with pipeline_parallel={par.pipeline_parallel}: the pipeline may not fill"
        )
    warnings += _check_node_layout(cfg, spec, launch)
    world_gpus = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    engines, engine, engine_warnings = _check_engine(cfg, spec, world_gpus)
    warnings += engine_warnings
    stage = worst_stage(spec, cfg, world, microbatches)
    return Plan(
        cfg=cfg,
        spec=spec,
        launch=launch,
        data_parallel=dp,
        expert_data_parallel=world // (par.expert_tensor_parallel * par.expert_parallel * par.pipeline_parallel),
        sequences_per_step=sequences,
        microbatches=microbatches,
        tokens_per_microbatch=tokens_per_microbatch(cfg),
        engines=engines,
        stage=stage,
        engine=engine,
        phases=phase_memory(stage, engine, cfg, spec.total_params() * precision_for(cfg).param),
        budget=device_budget(cfg, launch.procs_per_node),
        push=preset_push_times(cfg, spec.total_params(), precision_for(cfg).param, engines),
        warnings=warnings,
    )
