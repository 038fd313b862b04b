"""Aten ops, kernels, host syncs and bytes per layer per microbatch: a CPU count of a GPU step's launch overhead.

On a GPU without CUDA graphs every aten op that is not a view is (at least) one
kernel launch and a few microseconds of host time, so the count per layer is a
machine-independent measure of launch overhead that a CPU can keep honest.

What runs (the trainer's calls on one gloo rank, a tiny Qwen3-MoE, packed THD
microbatches, GRPO with the entropy metric):

    share = actor.distribute(batch)             # rank 0's step -> this rank's rows
    share, _ = actor.prepare_batch(share)       # old-policy forward (no grad, records routes for drift)
    actor.train_step(share)                     # forward + backward + optimizer step

with the kernels a GPU build picks (bench/op_count_emulation.py: grouped experts, the
flash varlen attention, torch's fused RMSNorm and Adam, run exactly on the CPU and
counted as the CUDA ops they stand for; what it cannot emulate is listed in the JSON),
and again with the CPU's own choices (``cpu_path``). Beside it, transformers' own
Qwen3-MoE layer on the same model and sequences as one padded batch
(bench/op_count_reference.py), and the ratio.

bench/op_counter.py counts each op once and attributes it to a phase:

* forward: the innermost labelled region open when it dispatches (module hooks:
  attention = SelfAttention, router = the MoE router (gating, top-k, aux losses, and
  the actor's routing hooks on it), experts = SequentialMLP / GroupedMLP,
  permutation = the MoE layer minus its router and experts (token dispatch,
  permute / unpermute, combine), layer_other = the rest of each transformer layer
  (norms, residual adds); logprobs = the output layer and the actor's logprob /
  entropy path; loss = the policy loss; optimizer = the optimizer step; batch =
  building the microbatches' input tensors; other = everything else (embedding,
  final norm, schedule, metrics);
* backward: the phase of the forward region that created the autograd node being run.

Per layer = (attention + router + permutation + experts + layer_other) /
(layers x microbatches); logprobs and loss per microbatch; optimizer and batch per
step. ``kernels`` counts ops that launch device work; ``host_syncs`` the ops that make
the host wait for a GPU (a scalar read, a data-sized output); ``bytes`` the tensors each
kernel reads and writes. The permutation's minimum: every token's top-k copies of its
hidden state, tokens x top-k x hidden x element size, moved each way (to the experts and
back) in the forward and again in the backward.

Writes bench/results/op_count.json: ``--record before`` / ``--record after``
replace that entry (the code as it was, the code as it is); the transformers column is
measured by every run. Run: python bench/op_count.py [--variants]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "op_count.json"

from bench.op_counter import OpCounter  # noqa: E402  (after the repository joins the path)

MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
LENGTHS = (40, 23, 57, 31, 64, 18, 45, 27)
PROMPT = 8
TOKENS_PER_MICROBATCH = 128
VARIANTS = {"recompute=moe": {"recompute": "moe"}, "recompute=full": {"recompute": "full"},
            "token_dispatcher=allgather": {"token_dispatcher": "allgather"}}
"""Settings measured beside the default (--variants): per-layer kernels of each."""
SHAPE_VARIANTS = {"num_experts=16,num_experts_per_tok=8": {"num_experts": 16, "num_experts_per_tok": 8}}
"""Model shapes measured beside MODEL (--variants): top-k 8, as Qwen3-MoE's own routing. A gather to the experts reads
the T x hidden token tensor and writes its k copies; the combine writes, reads and rewrites the T x hidden output
while it reads the copies; their gradients do the same: the bytes over the minimum (the copies) fall as 1 + 2 / k."""
LAYER_PHASES = ("attention", "router", "permutation", "experts", "layer_other")
PHASES = (*LAYER_PHASES, "logprobs", "loss", "optimizer", "batch", "other")
TARGET_FRACTION_OF_BEFORE, TARGET_PERMUTATION_BYTES = 0.6, 1.5
"""Targets of the counts: kernels per layer at most 0.6 x the code before and at most transformers' own; no host
sync in a layer; the permutation's bytes at most 1.5 x its minimum."""


def _module_phase(name: str, module: torch.nn.Module) -> str | None:
    kind = type(module).__name__
    if kind in ("SelfAttention", "PackedSelfAttention", "LocalCoreAttention", "DotProductAttention", "TEDotProductAttention"):
        return "attention"
    if kind.endswith("Router"):
        return "router"
    if kind in ("SequentialMLP", "GroupedMLP", "TEGroupedMLP"):
        return "experts"
    if kind.endswith("MoELayer"):
        return "permutation"
    if kind in ("TransformerLayer", "MoETransformerLayer"):
        return "layer_other"
    if name.endswith("output_layer"):
        return "logprobs"
    return None


class RoutedCopies:
    """The permutation's minimum bytes: per MoE forward, tokens x top-k x hidden x element size each way, twice
    (dispatch and combine), twice more for their gradients when the forward builds a graph outside backward."""

    def __init__(self) -> None:
        self.bytes = 0

    def hook(self, module, args) -> None:
        hidden = args[0]
        copies = hidden.numel() * module.config.moe_router_topk * hidden.element_size()
        backward = torch.is_grad_enabled() and torch._C._current_autograd_node() is None
        self.bytes += copies * (4 if backward else 2)


@contextlib.contextmanager
def labelled(actor, counter: OpCounter, routed: RoutedCopies | None = None):
    """Module hooks and wrappers that open the phases' regions while `actor` runs."""
    import megatron_rl.actor.step as step_module

    handles = []
    for chunk in actor.model:
        for name, module in chunk.named_modules():
            phase = _module_phase(name, module)
            if phase is None:
                continue
            handles.append(module.register_forward_pre_hook(lambda m, a, p=phase: counter.enter(p)))
            handles.append(module.register_forward_hook(lambda m, a, o: counter.exit()))
            if phase == "permutation" and routed is not None:
                handles.append(module.register_forward_pre_hook(routed.hook))

    def wrap(fn, phase):
        def wrapped(*args, **kwargs):
            with counter.region(phase):
                return fn(*args, **kwargs)
        return wrapped

    saved = (actor.loss_fn, actor.optimizer.step, actor._inputs)
    actor.loss_fn = wrap(actor.loss_fn, "loss")
    actor.optimizer.step = wrap(actor.optimizer.step, "optimizer")
    actor._inputs = wrap(actor._inputs, "batch")
    try:
        with mock.patch.object(step_module, "logprobs_of", wrap(step_module.logprobs_of, "logprobs")):
            yield
    finally:
        actor.loss_fn, actor.optimizer.step, actor._inputs = saved
        for handle in handles:
            handle.remove()


def make_batch(vocab: int):
    from megatron_rl.actor import TrainBatch

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(LENGTHS)
    width = int(lengths.max())
    positions = torch.arange(width)
    mask = (positions[None] >= PROMPT) & (positions[None] < lengths[:, None])
    return TrainBatch(
        tokens=torch.randint(0, vocab, (len(LENGTHS), width), generator=g),
        response_mask=mask,
        advantages=torch.randn(len(LENGTHS), generator=g),
        prompt_lengths=torch.full((len(LENGTHS),), PROMPT),
        sequence_lengths=lengths,
        rollout_logprobs=torch.where(mask, -torch.rand(len(LENGTHS), width, generator=g), 0.0),
    )


def per_layer(counts: dict, layers: int, microbatches: int) -> dict:
    """Per layer per microbatch: ops, kernels, host syncs and bytes of the layer phases, and kernels / bytes by phase."""
    out = {key: sum(counts[p][key] for p in LAYER_PHASES) / (layers * microbatches)
           for key in ("ops", "kernels", "host_syncs", "bytes")}
    out["by_phase"] = {p: counts[p]["kernels"] / (layers * microbatches) for p in LAYER_PHASES}
    out["host_syncs_by_phase"] = {p: counts[p]["host_syncs"] / (layers * microbatches) for p in LAYER_PHASES}
    out["bytes_by_phase"] = {p: counts[p]["bytes"] / (layers * microbatches) for p in LAYER_PHASES}
    return out


def _summary(counts: dict, names: dict, layers: int, microbatches: int, *, train: bool, routed_bytes: int) -> dict:
    """One side's figures: per layer and per microbatch, the loss and optimizer (training only), host syncs, and the
    permutation's bytes against its minimum."""
    out = {"per_layer_per_microbatch": per_layer(counts, layers, microbatches),
           "logprobs_per_microbatch": counts["logprobs"]["kernels"] / microbatches}
    if train:
        out["loss_per_microbatch"] = counts["loss"]["kernels"] / microbatches
        out["optimizer_per_step"] = counts["optimizer"]["kernels"]
    out["batch_per_microbatch"] = counts["batch"]["kernels"] / microbatches
    out["host_syncs_per_step" if train else "host_syncs_per_forward"] = sum(c["host_syncs"] for c in counts.values())
    if routed_bytes:
        measured, index = counts["permutation"]["bytes"], counts["permutation"]["index_bytes"]
        out["permutation_bytes"] = {"measured": measured, "of_which_indices": index, "minimum": routed_bytes,
                                    "ratio": measured / routed_bytes, "ratio_without_indices": (measured - index) / routed_bytes}
    return out | {"phases": counts, "top_ops": names}


def measure(model_dir: str, *, gpu_kernels: bool = True, **model_settings) -> dict:
    """Op counts of one old-policy forward and one train step of a tiny actor (this process, world 1), with the
    kernels a GPU picks (bench/op_count_emulation.py) or the CPU's own; model_settings: ModelConfig fields."""
    from bench.op_count_emulation import cuda_kernels_on_cpu

    emulation = cuda_kernels_on_cpu() if gpu_kernels else contextlib.nullcontext()
    if gpu_kernels:
        model_settings.setdefault("moe_grouped_gemm", True)
    with emulation:
        return _measure(model_dir, gpu_kernels, model_settings)


def _measure(model_dir: str, gpu_kernels: bool, model_settings: dict) -> dict:
    from bench.op_count_emulation import gpu_kernel_choices
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(), shape=model_shape(load_hf_config(model_dir)))
    actor = Actor(ctx, model=ModelConfig(path=model_dir, **model_settings), optimizer=OptimizerConfig(lr=1e-3),
                  # old_logprobs=forward: the old-policy forward is one of the paths counted
                  train=TrainConfig(pack_sequences=True, max_tokens_per_microbatch=TOKENS_PER_MICROBATCH, old_logprobs="forward"),
                  algorithm=AlgorithmConfig(loss="grpo"))
    counter = OpCounter(PHASES)
    try:
        if gpu_kernels:
            gpu_kernel_choices(actor)
        batch = make_batch(actor.arch.vocab_size)
        share = actor.distribute(batch)
        share, _ = actor.prepare_batch(share)  # warm-up: lazy initialisation is not counted
        actor.train_step(share)
        layers = actor.arch.num_layers
        routed_forward, routed_train = RoutedCopies(), RoutedCopies()
        with labelled(actor, counter, routed_forward), counter:
            share, _ = actor.prepare_batch(share.replace(old_logprobs=None, old_routed_experts=None))
        forward, forward_names = counter.take()
        with labelled(actor, counter, routed_train), counter:
            metrics = actor.train_step(share)
        train, train_names = counter.take()
        microbatches = int(metrics["microbatches_per_rank"])
        return {"layers": layers, "microbatches": microbatches,
                "train_step": _summary(train, train_names, layers, microbatches, train=True, routed_bytes=routed_train.bytes),
                "old_policy_forward": _summary(forward, forward_names, layers, microbatches, train=False,
                                               routed_bytes=routed_forward.bytes)}
    finally:
        actor.close()
        destroy_parallel(ctx)


def batch_scaling(sequences=(4, 32), length: int = 40) -> dict:
    """Kernels, host syncs and scalar reads (.item(), int()) of building one packed microbatch's inputs
    (actor.step.microbatch_inputs, loss inputs included; on the host in a GPU run, then copied) for a microbatch of
    n sequences: host work per sequence shows as growth with n."""
    from megatron_rl.actor import TrainBatch
    from megatron_rl.actor.microbatches import Microbatch
    from megatron_rl.actor.step import microbatch_inputs

    out = {}
    for n in sequences:
        g = torch.Generator().manual_seed(n)
        lengths = torch.full((n,), length) - torch.randint(0, length // 2, (n,), generator=g)
        positions = torch.arange(length)
        mask = (positions[None] >= PROMPT) & (positions[None] < lengths[:, None])
        batch = TrainBatch(tokens=torch.randint(0, 256, (n, length), generator=g), response_mask=mask,
                           advantages=torch.randn(n, generator=g), sequence_lengths=lengths,
                           old_logprobs=-torch.rand(n, length, generator=g), rollout_logprobs=-torch.rand(n, length, generator=g))
        mb = Microbatch(tuple(range(n)), int(lengths.sum()), packed=True)
        counter = OpCounter(PHASES)
        with counter:
            microbatch_inputs(batch, mb, lengths, torch.device("cpu"), with_loss_inputs=True)
        counts, names = counter.take()
        out[str(n)] = {key: sum(c[key] for c in counts.values()) for key in ("kernels", "host_syncs")}
        out[str(n)]["scalar_reads"] = sum(s.get("_local_scalar_dense", 0) for s in names["host_syncs"].values())
    return out


def tiny_model(tmp: str, **shape) -> str:
    """The tiny Qwen3-MoE (MODEL, `shape` replacing its keys) written under `tmp`."""
    from megatron_rl.models.tiny import make_tiny_model_dir

    name = "moe" + "".join(f"-{k}{v}" for k, v in sorted(shape.items()))
    return str(make_tiny_model_dir(Path(tmp) / name, "qwen3_moe", seed=0, with_tokenizer=False, **(MODEL | shape)))


def summary(result: dict) -> str:
    train, fwd = result["train_step"], result["old_policy_forward"]
    layer = train["per_layer_per_microbatch"]
    phases = ", ".join(f"{p} {v:.0f}" for p, v in layer["by_phase"].items())
    permutation = train.get("permutation_bytes", {})
    return (f"train: {layer['kernels']:.1f} kernels / layer / microbatch ({phases}), host syncs {layer['host_syncs']:.1f}, "
            f"permutation bytes {permutation.get('ratio', float('nan')):.2f} x minimum; logprobs "
            f"{train['logprobs_per_microbatch']:.0f}, loss {train['loss_per_microbatch']:.0f} per microbatch; optimizer "
            f"{train['optimizer_per_step']}; batch {train['batch_per_microbatch']:.0f} per microbatch; host syncs "
            f"{train['host_syncs_per_step']} per step. old-policy forward: "
            f"{fwd['per_layer_per_microbatch']['kernels']:.1f} kernels / layer / microbatch, host syncs "
            f"{fwd['host_syncs_per_forward']}")


def transformers_column(model_dir: str) -> dict:
    """transformers' own layer on the same model and sequences (bench/op_count_reference.py)."""
    from bench.op_count_reference import count_transformers

    return count_transformers(model_dir, LENGTHS, lambda: OpCounter(PHASES), per_layer)


def targets(before: dict | None, after: dict, reference: dict) -> dict:
    """The count's targets (TARGET_*), each with the figures it compares."""
    ours = after["train_step"]["per_layer_per_microbatch"]
    theirs = reference["train_step"]["kernels"]
    out = {"kernels_vs_transformers": {"after": ours["kernels"], "transformers": theirs, "ratio": ours["kernels"] / theirs,
                                       "met": ours["kernels"] <= theirs},
           "host_syncs_per_layer": {"after": ours["host_syncs"], "met": ours["host_syncs"] == 0}}
    ratio = after["train_step"].get("permutation_bytes", {}).get("ratio")
    out["permutation_bytes"] = {"ratio": ratio, "target": TARGET_PERMUTATION_BYTES,
                                "met": ratio is not None and ratio <= TARGET_PERMUTATION_BYTES}
    if before:
        old = before["train_step"]["per_layer_per_microbatch"]["kernels"]
        out["kernels_vs_before"] = {"before": old, "after": ours["kernels"], "ratio": ours["kernels"] / old,
                                    "target": TARGET_FRACTION_OF_BEFORE, "met": ours["kernels"] <= TARGET_FRACTION_OF_BEFORE * old}
    return out


def compile_recompilations(model_dir: str) -> dict:
    """model.compile_regions=true: the compilations torch.compile made over the old-policy forwards and train steps of
    microbatches of different sizes (dynamic shapes: once per grad mode, not once per microbatch). Its kernels are
    not counted: the CPU's compiled kernels are no aten ops (a GPU measures them)."""
    from torch._dynamo.utils import counters

    before = dict(counters["frames"])
    result = measure(model_dir, compile_regions=True)
    compiled = {key: value - before.get(key, 0) for key, value in counters["frames"].items()}
    return {"compilations": compiled.get("ok", 0), "frames": compiled, "microbatches_per_step": result["microbatches"],
            "steps": 2, "old_policy_forwards": 2}


def main() -> None:
    from bench.op_count_emulation import EMULATED, NOT_EMULATED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", choices=("before", "after"), default="after",
                        help="which entry of bench/results/op_count.json this run replaces")
    parser.add_argument("--variants", action="store_true", help=f"also measure {', '.join(VARIANTS)}")
    parser.add_argument("--compile", action="store_true", help="also count model.compile_regions' recompilations "
                        "(minutes: a C++ compiler builds the regions on CPU)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(tmp)
        result = measure(model_dir)
        result["cpu_path"] = measure(model_dir, gpu_kernels=False)["train_step"]["per_layer_per_microbatch"]
        result["batch_inputs_by_sequences_per_microbatch"] = batch_scaling()
        print(f"{args.record}: {summary(result)}; CPU's own kernels: {result['cpu_path']['kernels']:.1f} / layer / "
              f"microbatch; microbatch inputs by sequences: {result['batch_inputs_by_sequences_per_microbatch']}", flush=True)
        reference = transformers_column(model_dir)
        print(f"transformers: train {reference['train_step']['kernels']:.1f} kernels / layer "
              f"({', '.join(f'{p} {v:.0f}' for p, v in reference['train_step']['by_phase'].items())}), host syncs "
              f"{reference['train_step']['host_syncs']:.1f}; forward {reference['forward']['kernels']:.1f}", flush=True)
        if args.variants:
            result["variants"] = {}
            for name, settings in VARIANTS.items():
                variant = measure(model_dir, **settings)
                result["variants"][name] = {"train_per_layer_per_microbatch": variant["train_step"]["per_layer_per_microbatch"],
                                            "forward_per_layer_per_microbatch":
                                                variant["old_policy_forward"]["per_layer_per_microbatch"]}
                print(f"  {name}: {summary(variant)}", flush=True)
            for name, shape in SHAPE_VARIANTS.items():
                variant = measure(tiny_model(tmp, **shape))["train_step"]
                result["variants"][name] = {"train_per_layer_per_microbatch": variant["per_layer_per_microbatch"],
                                            "permutation_bytes": variant["permutation_bytes"]}
                print(f"  {name}: {variant['per_layer_per_microbatch']['kernels']:.1f} kernels / layer / microbatch, "
                      f"permutation bytes {variant['permutation_bytes']['ratio']:.2f} x minimum", flush=True)
        if args.compile:
            result["compile_regions"] = compile_recompilations(model_dir)
            print(f"  compile_regions=true: {result['compile_regions']}", flush=True)
    previous = json.loads(OUT.read_text()) if OUT.exists() else {}
    out = {
        "what": "per transformer layer per microbatch, by phase: aten ops, kernels (ops that launch device work), host "
                "syncs and the bytes kernels read and write, in the actor's packed train step and old-policy forward "
                "with the kernels a GPU picks, beside transformers' own layer (bench/op_count.py docstring)",
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "model": MODEL,
        "batch": {"lengths": list(LENGTHS), "prompt": PROMPT, "tokens_per_microbatch": TOKENS_PER_MICROBATCH},
        "gpu_kernels_emulated": list(EMULATED), "not_emulated": list(NOT_EMULATED),
        "before": previous.get("before"),
        "after": previous.get("after"),
    }
    out[args.record] = result
    out["transformers"] = reference
    if out["after"]:
        out["targets"] = targets(out["before"], out["after"], reference)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
