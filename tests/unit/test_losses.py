"""Policy losses against hand-worked numbers and an independent per-token Python implementation.

The reference below is written from the papers' formulas with explicit loops
over sequences and tokens (scalar autograd), sharing no code with
megatron_rl.algorithms.losses; values and gradients must agree to float64
round-off.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (
    DEFAULT_CLIP_RANGE,
    clipped_surrogate,
    POLICY_LOSSES,
    LossDenominators,
    compute_loss_denominators,
    finalize_metrics,
    get_policy_loss,
)
from megatron_rl.algorithms.losses import clipped_surrogate_from_log_ratio
from megatron_rl.config import AlgorithmConfig

LOSSES = ["grpo", "dapo", "dr_grpo", "gspo", "gspo_token"]
DT = torch.float64


# ------------------------------------------------------------------------------------------------
# Independent reference (per-sequence, per-token loops).


def ref_ppo(w, a, eps_low, eps_high, c):
    """-objective of one element: -min(w a, clip(w) a), dual-clipped for a < 0."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    wc = w if lo <= float(w) <= hi else torch.tensor(lo if float(w) < lo else hi, dtype=DT)
    unclipped, clipped = w * a, wc * a
    obj = unclipped if float(unclipped) <= float(clipped) else clipped
    if c and float(a) < 0 and float(obj) < c * float(a):
        obj = torch.tensor(c * float(a), dtype=DT)
    return -obj


def ref_kl(lp, ref, kind):
    if kind == "k1":
        return lp - ref
    if kind == "k2":
        return 0.5 * (lp - ref) ** 2
    return torch.exp(ref - lp) - (ref - lp) - 1


def reference_loss(name, lp, old, adv, mask, cfg, n_tok, n_seq, max_tokens, ref=None, rollout=None, entropy=None):
    eps_low, eps_high = cfg.eps_low, cfg.eps_high
    if eps_low is None:
        eps_low, eps_high = {"grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "dapo": (0.2, 0.28)}.get(name, (3e-4, 4e-4))
    total = torch.zeros((), dtype=DT)
    B, T = mask.shape
    for i in range(B):
        idx = [t for t in range(T) if bool(mask[i, t])]
        if not idx:
            continue
        n = len(idx)
        a_i = adv[i] if adv.dim() == 1 else None
        seq_tis = 1.0
        if cfg.tis_mode == "sequence":
            seq_tis = min(math.exp(sum(float(old[i, t] - rollout[i, t]) for t in idx) / n), cfg.tis_cap)

        def tok_tis(t, i=i, seq_tis=seq_tis):
            if cfg.tis_mode == "token":
                return min(math.exp(float(old[i, t] - rollout[i, t])), cfg.tis_cap)
            return seq_tis

        extras = torch.zeros((), dtype=DT)  # KL and entropy, per-token sum of this sequence
        for t in idx:
            if cfg.beta > 0:
                extras = extras + cfg.beta * ref_kl(lp[i, t], ref[i, t], cfg.kl_estimator)
            if cfg.entropy_coeff:
                extras = extras - cfg.entropy_coeff * entropy[i, t]
        if name == "gspo" and cfg.tis_mode != "token":
            s = torch.exp(sum(lp[i, t] - old[i, t] for t in idx) / n)
            total = total + (ref_ppo(s, a_i, eps_low, eps_high, cfg.dual_clip_c) * seq_tis + extras / n) / n_seq
        elif name in ("gspo", "gspo_token"):  # gspo with token TIS: each token's term carries its own weight
            s_i = torch.exp(sum(lp[i, t] - old[i, t] for t in idx) / n).detach()
            acc = torch.zeros((), dtype=DT)
            for t in idx:
                s_it = s_i * torch.exp(lp[i, t] - lp[i, t].detach())
                a = a_i if a_i is not None else adv[i, t]
                acc = acc + ref_ppo(s_it, a, eps_low, eps_high, cfg.dual_clip_c) * tok_tis(t)
            total = total + (acc + extras) / n / n_seq
        else:
            acc = torch.zeros((), dtype=DT)
            for t in idx:
                w = torch.exp(lp[i, t] - old[i, t])
                acc = acc + ref_ppo(w, a_i, eps_low, eps_high, cfg.dual_clip_c) * tok_tis(t)
            acc = acc + extras
            if name == "grpo":
                total = total + acc / n / n_seq
            elif name == "dapo":
                total = total + acc / n_tok
            else:  # dr_grpo
                total = total + acc / (n_seq * max_tokens)
    return total


# ------------------------------------------------------------------------------------------------
# Fixtures.


def make_batch(seed=0, B=6, T=7, noise=0.15, token_adv=False):
    g = torch.Generator().manual_seed(seed)
    lengths = [T, 3, 1, 5, 0, T - 1][:B]
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    old = -torch.rand(B, T, generator=g, dtype=DT) * 2 - 0.1
    lp = (old + noise * torch.randn(B, T, generator=g, dtype=DT)).requires_grad_()
    adv = torch.randn(B, T, generator=g, dtype=DT) if token_adv else torch.randn(B, generator=g, dtype=DT)
    ref = old + 0.1 * torch.randn(B, T, generator=g, dtype=DT)
    rollout = old + 0.2 * torch.randn(B, T, generator=g, dtype=DT)
    entropy = (torch.rand(B, T, generator=g, dtype=DT) * 2).requires_grad_()
    return lp, old, adv, mask, ref, rollout, entropy


OPTION_SETS = {
    "plain": dict(),
    "kl_k3_entropy": dict(beta=0.05, kl_estimator="k3", entropy_coeff=0.01),
    "kl_k1_dual": dict(beta=0.02, kl_estimator="k1", dual_clip_c=1.5),
    "kl_k2_tis_token": dict(beta=0.02, kl_estimator="k2", tis_mode="token", tis_cap=1.1),
    "tis_sequence_dual": dict(tis_mode="sequence", tis_cap=1.05, dual_clip_c=1.2, entropy_coeff=0.02),
}


def cfg_for(name, eps=(0.1, 0.15), **options):
    return AlgorithmConfig(loss=name, eps_low=eps[0], eps_high=eps[1], **options)


def run(name, cfg, lp, old, adv, mask, ref, rollout, entropy, denom=None, max_tokens=9):
    denom = denom or compute_loss_denominators([mask], max_response_tokens=max_tokens)
    return get_policy_loss(name)(lp, old, adv, mask, cfg, denom, ref_logprobs=ref, rollout_logprobs=rollout, entropy=entropy)


# ------------------------------------------------------------------------------------------------
# Values and gradients against the reference.


LOSS_OPTION_PAIRS = [(n, o) for n in LOSSES for o in OPTION_SETS]


@pytest.mark.parametrize("name,options", LOSS_OPTION_PAIRS, ids=[f"{n}-{o}" for n, o in LOSS_OPTION_PAIRS])
def test_matches_reference(name, options):
    opts = OPTION_SETS[options]
    noise = 0.04 if name.startswith("gspo") else 0.15  # sequence ratios: some in, some out of the clip range
    lp, old, adv, mask, ref, rollout, entropy = make_batch(seed=len(name) + len(options), noise=noise)
    cfg = cfg_for(name, eps=(0.01, 0.015) if name.startswith("gspo") else (0.1, 0.15), **opts)
    loss, metrics = run(name, cfg, lp, old, adv, mask, ref, rollout, entropy)
    n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
    expected = reference_loss(name, lp, old, adv, mask, cfg, n_tok, n_seq, 9, ref, rollout, entropy)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-13)
    got = torch.autograd.grad(loss, (lp, entropy), allow_unused=True)
    want = torch.autograd.grad(expected, (lp, entropy), allow_unused=True)
    for g, w in zip(got, want):
        g = torch.zeros_like(lp) if g is None else g
        w = torch.zeros_like(lp) if w is None else w
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)
    assert lp.grad is None
    assert all(not t.requires_grad for t in metrics.values())
    final = finalize_metrics(metrics)
    assert final["loss/sum"] == pytest.approx(float(expected), rel=1e-12, abs=1e-13)
    assert final["tokens/sum"] == n_tok


def test_gradient_is_nonzero_somewhere_for_every_case():
    """Guard against a test batch whose ratios are all clipped (the comparison above would be vacuous)."""
    for name in LOSSES:
        noise = 0.04 if name.startswith("gspo") else 0.15
        lp, old, adv, mask, ref, rollout, entropy = make_batch(seed=len(name) + len("plain"), noise=noise)
        cfg = cfg_for(name, eps=(0.01, 0.015) if name.startswith("gspo") else (0.1, 0.15))
        loss, metrics = run(name, cfg, lp, old, adv, mask, None, None, None)
        (g,) = torch.autograd.grad(loss, lp)
        clipped = finalize_metrics(metrics)
        assert g.abs().sum() > 0, name
        assert 0 < clipped["clipfrac_low"] + clipped["clipfrac_high"] < 1, (name, clipped)


# ------------------------------------------------------------------------------------------------
# Hand-worked cases (numbers computed by hand in the comments).


def _one(values, dtype=DT):
    return torch.tensor(values, dtype=dtype)


def test_hand_worked_dapo_and_grpo_and_dr_grpo():
    # Two sequences: seq 0 has tokens with ratios e^0.1 = 1.10517 and e^-0.3 = 0.740818, A = +1;
    # seq 1 has one token with ratio e^0.5 = 1.64872, A = -1. eps_low = eps_high = 0.2.
    lp = _one([[0.1, -0.3], [0.5, 0.0]]).requires_grad_()
    old = torch.zeros(2, 2, dtype=DT)
    mask = torch.tensor([[True, True], [True, False]])
    adv = _one([1.0, -1.0])
    # per-token l = -min(wA, clip(w)A):
    #   t00: w=1.10517 in range -> -1.10517
    #   t01: w=0.740818 < 0.8, A>0 -> min(0.740818, 0.8) = 0.740818 -> -0.740818 (unclipped side, has grad)
    #   t10: w=1.64872, A<0 -> min(-1.64872, -1.2) = -1.64872 -> +1.64872
    l = [-math.exp(0.1), -math.exp(-0.3), math.exp(0.5)]
    cfg = AlgorithmConfig(loss="dapo", eps_low=0.2, eps_high=0.2)
    denom = LossDenominators(global_num_tokens=3, global_num_sequences=2, max_response_tokens=4)
    dapo, _ = get_policy_loss("dapo")(lp, old, adv, mask, cfg, denom)
    assert float(dapo) == pytest.approx(sum(l) / 3, rel=1e-12)  # (-1.10517 - 0.740818 + 1.64872) / 3 = -0.065757
    (g,) = torch.autograd.grad(dapo, lp)
    torch.testing.assert_close(g, _one([[-math.exp(0.1) / 3, -math.exp(-0.3) / 3], [math.exp(0.5) / 3, 0.0]]))
    grpo, _ = get_policy_loss("grpo")(lp, old, adv, mask, cfg, denom)
    assert float(grpo) == pytest.approx(((l[0] + l[1]) / 2 + l[2]) / 2, rel=1e-12)  # 0.362597
    dr, _ = get_policy_loss("dr_grpo")(lp, old, adv, mask, cfg, denom)
    assert float(dr) == pytest.approx(sum(l) / (2 * 4), rel=1e-12)
    # Dual clip c = 1.5: t10 has A<0 and -wA = 1.64872 > c|A| = 1.5 -> l = 1.5, no gradient.
    cfg_dual = AlgorithmConfig(loss="dapo", eps_low=0.2, eps_high=0.2, dual_clip_c=1.5)
    dual, metrics = get_policy_loss("dapo")(lp, old, adv, mask, cfg_dual, denom)
    assert float(dual) == pytest.approx((l[0] + l[1] + 1.5) / 3, rel=1e-12)
    (g,) = torch.autograd.grad(dual, lp)
    assert float(g[1, 0]) == 0.0
    final = finalize_metrics(metrics)
    assert final["clipfrac_dual"] == pytest.approx(1 / 3)
    assert final["clipfrac_low"] == 0.0 and final["clipfrac_high"] == 0.0
    assert final["ratio/max"] == pytest.approx(math.exp(0.5)) and final["ratio/min"] == pytest.approx(math.exp(-0.3))


def test_hand_worked_clip_fractions_low_and_high():
    # Ratios 1.5 (A>0: clipped high), 0.5 (A<0: clipped low), 1.5 (A<0: not clipped), 0.5 (A>0: not clipped).
    lp = torch.log(_one([[1.5, 0.5, 1.5, 0.5]])).requires_grad_()
    old = torch.zeros(1, 4, dtype=DT)
    adv = _one([[1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    cfg = AlgorithmConfig(loss="gspo_token", eps_low=0.2, eps_high=0.28)
    denom = LossDenominators(global_num_tokens=4, global_num_sequences=1)
    # gspo_token with per-token A: s_i = geometric mean = (1.5*0.5*1.5*0.5)^(1/4) = 0.866025 in range.
    _, metrics = get_policy_loss("gspo_token")(lp, old, adv, mask, cfg, denom)
    assert finalize_metrics(metrics)["clipfrac_low"] == 0.0
    # The same ratios per token under dapo (advantages per sequence need 4 sequences):
    lp4 = lp.detach().reshape(4, 1)
    _, metrics = get_policy_loss("dapo")(lp4, old.reshape(4, 1), _one([1.0, -1.0, -1.0, 1.0]), mask.reshape(4, 1), cfg,
                                         LossDenominators(global_num_tokens=4, global_num_sequences=4))
    final = finalize_metrics(metrics)
    assert final["clipfrac_high"] == 0.25 and final["clipfrac_low"] == 0.25


def test_hand_worked_gspo():
    # One sequence of 2 tokens, log ratios 0.2 and 0.0 -> s = exp(0.1) = 1.10517; A = 2, eps 0.2:
    # in range -> L = -s A = -2.21034; dL/dlp_t = -A s / |y| = -1.10517 for each token.
    lp = _one([[0.2, 0.0, 0.0]]).requires_grad_()
    old = torch.zeros(1, 3, dtype=DT)
    mask = torch.tensor([[True, True, False]])
    cfg = AlgorithmConfig(loss="gspo", eps_low=0.2, eps_high=0.2)
    denom = LossDenominators(global_num_tokens=2, global_num_sequences=1)
    loss, _ = get_policy_loss("gspo")(lp, old, _one([2.0]), mask, cfg, denom)
    assert float(loss) == pytest.approx(-2 * math.exp(0.1), rel=1e-12)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, _one([[-math.exp(0.1), -math.exp(0.1), 0.0]]))
    # With the paper's range (3e-4 / 4e-4, config None): s = 1.105 > 1.0004, A > 0 -> clipped, no gradient.
    loss, metrics = get_policy_loss("gspo")(lp, old, _one([2.0]), mask, AlgorithmConfig(loss="gspo"), denom)
    assert float(loss) == pytest.approx(-2 * 1.0004, rel=1e-12)
    (g,) = torch.autograd.grad(loss, lp)
    assert float(g.abs().sum()) == 0.0
    assert finalize_metrics(metrics)["clipfrac_high"] == 1.0


def test_hand_worked_gspo_token_with_per_token_advantages():
    # One sequence, log ratios 0.2 and 0.0 -> s_i = exp(0.1) = 1.10517 (in range for eps 0.2); per-token
    # advantages +1 and -1: L = (1/2)(-s*1 + s*1) = 0, but dL/dlp_t = -A_t s / 2 = [-0.552585, +0.552585].
    lp = _one([[0.2, 0.0]]).requires_grad_()
    old = torch.zeros(1, 2, dtype=DT)
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = AlgorithmConfig(loss="gspo_token", eps_low=0.2, eps_high=0.2)
    denom = LossDenominators(global_num_tokens=2, global_num_sequences=1)
    loss, metrics = get_policy_loss("gspo_token")(lp, old, _one([[1.0, -1.0]]), mask, cfg, denom)
    assert float(loss) == pytest.approx(0.0, abs=1e-15)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, _one([[-math.exp(0.1) / 2, math.exp(0.1) / 2]]))
    assert finalize_metrics(metrics)["ratio"] == pytest.approx(math.exp(0.1))


def test_default_clip_ranges_are_the_papers():
    assert DEFAULT_CLIP_RANGE == {
        "grpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4)
    }
    lp, old, adv, mask, *_ = make_batch(noise=0.3)
    for name in LOSSES:
        low, high = DEFAULT_CLIP_RANGE[name]
        a, _ = run(name, AlgorithmConfig(loss=name), lp, old, adv, mask, None, None, None)
        b, _ = run(name, AlgorithmConfig(loss=name, eps_low=low, eps_high=high), lp, old, adv, mask, None, None, None)
        assert float(a) == float(b)


# ------------------------------------------------------------------------------------------------
# GSPO-token and the on-policy case.


@pytest.mark.parametrize("options", [dict(), dict(dual_clip_c=1.2, tis_mode="sequence", tis_cap=1.05, beta=0.1, entropy_coeff=0.1)])
def test_gspo_token_gradient_equals_gspo(options):
    lp, old, adv, mask, ref, rollout, entropy = make_batch(seed=3, noise=0.04)
    cfg = cfg_for("gspo", eps=(0.01, 0.015), **options)
    gspo, _ = run("gspo", cfg, lp, old, adv, mask, ref, rollout, entropy)
    token, _ = run("gspo_token", cfg, lp, old, adv, mask, ref, rollout, entropy)
    token_2d, _ = run("gspo_token", cfg, lp, old, adv.unsqueeze(-1).expand(mask.shape), mask, ref, rollout, entropy)
    torch.testing.assert_close(token, gspo, rtol=1e-12, atol=1e-14)
    (g_seq,) = torch.autograd.grad(gspo, lp)
    (g_tok,) = torch.autograd.grad(token, lp)
    (g_tok2,) = torch.autograd.grad(token_2d, lp)
    torch.testing.assert_close(g_tok, g_seq, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_tok2, g_seq, rtol=1e-12, atol=1e-14)
    assert g_seq.abs().sum() > 0


@pytest.mark.parametrize("name", LOSSES)
def test_on_policy_loss_is_minus_mean_advantage_with_nonzero_gradient(name):
    lp, _, adv, mask, *_ = make_batch(seed=5)
    old = lp.detach().clone()  # pi_theta = pi_old: every ratio is exactly 1
    cfg = AlgorithmConfig(loss=name)
    loss, metrics = run(name, cfg, lp, old, adv, mask, None, None, None, max_tokens=7)
    rows = mask.any(-1)
    if name in ("grpo", "gspo", "gspo_token"):  # sequence mean
        expected = -adv[rows].mean()
    elif name == "dapo":  # token mean
        expected = -(adv.unsqueeze(-1) * mask).sum() / mask.sum()
    else:  # dr_grpo: sum over tokens / (N_seq * MAX)
        expected = -(adv.unsqueeze(-1) * mask).sum() / (rows.sum() * 7)
    assert float(loss) == pytest.approx(float(expected), rel=1e-12)
    (g,) = torch.autograd.grad(loss, lp)
    assert float(g.abs().sum()) > 0
    final = finalize_metrics(metrics)
    assert final["ratio"] == 1.0 and final["clipfrac_low"] == 0.0 and final["clipfrac_high"] == 0.0


# ------------------------------------------------------------------------------------------------
# Non-finite inputs, empty microbatches, bad input.


@pytest.mark.parametrize("name", LOSSES)
def test_nonfinite_tokens_are_dropped_and_get_no_gradient(name):
    lp, old, adv, mask, ref, rollout, entropy = make_batch(seed=7, noise=0.04)
    cfg = cfg_for(name, eps=(0.01, 0.015), beta=0.1, tis_mode="sequence", entropy_coeff=0.01)
    denom = compute_loss_denominators([mask], max_response_tokens=9)
    bad = lp.detach().clone()
    bad[0, 2] = float("nan")  # a response token
    bad[3, 1] = float("inf")  # a response token
    bad[1, 5] = float("nan")  # padding
    old_bad = old.clone()
    old_bad[5, 0] = -float("inf")
    bad.requires_grad_()
    loss, metrics = run(name, cfg, bad, old_bad, adv, mask, ref, rollout, entropy, denom=denom)
    (g,) = torch.autograd.grad(loss, bad)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert float(g[0, 2]) == 0.0 and float(g[3, 1]) == 0.0 and float(g[5, 0]) == 0.0
    # The same as dropping those tokens from the mask, with the step's denominators unchanged.
    dropped = mask.clone()
    dropped[0, 2] = dropped[3, 1] = dropped[5, 0] = False
    clean = lp.detach().clone().requires_grad_()
    expected, _ = run(name, cfg, clean, old, adv, dropped, ref, rollout, entropy, denom=denom)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    (g_clean,) = torch.autograd.grad(expected, clean)
    torch.testing.assert_close(g, g_clean, rtol=1e-12, atol=1e-14)
    final = finalize_metrics(metrics)
    assert final["nonfinite_tokens/sum"] == 3 and final["tokens/sum"] == int(mask.sum()) - 3


@pytest.mark.parametrize("name", LOSSES)
def test_microbatch_without_tokens_gives_zero_loss_and_gradient(name):
    lp, old, adv, mask, ref, rollout, entropy = make_batch(seed=8)
    empty = torch.zeros_like(mask)
    lp_nan = lp.detach().clone()
    lp_nan[:, 3] = float("nan")
    lp_nan.requires_grad_()
    cfg = cfg_for(name, beta=0.1, entropy_coeff=0.1, tis_mode="sequence")
    denom = LossDenominators(global_num_tokens=10, global_num_sequences=4, max_response_tokens=8)
    loss, metrics = run(name, cfg, lp_nan, old, adv * float("nan"), empty, ref, rollout, entropy, denom=denom)
    loss.backward()
    assert float(loss) == 0.0 and float(lp_nan.grad.abs().sum()) == 0.0
    final = finalize_metrics(metrics)
    assert final["tokens/sum"] == 0 and math.isnan(final["ratio"]) and math.isnan(final["ratio/max"])
    # A whole step without tokens: denominators of 0 are well defined (loss 0).
    zero = compute_loss_denominators([empty], max_response_tokens=8)
    loss, _ = run(name, cfg, lp, old, adv, empty, ref, rollout, entropy, denom=zero)
    assert float(loss) == 0.0


def test_beta_zero_never_reads_reference():
    lp, old, adv, mask, ref, *_ = make_batch(seed=9)
    for name in LOSSES:
        cfg = AlgorithmConfig(loss=name, beta=0.0)
        plain, _ = run(name, cfg, lp, old, adv, mask, None, None, None)
        with_nan_ref, metrics = run(name, cfg, lp, old, adv, mask, torch.full_like(ref, float("nan")), None, None)
        assert float(plain) == float(with_nan_ref)
        assert "kl_loss/sum" not in metrics


def test_kl_metric_and_estimators():
    lp, old, adv, mask, ref, *_ = make_batch(seed=10)
    for kind in ("k1", "k2", "k3"):
        cfg = AlgorithmConfig(loss="dapo", beta=0.5, kl_estimator=kind)
        _, metrics = run("dapo", cfg, lp, old, adv, mask, ref, None, None)
        values = [float(ref_kl(lp[i, t], ref[i, t], kind)) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
        final = finalize_metrics(metrics)
        assert final["kl"] == pytest.approx(sum(values) / len(values), rel=1e-12)
        assert final["kl_loss/sum"] == pytest.approx(0.5 * sum(values) / len(values), rel=1e-12)
        if kind != "k1":
            assert min(values) >= 0


def test_rollout_mismatch_and_tis_metrics():
    lp, old, adv, mask, _, rollout, _ = make_batch(seed=11)
    cfg = AlgorithmConfig(loss="dapo", tis_mode="token", tis_cap=1.1)
    _, metrics = run("dapo", cfg, lp, old, adv, mask, None, rollout, None)
    final = finalize_metrics(metrics)
    idx = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    diffs = [abs(float(old[i, t] - rollout[i, t])) for i, t in idx]
    assert final["mismatch/abs_logprob_diff"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-12)
    assert final["mismatch/abs_logprob_diff/max"] == pytest.approx(max(diffs), rel=1e-12)
    k3 = [math.exp(d) - d - 1 for d in (float(old[i, t] - rollout[i, t]) for i, t in idx)]
    assert final["mismatch/kl_k3"] == pytest.approx(sum(k3) / len(k3), rel=1e-10)
    weights = [min(math.exp(float(old[i, t] - rollout[i, t])), 1.1) for i, t in idx]
    assert final["is/weight"] == pytest.approx(sum(weights) / len(weights), rel=1e-12)
    assert final["is/truncated"] == pytest.approx(sum(w == 1.1 for w in weights) / len(weights))
    assert 0 < final["is/truncated"] < 1


def test_sequence_tis_uses_geometric_mean_not_product():
    # 1000 tokens each with pi_old / pi_rollout = e^0.01: the product is e^10 = 22026, the geometric mean e^0.01.
    T = 1000
    old = torch.zeros(1, T, dtype=DT)
    rollout = torch.full((1, T), -0.01, dtype=DT)
    lp = old.clone().requires_grad_()
    mask = torch.ones(1, T, dtype=torch.bool)
    cfg = AlgorithmConfig(loss="dapo", tis_mode="sequence", tis_cap=2.0)
    _, metrics = run("dapo", cfg, lp, old, torch.ones(1, dtype=DT), mask, None, rollout, None)
    assert finalize_metrics(metrics)["is/weight"] == pytest.approx(math.exp(0.01), rel=1e-12)


def test_errors_name_what_is_wrong():
    lp, old, adv, mask, ref, rollout, entropy = make_batch()
    denom = compute_loss_denominators([mask], max_response_tokens=9)
    dapo = get_policy_loss("dapo")
    cfg = AlgorithmConfig(loss="dapo")
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*dapo, dr_grpo, grpo, gspo, gspo_token"):
        get_policy_loss("ppo")
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        dapo(lp, old[:, :3], adv, mask, cfg, denom)
    with pytest.raises(ValueError, match="response_mask must be bool"):
        dapo(lp, old, adv, mask.float(), cfg, denom)
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        dapo(lp, old, adv[:3], mask, cfg, denom)
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        dapo(lp, old, adv.unsqueeze(-1).expand(mask.shape), mask, cfg, denom)
    with pytest.raises(ValueError, match="beta=0.1 needs ref_logprobs"):
        dapo(lp, old, adv, mask, AlgorithmConfig(loss="dapo", beta=0.1), denom)
    with pytest.raises(ValueError, match="tis_mode='token' needs rollout_logprobs"):
        dapo(lp, old, adv, mask, AlgorithmConfig(loss="dapo", tis_mode="token"), denom)
    with pytest.raises(ValueError, match="entropy_coeff=0.1 needs"):
        dapo(lp, old, adv, mask, AlgorithmConfig(loss="dapo", entropy_coeff=0.1), denom)
    with pytest.raises(ValueError, match="max_response_tokens"):
        get_policy_loss("dr_grpo")(lp, old, adv, mask, cfg, LossDenominators(global_num_tokens=5, global_num_sequences=2))
    with pytest.raises(TypeError, match="LossDenominators"):
        dapo(lp, old, adv, mask, cfg, {"global_num_tokens": 5})
    with pytest.raises(ValueError, match="logprobs must be"):
        dapo(lp[0], old[0], adv, mask[0], cfg, denom)


def test_sequence_level_losses_refuse_split_sequences():
    lp, old, adv, mask, *_ = make_batch()
    # Rows 0 and 1 claim to be parts of the same sequence (id 0).
    ids = torch.tensor([0, 0, 1, 2, 3, 4])
    denom = compute_loss_denominators([mask], sequence_ids=[ids], num_sequence_ids=5, max_response_tokens=9)
    assert denom.num_split_sequences == 1 and denom.global_num_sequences == 4  # id 3 (row 4) has no tokens
    for name in LOSSES:
        fn = get_policy_loss(name)
        if name in ("grpo", "gspo", "gspo_token"):
            with pytest.raises(ValueError, match="more than one row"):
                fn(lp, old, adv, mask, AlgorithmConfig(loss=name), denom)
        else:
            fn(lp, old, adv, mask, AlgorithmConfig(loss=name), denom)


def test_registry_holds_every_loss():
    assert POLICY_LOSSES.names() == sorted(LOSSES)


def test_float32_inputs_give_float32_loss():
    lp, old, adv, mask, *_ = make_batch()
    lp32 = lp.detach().float().requires_grad_()
    for name in LOSSES:
        loss, _ = run(name, AlgorithmConfig(loss=name), lp32, old.float(), adv.float(), mask, None, None, None)
        assert loss.dtype == torch.float32
        (g,) = torch.autograd.grad(loss, lp32)
        assert g.dtype == torch.float32


@pytest.mark.parametrize("dual_clip_c", [0.0, 1.5])
def test_fused_surrogate_matches_autograd_of_the_plain_formula(dual_clip_c):
    g = torch.Generator().manual_seed(12)
    log_ratio = 0.4 * torch.randn(50, 40, generator=g, dtype=DT)
    log_ratio[0, :4] = torch.log(torch.tensor([0.8, 1.2, 1.0, 1.5], dtype=DT))  # on the clip bounds, at 1, at c
    advantages = torch.randn(50, 1, generator=g, dtype=DT)
    advantages[0] = -1.0
    a = log_ratio.clone().requires_grad_()
    b = log_ratio.clone().requires_grad_()
    fused, ratio, low, high, dual = clipped_surrogate_from_log_ratio(a, advantages, 0.2, 0.2, dual_clip_c)
    plain, low2, high2, dual2 = clipped_surrogate(b.exp(), advantages, 0.2, 0.2, dual_clip_c)
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)
    weights = torch.rand(50, 40, generator=g, dtype=DT)
    (ga,) = torch.autograd.grad((fused * weights).sum(), a)
    (gb,) = torch.autograd.grad((plain * weights).sum(), b)
    torch.testing.assert_close(ga, gb, rtol=1e-14, atol=1e-15)
    assert torch.equal(low, low2) and torch.equal(high, high2)
    assert (dual is None) == (dual2 is None) and (dual is None or torch.equal(dual, dual2))
    assert low.any() and high.any() and not ratio.requires_grad


def test_finite_mask_equals_torch_isfinite():
    from megatron_rl.algorithms._finite import finite

    special = [0.0, -0.0, 1.0, -3.5, float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38, 1e-45, 1e308]
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        values = torch.tensor(special, dtype=torch.float64).to(dtype)
        assert torch.equal(finite(values), torch.isfinite(values)), dtype
    assert finite(torch.tensor([3, -1])).all()
