"""Time and peak memory of each policy loss (forward + backward) on [B=64, T=8192] CPU float32.

Compared in the same run with two straightforward implementations written
here from the formulas:

* ``per_sequence_loop``: a Python loop over the 64 sequences, each sequence's
  tokens vectorised (what one writes first from the papers' sum over i);
* ``naive_vectorized``: the formulas vectorised over the batch with no input
  sanitising and no metrics (``exp(logprobs - old)`` directly, mask multiplied in).

Ratios are megatron_rl's / the straightforward one's (below 1 = ours is faster
or smaller). megatron_rl's losses do more than the naive formula on purpose:
NaN/inf sanitising (a where() before every exp), the clamp guard, and the
metrics (ratio mean/min/max, clip fractions, KL, entropy, TIS and mismatch
statistics) are part of the measured call. Time is single-threaded, the minimum
over interleaved repeats (robust to other load on the machine). Memory is measured in a fresh subprocess per loss with glibc's mmap threshold
fixed (so freed tensors go back to the OS and RSS tracks live memory): the rise
of the peak resident set size (VmHWM, reset through /proc/self/clear_refs) over
one forward + backward, inputs excluded. Time is measured in another fresh
subprocess with the default allocator.

Writes bench/results/losses.json. Run: python bench/losses.py  (about a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "losses.json"
B, T = 64, 8192
LOSSES = ["grpo", "dapo", "dr_grpo", "gspo", "gspo_token"]
CONFIGS = {
    "plain": dict(),
    "all_options": dict(beta=0.04, kl_estimator="k3", entropy_coeff=0.001, tis_mode="sequence", tis_cap=2.0, dual_clip_c=3.0),
}
REPEATS = 15
THREADS = 1  # single-threaded: stable numbers on a shared machine; the ratios are what matter


def make_cfg(name: str, options: dict) -> SimpleNamespace:
    """A duck-typed config (the losses read fields by name)."""
    fields = dict(loss=name, eps_low=None, eps_high=None, dual_clip_c=0.0, beta=0.0, kl_estimator="k3", entropy_coeff=0.0,
                  tis_mode="none", tis_cap=2.0)
    fields.update(options)
    return SimpleNamespace(**fields)


def make_inputs(torch):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(T // 8, T + 1, (B,), generator=g)
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)
    old = -torch.rand(B, T, generator=g) * 3
    return dict(
        logprobs=(old + 0.001 * torch.randn(B, T, generator=g)).requires_grad_(),
        old=old,
        advantages=torch.randn(B, generator=g),
        mask=mask,
        ref=old + 0.01 * torch.randn(B, T, generator=g),
        rollout=old + 0.001 * torch.randn(B, T, generator=g),
        entropy=(torch.rand(B, T, generator=g) * 2).requires_grad_(),
        lengths=lengths,
    )


# ------------------------------------------------------------------------------------------------
# Straightforward implementations (right-padded responses: row i's tokens are 0 .. len_i - 1).

EPS = {"grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4)}


def _surrogate(torch, ratio, adv, lo, hi, c):
    loss = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - lo, 1 + hi))
    if c:
        loss = torch.where(adv < 0, torch.min(loss, -adv * c), loss)
    return loss


def _kl(torch, lp, ref):
    return torch.exp(ref - lp) - (ref - lp) - 1


def per_sequence_loop(torch, name, x, cfg, n_tok, n_seq, max_tokens):
    lo, hi = EPS[name]
    total = x["logprobs"].sum() * 0
    for i, n in enumerate(x["lengths"].tolist()):
        if n == 0:
            continue
        lp, old, a = x["logprobs"][i, :n], x["old"][i, :n], x["advantages"][i]
        extra = 0
        if cfg.beta:
            extra = extra + cfg.beta * _kl(torch, lp, x["ref"][i, :n]).sum()
        if cfg.entropy_coeff:
            extra = extra - cfg.entropy_coeff * x["entropy"][i, :n].sum()
        tis = 1.0
        if cfg.tis_mode == "sequence":
            tis = torch.clamp(torch.exp((old - x["rollout"][i, :n]).mean()), max=cfg.tis_cap)
        if name == "gspo":
            s = torch.exp((lp - old).mean())
            total = total + (_surrogate(torch, s, a, lo, hi, cfg.dual_clip_c) * tis + extra / n) / n_seq
        elif name == "gspo_token":
            s = torch.exp((lp - old).mean()).detach() * torch.exp(lp - lp.detach())
            total = total + ((_surrogate(torch, s, a, lo, hi, cfg.dual_clip_c) * tis).sum() + extra) / n / n_seq
        else:
            pg = (_surrogate(torch, torch.exp(lp - old), a, lo, hi, cfg.dual_clip_c) * tis).sum() + extra
            if name == "grpo":
                total = total + pg / n / n_seq
            elif name == "dapo":
                total = total + pg / n_tok
            else:
                total = total + pg / (n_seq * max_tokens)
    return total


def naive_vectorized(torch, name, x, cfg, n_tok, n_seq, max_tokens):
    lo, hi = EPS[name]
    m = x["mask"].to(x["logprobs"].dtype)
    lengths = m.sum(-1).clamp(min=1)
    lp, old, a = x["logprobs"], x["old"], x["advantages"].unsqueeze(-1)
    extra = 0
    if cfg.beta:
        extra = extra + cfg.beta * _kl(torch, lp, x["ref"])
    if cfg.entropy_coeff:
        extra = extra - cfg.entropy_coeff * x["entropy"]
    tis = 1.0
    if cfg.tis_mode == "sequence":
        tis = torch.clamp(torch.exp(((old - x["rollout"]) * m).sum(-1, keepdim=True) / lengths.unsqueeze(-1)), max=cfg.tis_cap)
    if name == "gspo":
        s = torch.exp(((lp - old) * m).sum(-1) / lengths)
        pg = _surrogate(torch, s, a.squeeze(-1), lo, hi, cfg.dual_clip_c) * (tis.squeeze(-1) if cfg.tis_mode == "sequence" else 1.0)
        per_seq = pg * (m.sum(-1) > 0) + (extra * m).sum(-1) / lengths if cfg.beta or cfg.entropy_coeff else pg * (m.sum(-1) > 0)
        return per_seq.sum() / n_seq
    if name == "gspo_token":
        seq = ((lp - old) * m).sum(-1, keepdim=True) / lengths.unsqueeze(-1)
        ratio = torch.exp(seq.detach() + lp - lp.detach())
    else:
        ratio = torch.exp(lp - old)
    terms = (_surrogate(torch, ratio, a, lo, hi, cfg.dual_clip_c) * tis + extra) * m
    if name in ("grpo", "gspo_token"):
        return (terms.sum(-1) / lengths).sum() / n_seq
    if name == "dapo":
        return terms.sum() / n_tok
    return terms.sum() / (n_seq * max_tokens)


# ------------------------------------------------------------------------------------------------
# Measurement (in a worker subprocess).


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_mb(run) -> float:
    """Rise of the peak RSS over one call of run() (VmHWM reset to the current RSS first)."""
    baseline = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    run()
    return round((_status_kb("VmHWM") - baseline) / 1024, 2)


def _measure(runs: dict, mode: str) -> dict:
    """mode 'memory': peak RSS rise of one call per implementation; mode 'time': interleaved rounds,
    min and median over REPEATS (interleaving and the minimum resist other load on the machine)."""
    result = {impl: {} for impl in runs}
    for impl, run in runs.items():
        run()  # warm-up (lazy initialisation)
        if mode == "memory":
            result[impl]["peak_mb"] = _peak_mb(run)
    if mode == "time":
        times = {impl: [] for impl in runs}
        for _ in range(REPEATS):
            for impl, run in runs.items():
                start = time.perf_counter()
                run()
                times[impl].append(time.perf_counter() - start)
        for impl in runs:
            result[impl]["time_ms"] = round(1000 * min(times[impl]), 3)
            result[impl]["time_ms_median"] = round(1000 * statistics.median(times[impl]), 3)
    return result


def worker(name: str, mode: str) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    sys.path.insert(0, str(ROOT))
    from megatron_rl.algorithms import compute_loss_denominators, get_policy_loss

    x = make_inputs(torch)
    denom = compute_loss_denominators([x["mask"]], max_response_tokens=T)
    n_tok, n_seq = denom.global_num_tokens, denom.global_num_sequences
    fn = get_policy_loss(name)
    out = {}
    for config_name, options in CONFIGS.items():
        cfg = make_cfg(name, options)
        # plain: no reference/rollout/entropy inputs at all (their metrics would be extra work the naive code skips).
        kwargs = dict(ref_logprobs=x["ref"], rollout_logprobs=x["rollout"], entropy=x["entropy"]) if options else {}
        impls = {
            "megatron_rl": lambda cfg=cfg, kwargs=kwargs: fn(x["logprobs"], x["old"], x["advantages"], x["mask"], cfg, denom, **kwargs)[0],
            "per_sequence_loop": lambda cfg=cfg: per_sequence_loop(torch, name, x, cfg, n_tok, n_seq, T),
            "naive_vectorized": lambda cfg=cfg: naive_vectorized(torch, name, x, cfg, n_tok, n_seq, T),
        }
        values, runs = {}, {}
        for impl, loss_fn in impls.items():
            def run(loss_fn=loss_fn, impl=impl, values=values):
                loss = loss_fn()
                loss.backward()
                values[impl] = (float(loss.detach()), x["logprobs"].grad)
                x["logprobs"].grad = None
                x["entropy"].grad = None

            runs[impl] = run
        result = _measure(runs, mode)
        ours_loss, ours_grad = values["megatron_rl"]
        for impl in ("per_sequence_loop", "naive_vectorized"):
            loss, grad = values[impl]
            result[impl]["loss_abs_diff"] = abs(loss - ours_loss)
            result[impl]["grad_max_abs_diff"] = float((grad - ours_grad).abs().max())
        out[config_name] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["memory", "time"], default="time", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.mode)))
        return
    # Memory runs fix glibc's mmap threshold so that freed tensors go back to the OS at once and the
    # RSS follows live memory; time runs use the allocator as it is (mmap on every tensor costs page faults).
    memory_env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="4096", MALLOC_TRIM_THRESHOLD_="0")
    started = time.time()
    results = {}
    for name in LOSSES:
        parts = {}
        for mode, env in (("memory", memory_env), ("time", dict(os.environ))):
            cmd = [sys.executable, __file__, "--worker", name, "--mode", mode]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"bench worker for {name} ({mode}) failed:\n{proc.stderr}")
            parts[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        results[name] = {}
        for config_name, memory in parts["memory"].items():
            timing = parts["time"][config_name]
            merged = {impl: {**memory[impl], **timing[impl]} for impl in memory}
            for impl in ("per_sequence_loop", "naive_vectorized"):
                for metric, key in (("time_ms", "time"), ("peak_mb", "memory")):
                    theirs = merged[impl][metric]
                    merged[f"{key}_ratio_vs_{impl}"] = round(merged["megatron_rl"][metric] / theirs, 3) if theirs > 0 else None
            results[name][config_name] = merged
        plain = results[name]["plain"]
        print(f"{name:11s} plain: ours {plain['megatron_rl']['time_ms']:7.2f} ms {plain['megatron_rl']['peak_mb']:5.1f} MB | "
              f"per-sequence loop {plain['per_sequence_loop']['time_ms']:7.2f} ms {plain['per_sequence_loop']['peak_mb']:5.1f} MB | "
              f"naive vectorised {plain['naive_vectorized']['time_ms']:7.2f} ms {plain['naive_vectorized']['peak_mb']:5.1f} MB", flush=True)
    import torch

    report = {
        "benchmark": "policy losses, forward + backward",
        "device": "cpu",
        "shape": [B, T],
        "dtype": "float32",
        "torch": torch.__version__,
        "threads": THREADS,
        "cpu": platform.processor() or platform.machine(),
        "repeats": REPEATS,
        "configs": CONFIGS,
        "ratios": "megatron_rl / straightforward (time: min over interleaved repeats of forward+backward; memory: peak RSS rise over one forward+backward, inputs excluded)",
        "wall_s": round(time.time() - started, 1),
        "losses": results,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)} in {report['wall_s']} s")


if __name__ == "__main__":
    main()
