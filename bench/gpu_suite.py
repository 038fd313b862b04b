"""`make gpu-check`: the GPU tests, then correctness and speed of the actor on one GPU, as JSON.

    python bench/gpu_suite.py              # one CUDA GPU: bench/results/gpu-<device>.json (< 8 minutes)
    python bench/gpu_suite.py --tiny       # CPU (or GPU) with tiny shapes: checks its own numbers (~1 minute)

Sections, each written to the JSON as soon as it is done (a run cut short still
reports what it finished):

1. ``environment``: device, versions, platform availability, the layer spec
   the build chooses and why (models.build.spec_choice).
2. ``tests``: ``pytest tests/unit tests/gpu`` (xdist when installed) with its
   counts (with --tiny only tests/unit/test_placement.py: the suite runs --tiny itself).
3. ``logprobs``: per family (qwen3_moe, deepseek_v3, glm4_moe; tiny random
   models): the actor's fp32 old-policy logprobs against transformers' forward
   of the same weights on the same device (max |diff| over real tokens), packed
   (THD) against padded microbatches, and one GSPO train step from the old
   policy, whose loss must equal -mean(A) (at the first step every sequence
   ratio s_i = 1, GSPO Eq. 5-7) with a finite gradient norm.
4. ``speed``: a Qwen3-MoE-shaped model that fits one GPU (2.55 B parameters,
   bf16; tiny with --tiny): the actor's train step (packed, through
   actor.distribute as the trainer runs it) and old-policy forward in
   tokens/s, MFU and peak memory, beside transformers' own forward + backward +
   AdamW (torch, fused on CUDA) of the same model shape and batch, and their
   ratio; where one step's time goes (megatron_rl.actor.phases: experts,
   attention, router, permutation, logprobs, optimizer, other, host overhead);
   and each kernel choice of models.kernels undone in turn (per-expert GEMMs,
   per-sequence attention, fusions off, megatron's MoE dispatcher, padded rows) as a before/after line.
5. ``vocab_logprobs``: peak memory of vocab-parallel logprobs + entropy
   (forward and backward) on bf16 logits as a multiple of the logits' bytes,
   and their values against log_softmax.

MFU (model FLOPs utilisation; Chowdhery et al. 2022, PaLM, Appendix B): model
FLOPs per token of a training step = 6 N + 12 L H Q S, where N = parameters a
token passes through (attention, norms, the router, the k routed experts it goes
to, the output layer; not the input embedding, a lookup), L
layers, H query heads, Q head dim, S the sequence length (PaLM's attention term,
not halved for the causal mask). A forward alone is a third of it (2 N + 4 L H Q S).
MFU = model FLOPs per token x tokens/s / peak, with two peaks: a measured bf16
matmul (8192^3, best of several) and the card's dense bf16 spec (NVIDIA data
sheets: H100 SXM and H200 989 TFLOP/s, H100 PCIe 756, H100 NVL 835, A100 312).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SECTIONS = ("tests", "logprobs", "speed", "vocab_logprobs")
FAMILIES = {"qwen3_moe": {}, "deepseek_v3": {"init_std": 0.1}, "glm4_moe": {"init_std": 0.1}}
SPEC_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("A100", 312.0))
LOGPROB_TOL, PACKED_TOL = 1e-5, 1e-5  # fp32 logprobs vs transformers on the same device: measured 1.4e-6 on an H200
# The speed model: Qwen3-MoE's shape (30B-A3B's widths, 64 experts, 6 layers) at 2.55 B parameters.
SPEED_MODEL = dict(hidden_size=2048, num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                   moe_intermediate_size=768, intermediate_size=6144, num_experts=64, num_experts_per_tok=8,
                   max_position_embeddings=4096)
SPEED_VOCAB, SPEED_ROWS, SPEED_LEN, SPEED_BUDGET = 151936, 16, 2048, 8192
TINY_SPEED_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        moe_intermediate_size=32, intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=256)
TINY_VOCAB, TINY_ROWS, TINY_LEN, TINY_BUDGET = 256, 4, 64, 128


class Suite:
    """The results dict, saved after every section, and the self-checks that decide the exit code."""

    def __init__(self, out: Path, tiny: bool):
        self.out, self.tiny = out, tiny
        self.results: dict = {"tiny": tiny, "checks": {}}
        self.failed: list[str] = []

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.results["checks"][name] = {"ok": bool(ok), "detail": detail}
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)

    def save(self, section: str, value) -> None:
        self.results[section] = value
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        os.replace(tmp, self.out)


def device_slug(device: torch.device) -> str:
    """File-name form of the device: 'nvidia-h100-80gb-hbm3', or 'cpu'."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def spec_tflops(device: torch.device) -> float | None:
    """The card's dense bf16 TFLOP/s from its data sheet (None for a card not in the table, or the CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((value for key, value in SPEC_TFLOPS if key in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measured_matmul_tflops(device: torch.device, n: int, repeats: int = 10) -> float:
    """Best bf16 n x n x n matmul rate (2 n^3 FLOPs per product) in TFLOP/s."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def flop_params(hf: dict) -> dict[str, int]:
    """Parameters by what a token does with them, from the Qwen3-MoE config arithmetic (see the docstring)."""
    h, heads, kv, hd = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    attention = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 2 * hd  # q, k, v, o; q/k norms
    expert = 3 * h * hf["moe_intermediate_size"]
    layer_fixed = attention + h * hf["num_experts"] + 2 * h  # + router + the two layer norms
    layers = hf["num_hidden_layers"]
    vocab = hf["vocab_size"]
    return {
        "total": layers * (layer_fixed + hf["num_experts"] * expert) + 2 * vocab * h + h,
        "flop_active": layers * (layer_fixed + hf["num_experts_per_tok"] * expert) + vocab * h + h,  # + output layer, final norm
        "embedding": vocab * h,
    }


def model_flops_per_token(hf: dict, seq_len: int, *, train: bool) -> float:
    """6 N + 12 L H Q S (training) or 2 N + 4 L H Q S (forward): PaLM Appendix B."""
    n = flop_params(hf)["flop_active"]
    attn = hf["num_hidden_layers"] * hf["num_attention_heads"] * hf["head_dim"] * seq_len
    return 6 * n + 12 * attn if train else 2 * n + 4 * attn


def make_batch(rows: int, length: int, vocab: int, seed: int, *, prompt: int, full: bool):
    """Right-padded rows: prompt + response; lengths from `length` // 2 to `length` (all `length` when full)."""
    from megatron_rl.actor import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.full((rows,), length) if full else torch.randint(length // 2, length + 1, (rows,), generator=g)
    positions = torch.arange(length)
    mask = (positions[None] >= prompt) & (positions[None] < lengths[:, None])
    return TrainBatch(tokens=torch.randint(0, vocab, (rows, length), generator=g), response_mask=mask,
                      advantages=torch.randn(rows, generator=g), prompt_lengths=torch.full((rows,), prompt),
                      sequence_lengths=lengths)


def _actor(ctx, model_cfg, *, packed: bool, budget: int, hf_config: dict | None = None):
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, OptimizerConfig, TrainConfig

    train = TrainConfig(max_tokens_per_microbatch=budget, pack_sequences=packed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Actor(ctx, model=model_cfg, optimizer=OptimizerConfig(lr=1e-6), train=train,
                     algorithm=AlgorithmConfig(loss="gspo"), hf_config=hf_config)


def hf_token_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token_t | tokens_<t) from transformers' logits, token-aligned (column 0 = 0), as the actor returns them."""
    with torch.no_grad():
        logits = model(tokens).logits.float()
    picked = torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


# ---------------------------------------------------------------------------------------------
# Sections.


def environment(device: torch.device) -> dict:
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.build import spec_choice
    from megatron_rl.parallel.availability import detect

    avail = detect()
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "availability": avail.describe(), "layer_spec": spec_choice(ModelConfig(), avail)[1],
    }


def run_tests(suite: Suite, timeout_s: int, paths: tuple[str, ...] = ("tests/unit", "tests/gpu")) -> dict:
    """pytest on `paths` (xdist when installed), its counts parsed from the summary line."""
    import importlib.util

    cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-rfE", "-p", "no:cacheprovider", "--timeout=300"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        text, rc = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""), "timeout"
    summary = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line) and " in " in line]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary[-1] if summary else "")}
    failures = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    out = {"command": " ".join(cmd[1:]), "returncode": rc, "seconds": round(time.perf_counter() - start, 1),
           "counts": counts, "failures": failures[:50],
           "failure_details": _failure_details(text) if failures else ""}
    suite.check("tests", rc == 0, f"{counts} in {out['seconds']} s")
    return out


def _failure_details(text: str, limit: int = 6000) -> str:
    """pytest's FAILURES section (the assertion lines and the errors), cut to `limit` characters."""
    start = text.find("= FAILURES =")
    section = text[start:] if start >= 0 else text
    lines = [line for line in section.splitlines() if line.startswith(("E ", ">", "_", "FAILED", "ERROR")) or "Error" in line]
    return "\n".join(lines)[:limit]


def family_logprobs(suite: Suite, ctx, family: str, overrides: dict, tmp: Path) -> dict:
    """Actor fp32 logprobs vs transformers (same device), packed vs padded, one GSPO step (loss = -mean A)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.config import ModelConfig
    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp / family, family, seed=3, with_tokenizer=False, **overrides)
    model_cfg = ModelConfig(path=str(model_dir), dtype="float32")
    batch = make_batch(6, 48, 256, seed=1, prompt=8, full=False)
    padded, packed = _actor(ctx, model_cfg, packed=False, budget=160), _actor(ctx, model_cfg, packed=True, budget=160)
    try:
        old = padded.compute_logprobs(batch).cpu()
        old_packed = packed.compute_logprobs(batch).cpu()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(ctx.device).eval()
        expected = hf_token_logprobs(reference, batch.tokens.to(ctx.device)).cpu()
        real = torch.arange(batch.tokens.shape[1])[None] < batch.sequence_lengths[:, None]
        err = ((old - expected).abs() * real).max().item()
        packed_err = ((old_packed - old).abs() * real).max().item()
        metrics = padded.train_step(batch.replace(old_logprobs=old.to(torch.float32)))
    finally:
        padded.close()
        packed.close()
    has_tokens = batch.response_mask.any(1)
    expected_loss = -(batch.advantages * has_tokens).sum().item() / has_tokens.sum().item()  # s_i = 1: GSPO Eq. 7
    loss = metrics.get("loss/sum", metrics.get("loss"))
    suite.check(f"logprobs/{family}", err <= LOGPROB_TOL, f"max |actor - transformers| {err:.2e} (<= {LOGPROB_TOL})")
    suite.check(f"packed/{family}", packed_err <= PACKED_TOL, f"max |packed - padded| {packed_err:.2e} (<= {PACKED_TOL})")
    step_ok = loss is not None and abs(loss - expected_loss) <= 1e-4 * max(1.0, abs(expected_loss)) and math.isfinite(metrics["grad_norm"])
    suite.check(f"gspo_step/{family}", step_ok, f"loss {loss} vs -mean(A) {expected_loss:.6f}, grad_norm {metrics['grad_norm']:.4g}")
    return {"max_abs_err_vs_transformers": err, "max_abs_err_packed_vs_padded": packed_err, "gspo_loss": loss,
            "gspo_expected_loss": expected_loss, "grad_norm": metrics["grad_norm"]}


def _timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Best wall time of fn() over `repeats` calls after one warm-up call, and the last result."""
    result = fn()
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best, result


def _peak(device: torch.device, fn) -> tuple[object, int | None]:
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, torch.cuda.max_memory_allocated(device)


def actor_speed(ctx, hf: dict, rows: int, length: int, budget: int, repeats: int, *, packed: bool = True,
                model: dict | None = None, phases: bool = False) -> dict:
    """The actor's old-policy forward and train step through the trainer's path (actor.distribute, prepare_batch,
    train_step); `model`: ModelConfig overrides (the kernel ablations); `phases`: also one profiled step
    (megatron_rl.actor.phases)."""
    from megatron_rl.actor.phases import profile_train_step
    from megatron_rl.config import ModelConfig

    dtype = "bfloat16" if ctx.device.type == "cuda" else "float32"
    cuda = ctx.device.type == "cuda"
    allocated_before = torch.cuda.memory_allocated(ctx.device) if cuda else 0
    actor = _actor(ctx, ModelConfig(dtype=dtype, load_weights=False, **(model or {})), packed=packed, budget=budget, hf_config=hf)
    batch = actor.distribute(make_batch(rows, length, hf["vocab_size"], seed=2, prompt=length // 8, full=True))
    breakdown = None
    try:
        fwd_s, old = _timed(lambda: actor.compute_logprobs(batch), ctx.device, repeats)
        step_batch = batch.replace(old_logprobs=old)
        _timed(lambda: actor.train_step(step_batch), ctx.device, 0)  # warm-up (optimizer state)
        (step_s, _), peak = _peak(ctx.device, lambda: _timed(lambda: actor.train_step(step_batch), ctx.device, repeats))
        if phases:
            breakdown = profile_train_step(actor, step_batch)
        syncs = host_syncs(lambda: actor.train_step(step_batch)) if cuda and phases else None
    finally:
        actor.close()  # the device memory comes back (Actor.close): transformers' model and the ablations come next
    tokens = rows * length
    out = {"dtype": dtype, "train_step_s": step_s, "train_tokens_per_s": tokens / step_s, "forward_s": fwd_s,
           "forward_tokens_per_s": tokens / fwd_s, "peak_memory_bytes": peak}
    if cuda:  # bytes still allocated after close(), against those before the build (Actor.close frees the device)
        out["allocated_before_bytes"] = allocated_before
        out["allocated_after_close_bytes"] = torch.cuda.memory_allocated(ctx.device)
    if breakdown is not None:
        out["phases"] = breakdown
    if syncs is not None:
        out["host_syncs"] = syncs
    return out


def host_syncs(fn) -> dict:
    """How often `fn` made the host wait for the GPU (torch.cuda.set_sync_debug_mode's warnings: .item(), a blocking
    copy, a data-dependent shape), in all and by where torch reported them, the most frequent first."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where: dict[str, int] = {}
    for warning in caught:
        if "synchroniz" in str(warning.message):
            key = f"{Path(warning.filename).name}:{warning.lineno}"
            where[key] = where.get(key, 0) + 1
    return {"total": sum(where.values()), "by_site": dict(sorted(where.items(), key=lambda kv: -kv[1])[:20])}


# Each kernel choice of models.kernels turned back off, one at a time (same model, batch and run), and padded rows.
ABLATIONS = {
    "experts_per_expert_gemm": {"model": {"moe_grouped_gemm": False}},
    "attention_per_sequence": {"model": {"packed_attention": "per_sequence"}},
    "fusions_off": {"model": {"fusions": False}},
    "megatron_dispatch": {"model": {"token_dispatcher": "alltoall"}},
    "padded_rows": {"packed": False},
}


def ablations(suite: Suite, ctx, hf: dict, rows: int, length: int, budget: int, baseline: dict) -> dict:
    """train tokens/s with each kernel choice undone, as a before/after line against the baseline (all on)."""
    out = {}
    for name, change in ABLATIONS.items():
        try:
            result = actor_speed(ctx, hf, rows, length, budget, 1, **change)
        except Exception as err:  # noqa: BLE001 - recorded; the other ablations still run
            out[name] = {"error": f"{type(err).__name__}: {err}"[:1000]}
            continue
        finally:
            gc.collect()
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        result["all_on_over_this"] = baseline["train_tokens_per_s"] / result["train_tokens_per_s"]
        out[name] = result
        print(f"ablation/{name}: train {result['train_tokens_per_s']:.0f} tok/s; all on is x{result['all_on_over_this']:.2f}",
              flush=True)
    return out


def transformers_speed(device: torch.device, hf: dict, rows: int, length: int, budget: int, repeats: int) -> dict:
    """transformers' forward + backward (its own mean cross-entropy) + torch AdamW, microbatches of `budget` tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf), dtype=dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    tokens = make_batch(rows, length, hf["vocab_size"], seed=2, prompt=length // 8, full=True).tokens.to(device)
    per_micro = max(1, budget // length)

    def step():
        for chunk in tokens.split(per_micro):
            model(input_ids=chunk, labels=chunk).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def forward():
        with torch.no_grad():
            for chunk in tokens.split(per_micro):
                _ = model(input_ids=chunk).logits

    try:
        fwd_s, _ = _timed(forward, device, repeats)
        _timed(step, device, 0)
        (step_s, _), peak = _peak(device, lambda: _timed(step, device, repeats))
    finally:
        optimizer.zero_grad(set_to_none=True)
    n = rows * length
    return {"dtype": str(dtype).replace("torch.", ""), "train_step_s": step_s, "train_tokens_per_s": n / step_s,
            "forward_s": fwd_s, "forward_tokens_per_s": n / fwd_s, "peak_memory_bytes": peak}


def speed(suite: Suite, ctx, tiny: bool, *, with_ablations: bool = True) -> dict:
    from megatron_rl.actor.phases import phases_check

    shape, vocab = (TINY_SPEED_MODEL, TINY_VOCAB) if tiny else (SPEED_MODEL, SPEED_VOCAB)
    rows, length, budget = (TINY_ROWS, TINY_LEN, TINY_BUDGET) if tiny else (SPEED_ROWS, SPEED_LEN, SPEED_BUDGET)
    from megatron_rl.models.tiny import tiny_hf_config

    hf = tiny_hf_config("qwen3_moe", vocab, tie_word_embeddings=False, mlp_only_layers=[], decoder_sparse_step=1, **shape)
    params = flop_params(hf)
    measured = measured_matmul_tflops(ctx.device, 256 if tiny else 8192)
    spec = spec_tflops(ctx.device)
    out = {"model": {**shape, "vocab_size": vocab, **{f"params_{k}": v for k, v in params.items()}},
           "batch": {"rows": rows, "tokens_per_row": length, "tokens_per_microbatch": budget},
           "peak_tflops_measured_bf16_matmul": measured, "peak_tflops_spec": spec,
           "train_flops_per_token": model_flops_per_token(hf, length, train=True),
           "forward_flops_per_token": model_flops_per_token(hf, length, train=False)}
    repeats = 1 if tiny else 2
    for name, run in (("megatron_rl", lambda: actor_speed(ctx, hf, rows, length, budget, repeats, phases=True)),
                      ("transformers", lambda: transformers_speed(ctx.device, hf, rows, length, budget, repeats))):
        try:
            result = run()
        except Exception as err:  # noqa: BLE001 - recorded (e.g. out of memory): the other side still runs
            out[name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            suite.check(f"speed/{name}", False, out[name]["error"][:300])
            continue
        finally:
            gc.collect()  # the model and its optimizer went with run's frame: free them before the next side
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
        for kind in ("train", "forward"):
            achieved = out[f"{kind}_flops_per_token"] * result[f"{kind}_tokens_per_s"] / 1e12
            result[f"{kind}_tflops"] = achieved
            result[f"{kind}_mfu_vs_measured"] = achieved / measured
            result[f"{kind}_mfu_vs_spec"] = achieved / spec if spec else None
        out[name] = result
        suite.save("speed", out)
        print(f"speed/{name}: train {result['train_tokens_per_s']:.0f} tok/s (MFU {result['train_mfu_vs_measured']:.3f} of "
              f"measured), forward {result['forward_tokens_per_s']:.0f} tok/s, peak {result['peak_memory_bytes']}", flush=True)
    if "train_tokens_per_s" in out.get("megatron_rl", {}):
        ours = out["megatron_rl"]
        if "train_tokens_per_s" in out.get("transformers", {}):
            out["megatron_rl_over_transformers_train"] = ours["train_tokens_per_s"] / out["transformers"]["train_tokens_per_s"]
            print(f"speed: megatron_rl / transformers train tokens/s = x{out['megatron_rl_over_transformers_train']:.2f}", flush=True)
        phases = ours.get("phases", {})
        suite.check("phases", *phases_check(phases))
        print("phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in phases.get("phases_s", {}).items())
              + (f", host overhead {phases['host_overhead_s']:.3f} s" if phases.get("host_overhead_s") is not None else ""),
              flush=True)
        for kernel in phases.get("top_kernels", [])[:12]:
            print(f"kernel {kernel['seconds']:.4f} s x{kernel['launches']}: {kernel['kernel']}", flush=True)
        suite.save("speed", out)
        if with_ablations:
            out["ablations"] = ablations(suite, ctx, hf, rows, length, budget, ours)
            suite.check("ablations", all("train_tokens_per_s" in r for r in out["ablations"].values()),
                        f"{len(out['ablations'])} kernel ablations measured")
    if tiny:  # the FLOP count's parameter arithmetic against the model's own parameters
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
        counted = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        active = counted - experts * (1 - hf["num_experts_per_tok"] / hf["num_experts"]) - params["embedding"]
        suite.check("flop_params", counted == params["total"] and abs(active - params["flop_active"]) < 1,
                    f"config arithmetic total {params['total']} / active {params['flop_active']} vs counted {counted} / {active:.0f}")
    return out


def vocab_logprobs(suite: Suite, device: torch.device, tiny: bool) -> dict:
    """Peak memory of vocab-parallel logprobs + entropy, forward and backward, over the bf16 logits' bytes."""
    from megatron_rl.actor.logprobs import reference_logprobs, vocab_parallel_logprobs

    tokens, vocab, hidden = (256, 1024, 64) if tiny else (4096, 151936, 1024)
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16, generator=g) * 0.05
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    logits = h @ w.t()
    logits_bytes = logits.numel() * logits.element_size()
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    def run():
        lp, ent = vocab_parallel_logprobs(logits, targets, temperature=0.9, with_entropy=True)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach()

    (lp, ent), peak = _peak(device, run)
    with torch.no_grad():
        want_lp, want_ent = reference_logprobs((h @ w.t()).float(), targets, temperature=0.9)
    err = max((lp - want_lp).abs().max().item(), (ent - want_ent).abs().max().item())
    ratio = None if peak is None else (logits_bytes + peak - base) / logits_bytes
    # The 1.5 x bound is for real sizes (4096 x 151936 here), where the float32 work runs in row chunks; tiny
    # logits fit one chunk, so --tiny records the ratio without bounding it.
    bounded = ratio is None or tiny or ratio <= 1.5
    suite.check("vocab_logprobs", err <= 1e-3 and bounded,
                f"max err {err:.2e} (<= 1e-3), peak / logits bytes {ratio if ratio is None else round(ratio, 3)}"
                + ("" if tiny else " (<= 1.5)"))
    return {"tokens": tokens, "vocab": vocab, "logits_bytes": logits_bytes, "peak_over_logits": ratio, "max_abs_err": err}


def recheck(path: Path) -> int:
    """A recorded run's phases check again, from what it recorded: runs whose device time counted the labelled
    ranges' spans get their phases re-derived (`rederived_phases`, kept beside the recorded ones)."""
    from megatron_rl.actor.phases import phases_check, rederived_phases

    record = json.loads(path.read_text())
    ours = record.get("speed", {}).get("megatron_rl", {})
    if "phases" not in ours:
        print(f"{path}: no profiled step recorded", file=sys.stderr)
        return 2
    phases = rederived_phases(ours["phases"])
    if phases is not ours["phases"]:
        ours["phases_rederived"] = phases
    ok, detail = phases_check(phases)
    record["checks"]["phases"] = {"ok": ok, "detail": detail + (f" (re-derived: {phases['rederived']})" if "rederived" in phases else "")}
    record["failed_checks"] = [name for name, check in record["checks"].items() if not check["ok"]]
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"{'ok  ' if ok else 'FAIL'} phases: {record['checks']['phases']['detail']}; wrote {path}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, any device (CPU included); checks its own numbers")
    parser.add_argument("--out", help="JSON path (default bench/results/gpu-<device>.json; --tiny: a temporary file)")
    parser.add_argument("--tests-timeout", type=int, default=240, help="seconds for the pytest section (default 240)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (default all: {','.join(SECTIONS)}), e.g. speed alone in a fresh process")
    parser.add_argument("--no-ablations", action="store_true", help="speed without the kernel ablations")
    parser.add_argument("--recheck", metavar="JSON", help="re-derive a recorded run's phases and their check from "
                        "what it recorded (megatron_rl.actor.phases.rederived_phases), rewrite it, and exit")
    args = parser.parse_args(argv)
    if args.recheck:
        return recheck(Path(args.recheck))
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        parser.error(f"--sections {args.sections}: each must be one of {', '.join(SECTIONS)}")
    if not args.tiny and not torch.cuda.is_available():
        print("bench/gpu_suite.py: no CUDA device here; run it on a GPU, or with --tiny", file=sys.stderr)
        return 2
    from megatron_rl.config import ParallelConfig
    from megatron_rl.parallel import destroy_parallel, init_parallel

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    default = ROOT / "bench" / "results" / f"gpu-{device_slug(device)}.json"
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp()) / "gpu-tiny.json" if args.tiny else default)
    suite = Suite(out, args.tiny)
    suite.save("environment", environment(device))
    paths = ("tests/unit/test_placement.py",) if args.tiny else ("tests/unit", "tests/gpu")
    if "tests" in sections:
        suite.save("tests", run_tests(suite, args.tests_timeout, paths))
    ctx = init_parallel(ParallelConfig())
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-suite-") as tmp:
            families_run = FAMILIES if "logprobs" in sections else {}
            families = {}
            for family, overrides in families_run.items():
                try:
                    families[family] = family_logprobs(suite, ctx, family, overrides, Path(tmp))
                except Exception as err:  # noqa: BLE001 - recorded; the other families and sections still run
                    families[family] = {"error": f"{type(err).__name__}: {err}"[:2000]}
                    suite.check(f"logprobs/{family}", False, families[family]["error"][:300])
                suite.save("logprobs", families)
        if "speed" in sections:
            suite.save("speed", speed(suite, ctx, args.tiny, with_ablations=not args.no_ablations))
        if "vocab_logprobs" in sections:
            suite.save("vocab_logprobs", vocab_logprobs(suite, ctx.device, args.tiny))
    finally:
        destroy_parallel(ctx)
    suite.save("failed_checks", suite.failed)
    print(f"wrote {out}; {len(suite.failed)} failed check(s) {suite.failed}", flush=True)
    return 1 if suite.failed else 0


if __name__ == "__main__":
    sys.exit(main())
