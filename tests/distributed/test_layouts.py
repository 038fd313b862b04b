"""Layout invariance: every TP/PP/EP/DP layout trains the tiny MoE exactly like the single-rank model.

One checkpoint (the tiny Qwen3-MoE's HF safetensors) is loaded into each
layout; one training step (next-token cross-entropy from vocab-parallel
logits through megatron's pipeline schedule, MoE aux loss and z-loss on, Adam
in megatron's distributed optimizer) must give the single-rank loss and
gradient norm within 1e-5 relative, and the parameters after the step (the HF
tensors exported from each layout) must move as the single-rank ones do: the
difference of the updates, relative to the update, within 1e-5. The
single-rank loss itself is checked against transformers.

Adam's first step is lr * g / (|g| + eps): with eps = 1e-8 every element whose
gradient is rounding noise moves by a full +-lr, so layouts that round
differently (measured: 1e-7 relative in loss and grad norm) differ by 1e-5 in
the update. eps = 1e-4 keeps the step a smooth function of the gradient, and
the update then agrees to 1e-6.

Microbatches are one sequence each in every layout, so the per-microbatch MoE
aux loss sees the same tokens everywhere: 4 sequences = 4 microbatches on one
rank (and on PP2), 2 per rank on DP2.

One launch per world size (1, 2, 4); each re-initialises megatron's parallel
state per layout inside the same processes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.distributed.harness import run_distributed

NUM_SEQS, SEQ = 4, 32
LR = 1e-2
ADAM_EPS = 1e-4
DISPATCHERS = ("alltoall", "allgather")

WORLD2 = {
    "TP2": {"tensor_parallel": 2, "expert_tensor_parallel": 2},  # without EP, expert TP must equal TP
    "PP2": {"pipeline_parallel": 2},
    "EP2": {"expert_parallel": 2},
    "DP2": {},
}
WORLD4 = {
    "TP2xEP2": {"tensor_parallel": 2, "expert_parallel": 2},
    "PP2xTP2": {"pipeline_parallel": 2, "tensor_parallel": 2, "expert_tensor_parallel": 2},
    "PP2xEP2": {"pipeline_parallel": 2, "expert_parallel": 2},
    "TP2xPP2xEP2": {"tensor_parallel": 2, "pipeline_parallel": 2, "expert_parallel": 2, "expert_tensor_parallel": 1},
}


def cases(layouts: dict) -> list[tuple[str, dict, str]]:
    """(name, layout, dispatcher): both dispatchers where tokens cross ranks (TP or EP > 1), else one."""
    out = []
    for name, layout in layouts.items():
        crosses = layout.get("tensor_parallel", 1) > 1 or layout.get("expert_parallel", 1) > 1
        for dispatcher in DISPATCHERS if crosses else DISPATCHERS[:1]:
            out.append((name, layout, dispatcher))
    return out


def batch() -> torch.Tensor:
    """The global batch: [NUM_SEQS, SEQ + 1] token ids (inputs are [:, :-1], labels [:, 1:])."""
    return torch.randint(0, 256, (NUM_SEQS, SEQ + 1), generator=torch.Generator().manual_seed(11))


def train_step(chunks, ctx, optimizer, tokens: torch.Tensor) -> tuple[float | None, float]:
    """One optimizer step over this DP rank's sequences; (mean loss on the last stage, grad norm)."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mine = tokens.chunk(ctx.dp_size)[ctx.dp_rank]
    microbatches = [mine[i : i + 1] for i in range(mine.shape[0])]
    positions = torch.arange(SEQ).unsqueeze(0)

    def forward_step(data_iterator, model):
        sequence = next(data_iterator)
        inputs, labels = sequence[:, :-1], sequence[:, 1:]
        logits = model(inputs, positions, attention_mask=None)  # [1, SEQ, V / TP]

        def loss_func(output_tensor):
            per_token = tensor_parallel.vocab_parallel_cross_entropy(
                output_tensor.transpose(0, 1).contiguous().float(), labels.transpose(0, 1).contiguous()
            )
            loss = per_token.mean()
            return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

        return logits, loss_func

    for chunk in chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reduced = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=chunks,
        num_microbatches=len(microbatches),
        seq_length=SEQ,
        micro_batch_size=1,
        forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    assert ok, "optimizer step skipped"
    loss = None
    if ctx.is_pipeline_last_stage():
        local = torch.stack([r["loss"] for r in reduced]).mean()
        dist.all_reduce(local, group=ctx.dp_group)
        loss = local.item() / ctx.dp_size
    return loss, float(grad_norm)


def _run_layouts(rank: int, world_size: int, model_dir: str, layout_cases: list) -> list[dict]:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models import build_model, export_hf_state_dict, load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    shape = model_shape(load_hf_config(model_dir))
    results = []
    for name, layout, dispatcher in layout_cases:
        dp = world_size // (layout.get("tensor_parallel", 1) * layout.get("pipeline_parallel", 1))
        ctx = init_parallel(ParallelConfig(**layout), shape=shape, num_microbatches=NUM_SEQS // dp)
        try:
            model_cfg = ModelConfig(path=model_dir, token_dispatcher=dispatcher, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
            chunks = build_model(model_cfg, ctx, wrap_ddp=True, use_distributed_optimizer=True)
            optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=LR, adam_eps=ADAM_EPS, weight_decay=0.0, clip_grad=1e9, use_distributed_optimizer=True
                ),
                chunks,
                use_gloo_process_groups=False,
            )
            loss, grad_norm = train_step(chunks, ctx, optimizer, batch())
            params = export_hf_state_dict(chunks, ctx)
            is_reporter = ctx.is_pipeline_last_stage() and ctx.tp_rank == 0 and ctx.dp_rank == 0
            results.append({"case": (name, dispatcher), "loss": loss if is_reporter else None, "grad_norm": grad_norm, "params": params or None})
        finally:
            destroy_parallel(ctx, keep_world=True)
    return results


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megatron_rl.models.tiny import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("layouts") / "tiny_moe", "qwen3_moe", seed=5))


@pytest.fixture(scope="module")
def single_rank(moe_dir):
    """The single-rank run, with both dispatchers (they must agree with each other too)."""
    results = run_distributed(_run_layouts, 1, moe_dir, [("single", {}, d) for d in DISPATCHERS], timeout=120)[0]
    by_dispatcher = {r["case"][1]: r for r in results}
    a, b = by_dispatcher["alltoall"], by_dispatcher["allgather"]
    assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]) and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"]
    return a


def test_single_rank_loss_matches_transformers(moe_dir, single_rank):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    tokens = batch()
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()
    assert abs(single_rank["loss"] - expected) <= 1e-5 * expected, (single_rank["loss"], expected)


def _initial_params(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{model_dir}/model.safetensors")


def _compare(results: list[list[dict]], reference: dict, layout_cases: list, initial: dict) -> list[str]:
    """Failures (empty = all layouts match); prints one line of errors per layout."""
    failures = []
    ref_params = reference["params"]
    ref_update = torch.cat([(ref_params[k] - initial[k]).flatten() for k in sorted(ref_params)])
    assert ref_update.norm() > 1e-3, "the reference step did not move the parameters"
    for i, (name, _, dispatcher) in enumerate(layout_cases):
        label = f"{name}/{dispatcher}"
        losses = [r[i]["loss"] for r in results if r[i]["loss"] is not None]
        loss_err = abs(losses[0] - reference["loss"]) / abs(reference["loss"])
        norm_err = max(abs(r[i]["grad_norm"] - reference["grad_norm"]) for r in results) / reference["grad_norm"]
        params = results[0][i]["params"]
        if set(params) != set(ref_params):
            failures.append(f"{label}: exported names differ: {sorted(set(params) ^ set(ref_params))[:5]}")
            continue
        update = torch.cat([(params[k] - initial[k]).flatten() for k in sorted(ref_params)])
        update_err = ((update - ref_update).norm() / ref_update.norm()).item()
        param_err = max((params[k] - v).abs().max().item() for k, v in ref_params.items())
        print(f"{label:22s} loss {loss_err:.1e}  grad norm {norm_err:.1e}  update {update_err:.1e}  max |param diff| {param_err:.1e}")
        if len(losses) != 1 or max(loss_err, norm_err, update_err) > 1e-5:
            failures.append(f"{label}: relative errors loss {loss_err:.3g}, grad norm {norm_err:.3g}, update {update_err:.3g}")
    return failures


def test_layouts_world2(moe_dir, single_rank):
    layout_cases = cases(WORLD2)
    results = run_distributed(_run_layouts, 2, moe_dir, layout_cases, timeout=300)
    failures = _compare(results, single_rank, layout_cases, _initial_params(moe_dir))
    assert not failures, "\n".join(failures)


def test_layouts_world4(moe_dir, single_rank):
    layout_cases = cases(WORLD4)
    results = run_distributed(_run_layouts, 4, moe_dir, layout_cases, timeout=300)
    failures = _compare(results, single_rank, layout_cases, _initial_params(moe_dir))
    assert not failures, "\n".join(failures)
