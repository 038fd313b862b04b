"""`megatron-rl plan`: load a preset, plan it, print the tables and the verdict."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_rl.config.core import ConfigError, load_config
from megatron_rl.config.layout import check_layout
from megatron_rl.config.schema import RLConfig, old_logprobs_source
from megatron_rl.plan.launch import launch_shape
from megatron_rl.plan.memory import GIB
from megatron_rl.plan.model_spec import ModelSpec, read_hf_config, spec_from_hf_config
from megatron_rl.plan.planner import Plan, plan


def load_spec(cfg: RLConfig, model_config: str | None = None) -> ModelSpec:
    """The ModelSpec of cfg.model.path (or of an explicit config.json file)."""
    if model_config:
        path = Path(model_config)
        if not path.is_file():
            raise ConfigError(f"--model-config {model_config!r} is not a file: pass the model's config.json (a file), or "
                              "leave --model-config out to read <model.path>/config.json")
        try:
            return spec_from_hf_config(json.loads(path.read_text()), str(path))
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON: {err}; pass the model's own config.json") from None
    hf_config = read_hf_config(cfg.model.path, cfg.model.make_tiny_if_missing)
    return spec_from_hf_config(hf_config, f"{cfg.model.path}/config.json")


def plan_preset(config_path: str, overrides: list[str] | None = None, model_config: str | None = None) -> Plan:
    """Preset file + overrides -> Plan (ConfigError for an impossible layout)."""
    from megatron_rl.config.core import replace
    from megatron_rl.models.tiny import preset_model_path, tiny_family_to_build

    cfg = load_config(RLConfig, config_path, overrides)
    if cfg.model.make_tiny_if_missing and not tiny_family_to_build(cfg.model, preset_model_path(config_path)):
        cfg = replace(cfg, model=replace(cfg.model, make_tiny_if_missing=""))  # a typed model.path: no tiny stand-in
    return plan(cfg, load_spec(cfg, model_config))


def require_fit(cfg: RLConfig) -> Plan | None:
    """What a GPU launch asks before it starts a process: ConfigError with the verdict when `cfg` does not fit
    its devices (or its layout is impossible). None, with a line on stderr, when the model's config.json cannot
    be read here; None on CPU clusters (tiny runs, the memory is the machine's) once the parallel sizes divide the
    trainer processes (an impossible layout would otherwise end the ranks only after they started)."""
    if cfg.cluster.gpus_per_node == 0:
        check_layout(cfg.parallel, launch_shape(cfg).world)
        return None
    try:
        spec = load_spec(cfg)
    except ConfigError as err:
        print(f"megatron-rl: memory not planned before the launch: {err}", file=sys.stderr)
        return None
    result = plan(cfg, spec)
    if not result.fits:
        raise ConfigError(f"{result.verdict()} (`megatron-rl plan --config ...` prints every phase)")
    return result


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def _billions(value: float) -> str:
    return f"{value / 1e9:.3f} B" if value >= 1e8 else f"{value / 1e6:.3f} M"


def _phase_table(p: Plan):
    """Per-phase bytes on the worst device (plan.memory.phase_memory) against what it has."""
    from rich.table import Table

    cfg = p.cfg
    title = f"Per phase: train.offload={cfg.train.offload}, rollout.sleep_level={cfg.rollout.sleep_level}"
    table = Table(title=title)
    for column in ("phase", "actor", "engine", "push buckets", "total GiB"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    for phase in p.phases:
        mark = " (peak)" if phase is p.peak else ""
        table.add_row(phase.name + mark, _gib(phase.actor), _gib(phase.engine), _gib(phase.push_buffers), _gib(phase.total))
    table.add_row("device", "", "", "", _gib(p.budget), end_section=True)
    return table


def _push_table(p: Plan):
    """Weight-push time per step for each transport (plan.push_time)."""
    from rich.table import Table

    cluster = p.cfg.cluster
    table = Table(title=f"Weight push per step at {cluster.push_link_gb_per_s:g} GB/s per link (cluster.push_link_gb_per_s)")
    for column in ("transport", "GB out of the busiest trainer rank", "GB into each engine worker", "seconds"):
        table.add_column(column, justify="left" if column == "transport" else "right")
    for row in p.push:
        table.add_row(row.transport, f"{row.out_bytes / 1e9:.2f}", f"{row.in_bytes / 1e9:.2f}", f"{row.seconds:.3g}")
    return table


def render(p: Plan, console=None) -> None:
    """Print the plan as rich tables followed by warnings and the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cfg, spec, par, cluster = p.cfg, p.spec, p.cfg.parallel, p.cfg.cluster
    device = f"{cluster.gpu_name} ({cluster.gpu_memory_gib:g} GiB)" if cluster.gpus_per_node else "CPU process"

    model = Table(title=f"Model: {spec.model_type} ({cfg.model.path})", show_header=False)
    model.add_row("parameters (total / active)", f"{_billions(spec.total_params())} / {_billions(spec.active_params())}")
    model.add_row(
        "layers / hidden / heads (kv)", f"{spec.num_layers} / {spec.hidden_size} / {spec.num_attention_heads} ({spec.num_kv_heads})"
    )
    if spec.is_moe:
        model.add_row("experts (top-k) / MoE layers", f"{spec.num_experts} (top-{spec.experts_per_token}) / {spec.num_moe_layers}")
    console.print(model)

    layout = Table(title="Layout", show_header=False)
    gpus = f"{cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu_name}" if cluster.gpus_per_node else "CPU"
    layout.add_row("cluster", f"{gpus}, {cluster.rollout_gpus} set aside for rollout")
    layout.add_row("trainer processes", f"{p.launch.nodes} node(s) x {p.launch.procs_per_node} = {p.launch.world}")
    layout.add_row(
        "TP x PP x CP x DP",
        f"{par.tensor_parallel} x {par.pipeline_parallel} x {par.context_parallel} x {p.data_parallel}"
        + (" (sequence parallel)" if par.use_sequence_parallel() else ""),
    )
    if spec.is_moe:
        layout.add_row(
            "expert TP x EP x expert-DP",
            f"{par.expert_tensor_parallel} x {par.expert_parallel} x {p.expert_data_parallel} "
            f"({spec.num_experts // par.expert_parallel} experts/rank)",
        )
    layout.add_row("sequences per optimizer step", f"{p.sequences_per_step} ({cfg.train.mini_batches_per_step} step(s) per RL step)")
    layout.add_row("microbatches per DP rank", f"{p.microbatches} x {p.tokens_per_microbatch} tokens")
    layout.add_row("old-policy logprobs", old_logprobs_source(cfg.train, cfg.algorithm)[1])
    if p.engine is not None:
        layout.add_row(
            "rollout engines",
            f"{p.engines} x (TP {cfg.rollout.tensor_parallel} x PP {cfg.rollout.pipeline_parallel}), KV cache "
            f"{p.engine.kv_tokens} tokens each",
        )
    console.print(layout)

    s = p.stage
    memory = Table(title=f"Memory per {device}, pipeline stage {s.stage} (the largest)")
    memory.add_column("item")
    memory.add_column("GiB", justify="right")
    memory.add_column("how")
    memory.add_row("parameters", "", f"{_billions(s.dense_params)} dense + {_billions(s.expert_params)} expert on this device")
    memory.add_row("weights", _gib(s.weights), "model dtype")
    memory.add_row("gradients", _gib(s.grads), "fp32 gradient buffer")
    sharded = "sharded over DP / expert-DP" if cfg.optimizer.use_distributed_optimizer else "not sharded"
    memory.add_row("optimizer state", _gib(s.optimizer), f"{cfg.optimizer.name}: fp32 main copy + moments, {sharded}")
    cpu = not cluster.gpus_per_node
    memory.add_row("activations", _gib(s.activations), f"model.recompute={cfg.model.recompute}, Korthikanti et al. 2022 "
                   "per-layer count" + (" (recounted for the CPU's unfused layers)" if cpu else ""))
    memory.add_row("logits", _gib(s.logits), "last stage: 2 float32 copies of the logits + the output layer's weight "
                   "gradient" if cpu else "last stage: vocab-parallel logits + grad + log-softmax")
    if s.heap:
        memory.add_row("heap kept", _gib(s.heap), "freed by the step but kept by the allocator, resident after it too "
                       "(plan.memory.CPU_HEAP_KEPT_FRACTION of the activations)")
    if s.reference:
        memory.add_row("reference model", _gib(s.reference), "algorithm.beta > 0")
    memory.add_row("batch share", _gib(s.batch_share), "this DP rank's rows: logprobs + the routes its routers replay or "
                   "record (their tokens and layers)")
    memory.add_row("trainer total", _gib(s.total), "while training")
    console.print(memory)
    console.print(_phase_table(p))
    console.print(_push_table(p))
    if p.engine is not None and cluster.rollout_gpus:
        console.print(
            f"rollout GPUs: engine weights {_gib(p.engine.weights)} GiB of {_gib(p.engine.reserved)} GiB reserved per GPU"
        )
    for warning in p.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    style = "green" if p.fits else "red"
    console.print(f"[bold {style}]{p.verdict()}[/bold {style}]")
