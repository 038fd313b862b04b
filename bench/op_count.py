"""Aten ops dispatched per layer per microbatch: a CPU proxy for the kernel launches and host work of a step.

On a GPU without CUDA graphs every aten op that is not a view is (at least) one
kernel launch and a few microseconds of host time, so the count per layer is a
machine-independent measure of launch overhead that a CPU can keep honest.

What runs (the trainer's calls on one gloo rank, a tiny Qwen3-MoE, packed THD
microbatches, GRPO with the entropy metric):

    share = actor.distribute(batch)             # rank 0's step -> this rank's rows
    share, _ = actor.prepare_batch(share)       # old-policy forward (no grad, records routes for drift)
    actor.train_step(share)                     # forward + backward + optimizer step

Each op is counted once by a `torch.utils._python_dispatch.TorchDispatchMode`
and attributed to a phase:

* forward: the innermost labelled region open when it dispatches (module hooks:
  attention = SelfAttention, router = TopKRouter (gating, top-k, aux losses, and
  the actor's routing hooks on it), experts = SequentialMLP / GroupedMLP,
  permutation = the MoE layer minus its router and experts (token dispatch,
  permute / unpermute, combine), layer_other = the rest of each transformer layer
  (norms, residual adds); logprobs = the output layer and the actor's logprob /
  entropy path; loss = the policy loss; optimizer = the optimizer step; batch =
  building the microbatches' input tensors; other = everything else (embedding,
  final norm, schedule, metrics);
* backward: the phase of the forward region that created the autograd node being
  run (`torch._C._current_autograd_node()` and its sequence number, recorded at
  every region boundary), so backward ops land where their forward ran. Every
  region megatron-core can recompute in backward (core attention, MoE layer,
  transformer layer) is a labelled module, so a recomputation marks its nodes too.

Per layer = (attention + router + permutation + experts + layer_other) /
(layers x microbatches); logprobs and loss per microbatch; optimizer and batch per
step. ``kernels`` counts non-view ops (what launches work on a GPU); ``ops`` all
of them; ``host_syncs`` the `aten::_local_scalar_dense` calls (`.item()`, `int()`).

Writes bench/results/op_count.json: ``--record before`` / ``--record after``
replace that entry (the code as it was, the code as it is). Run: python bench/op_count.py
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import platform
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results" / "op_count.json"

MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
LENGTHS = (40, 23, 57, 31, 64, 18, 45, 27)
PROMPT = 8
TOKENS_PER_MICROBATCH = 128
VARIANTS = {"recompute=moe": {"recompute": "moe"}, "recompute=full": {"recompute": "full"},
            "token_dispatcher=allgather": {"token_dispatcher": "allgather"}}
"""Settings measured beside the default (--variants): per-layer kernels of each."""
LAYER_PHASES = ("attention", "router", "permutation", "experts", "layer_other")
PHASES = (*LAYER_PHASES, "logprobs", "loss", "optimizer", "batch", "other")
NOT_KERNELS = {"scalar_tensor", "promote_types", "result_type", "empty", "empty_like", "empty_strided", "lift_fresh"}
"""Ops that launch no device work: a wrapped host scalar, dtype arithmetic, uninitialised allocations."""
VIEW_OPS = {"detach", "alias", "lift_fresh", "_unsafe_view", "view", "reshape", "expand", "t", "transpose",
            "permute", "unsqueeze", "squeeze", "select", "slice", "split", "split_with_sizes", "unbind",
            "as_strided", "chunk", "narrow", "view_as", "_reshape_alias", "unfold", "diagonal", "movedim",
            "flatten", "unflatten", "expand_as", "set_", "resize_"}


def _module_phase(name: str, module: torch.nn.Module) -> str | None:
    kind = type(module).__name__
    if kind in ("SelfAttention", "LocalCoreAttention", "DotProductAttention", "TEDotProductAttention"):
        return "attention"
    if kind in ("TopKRouter",):
        return "router"
    if kind in ("SequentialMLP", "GroupedMLP", "TEGroupedMLP"):
        return "experts"
    if kind in ("MoELayer",):
        return "permutation"
    if kind in ("TransformerLayer", "MoETransformerLayer"):
        return "layer_other"
    if name.endswith("output_layer"):
        return "logprobs"
    return None


class OpCounter(TorchDispatchMode):
    """Counts aten ops by phase (see the module docstring); `region(phase)` opens a labelled region."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.boundaries: list[int] = []  # autograd sequence numbers where a phase began
        self.boundary_phase: list[str] = []
        self.paused = False
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.names: dict[str, Counter] = defaultdict(Counter)

    # -- phase bookkeeping ------------------------------------------------------------------------

    def _next_sequence_nr(self) -> int:
        self.paused = True
        try:
            with torch.enable_grad():
                probe = torch.zeros((), requires_grad=True).mul(1.0)
            return probe.grad_fn._sequence_nr()
        finally:
            self.paused = False

    def _mark(self) -> None:
        """Nodes created from here on belong to the current innermost phase."""
        if torch._C._current_autograd_node() is not None and not self.stack:
            return
        self.boundaries.append(self._next_sequence_nr())
        self.boundary_phase.append(self.stack[-1] if self.stack else "other")

    def enter(self, phase: str) -> None:
        self.stack.append(phase)
        self._mark()

    def exit(self) -> None:
        if self.stack:
            self.stack.pop()
        self._mark()

    @contextlib.contextmanager
    def region(self, phase: str):
        self.enter(phase)
        try:
            yield
        finally:
            self.exit()

    def _phase_now(self) -> str:
        if self.stack:  # forward (or a recomputation in backward)
            return self.stack[-1]
        node = torch._C._current_autograd_node()
        if node is None or not self.boundaries or node.name().endswith("AccumulateGrad"):
            return "other"  # a parameter's gradient accumulation (DDP's main_grad hooks) is no layer phase
        index = bisect.bisect_right(self.boundaries, node._sequence_nr()) - 1
        return self.boundary_phase[index] if index >= 0 else "other"

    # -- counting ---------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            phase = self._phase_now()
            name = func._schema.name.removeprefix("aten::")
            launches = not (name in VIEW_OPS or name in NOT_KERNELS or func.is_view)
            self.counts[phase]["ops"] += 1
            self.counts[phase]["kernels"] += launches
            self.counts[phase]["host_syncs"] += name == "_local_scalar_dense"
            if launches:
                self.names[phase][name] += 1
        return func(*args, **(kwargs or {}))

    def take(self) -> tuple[dict, dict]:
        counts = {phase: dict(self.counts.get(phase, {"ops": 0, "kernels": 0, "host_syncs": 0})) for phase in PHASES}
        for phase in counts:
            for key in ("ops", "kernels", "host_syncs"):
                counts[phase].setdefault(key, 0)
        names = {phase: dict(self.names[phase].most_common(12)) for phase in PHASES if phase in self.names}
        self.counts.clear()
        self.names.clear()
        return counts, names


@contextlib.contextmanager
def labelled(actor, counter: OpCounter):
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


def _summary(counts: dict, names, layers: int, microbatches: int, *, train: bool) -> dict:
    """One side's figures: per layer and per microbatch, the loss and optimizer (training only), host syncs."""
    out = {"per_layer_per_microbatch": _per_layer(counts, layers, microbatches),
           "logprobs_per_microbatch": counts["logprobs"]["kernels"] / microbatches}
    if train:
        out["loss_per_microbatch"] = counts["loss"]["kernels"] / microbatches
        out["optimizer_per_step"] = counts["optimizer"]["kernels"]
    out["batch_per_microbatch"] = counts["batch"]["kernels"] / microbatches
    out["host_syncs_per_step" if train else "host_syncs_per_forward"] = sum(c["host_syncs"] for c in counts.values())
    return out | {"phases": counts, "top_ops": names}


def _per_layer(counts: dict, layers: int, microbatches: int) -> dict:
    out = {}
    for key in ("ops", "kernels", "host_syncs"):
        layer = sum(counts[p][key] for p in LAYER_PHASES)
        out[key] = layer / (layers * microbatches)
    out["by_phase"] = {p: counts[p]["kernels"] / (layers * microbatches) for p in LAYER_PHASES}
    return out


def measure(model_dir: str, **model_settings) -> dict:
    """Op counts of one old-policy forward and one train step of a tiny actor (this process, world 1);
    model_settings: ModelConfig fields (e.g. recompute="moe")."""
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(), shape=model_shape(load_hf_config(model_dir)))
    model_cfg = ModelConfig(path=model_dir, **model_settings)
    actor = Actor(ctx, model=model_cfg, optimizer=OptimizerConfig(lr=1e-3),
                  # old_logprobs=forward: the old-policy forward is one of the paths counted
                  train=TrainConfig(pack_sequences=True, max_tokens_per_microbatch=TOKENS_PER_MICROBATCH, old_logprobs="forward"),
                  algorithm=AlgorithmConfig(loss="grpo"))
    counter = OpCounter()
    result = {}
    try:
        batch = make_batch(actor.arch.vocab_size)
        share = actor.distribute(batch)
        share, _ = actor.prepare_batch(share)  # warm-up: lazy initialisation is not counted
        actor.train_step(share)
        layers = actor.arch.num_layers
        with labelled(actor, counter), counter:
            share, _ = actor.prepare_batch(share.replace(old_logprobs=None, old_routed_experts=None))
        forward, forward_names = counter.take()
        with labelled(actor, counter), counter:
            metrics = actor.train_step(share)
        train, train_names = counter.take()
        microbatches = int(metrics["microbatches_per_rank"])
        result = {"layers": layers, "microbatches": microbatches,
                  "train_step": _summary(train, train_names, layers, microbatches, train=True),
                  "old_policy_forward": _summary(forward, forward_names, layers, microbatches, train=False)}
    finally:
        actor.close()
        destroy_parallel(ctx)
    return result


def batch_scaling(sequences=(4, 32), length: int = 40) -> dict:
    """Kernels and scalar reads of building one packed microbatch's inputs (actor.step.microbatch_inputs,
    loss inputs included) for a microbatch of n sequences: host work per sequence shows as growth with n."""
    from megatron_rl.actor import TrainBatch
    from megatron_rl.actor.plan import Microbatch
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
        counter = OpCounter()
        with counter:
            microbatch_inputs(batch, mb, lengths, torch.device("cpu"), with_loss_inputs=True)
        counts, _ = counter.take()
        out[str(n)] = {key: sum(c[key] for c in counts.values()) for key in ("kernels", "host_syncs")}
    return out


def tiny_model(tmp: str) -> str:
    from megatron_rl.models.tiny import make_tiny_model_dir

    return str(make_tiny_model_dir(Path(tmp) / "moe", "qwen3_moe", seed=0, with_tokenizer=False, **MODEL))


def summary(result: dict) -> str:
    train, fwd = result["train_step"], result["old_policy_forward"]
    layer = train["per_layer_per_microbatch"]
    phases = ", ".join(f"{p} {v:.0f}" for p, v in layer["by_phase"].items())
    return (f"train: {layer['kernels']:.1f} kernels / layer / microbatch ({phases}); logprobs "
            f"{train['logprobs_per_microbatch']:.0f}, loss {train['loss_per_microbatch']:.0f} per microbatch; optimizer "
            f"{train['optimizer_per_step']}; batch {train['batch_per_microbatch']:.0f} per microbatch; host syncs "
            f"{train['host_syncs_per_step']} per step. old-policy forward: "
            f"{fwd['per_layer_per_microbatch']['kernels']:.1f} kernels / layer / microbatch, host syncs "
            f"{fwd['host_syncs_per_forward']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", choices=("before", "after"), default="after",
                        help="which entry of bench/results/op_count.json this run replaces")
    parser.add_argument("--variants", action="store_true", help=f"also measure {', '.join(VARIANTS)}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(tmp)
        result = measure(model_dir)
        result["batch_inputs_by_sequences_per_microbatch"] = batch_scaling()
        print(f"{args.record}: {summary(result)}; microbatch inputs by sequences: "
              f"{result['batch_inputs_by_sequences_per_microbatch']}", flush=True)
        if args.variants:
            result["variants"] = {}
            for name, settings in VARIANTS.items():
                variant = measure(model_dir, **settings)
                result["variants"][name] = {"train_per_layer_per_microbatch": variant["train_step"]["per_layer_per_microbatch"],
                                            "forward_per_layer_per_microbatch":
                                                variant["old_policy_forward"]["per_layer_per_microbatch"]}
                print(f"  {name}: {summary(variant)}", flush=True)
    previous = json.loads(OUT.read_text()) if OUT.exists() else {}
    out = {
        "what": "aten ops dispatched per transformer layer per microbatch (kernels = non-view ops) in the actor's "
                "packed train step and old-policy forward, by phase (bench/op_count.py docstring)",
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "model": MODEL,
        "batch": {"lengths": list(LENGTHS), "prompt": PROMPT, "tokens_per_microbatch": TOKENS_PER_MICROBATCH},
        "before": previous.get("before"),
        "after": previous.get("after"),
    }
    out[args.record] = result
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
