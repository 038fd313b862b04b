"""Importance-sampling corrections against hand-worked numbers (values, gradients, drops, metrics).

One batch worked by hand throughout: the current policy equals the trainer's
old policy (every PPO ratio is 1, inside any clip range), two sequences

    seq 0: A = +1, rho = pi_old / pi_rollout = 0.4, 1.5, 3.0   (geometric mean 1.8^(1/3) = 1.216440)
    seq 1: A = -2, rho = 1.2, 0.9                              (geometric mean 1.08^(1/2) = 1.039230)

so a kept token's term is -A x weight and its gradient d/d logprob is
-A x weight / denominator; a dropped token adds nothing and gets 0, and the
step's denominators count kept tokens / sequences only.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms import (
    IS_CORRECTIONS,
    compute_loss_denominators,
    finalize_metrics,
    get_policy_loss,
    rejection_response_mask,
)
from megatron_rl.config import AlgorithmConfig

DT = torch.float64
RHO = [[0.4, 1.5, 3.0], [1.2, 0.9, 1.0]]
MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([1.0, -2.0], dtype=DT)
GEO0, GEO1 = 1.8 ** (1 / 3), 1.08 ** 0.5


def _inputs():
    old = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.1, 0.0]], dtype=DT)
    rollout = old - torch.log(torch.tensor(RHO, dtype=DT))
    logprobs = old.clone().requires_grad_()
    return logprobs, old, rollout


def _run(loss, **options):
    cfg = AlgorithmConfig(loss=loss, eps_low=0.2, eps_high=0.2, **options)
    logprobs, old, rollout = _inputs()
    kept = rejection_response_mask(cfg, old, rollout, MASK)
    denom = compute_loss_denominators([kept], max_response_tokens=4)
    value, metrics = get_policy_loss(loss)(logprobs, old, ADV, MASK, cfg, denom, rollout_logprobs=rollout)
    (grad,) = torch.autograd.grad(value, logprobs)
    return float(value), grad, finalize_metrics(metrics), kept


# (options, kept tokens, per-token weights of seq 0 and seq 1 (None = dropped))
CASES = {
    "token": (dict(tis_mode="token"), [[0.4, 1.5, 2.0], [1.2, 0.9]]),
    "sequence": (dict(tis_mode="sequence"), [[GEO0] * 3, [GEO1] * 2]),
    "token_mask": (dict(tis_mode="token_mask"), [[0.4, 1.5, None], [1.2, 0.9]]),
    "sequence_mask": (dict(tis_mode="sequence_mask", is_upper=1.1), [[None] * 3, [GEO1] * 2]),
    "icepop": (dict(tis_mode="icepop"), [[None, 1.5, 3.0], [1.2, 0.9]]),
    "sequence_mask_tis": (dict(tis_mode="sequence_mask_tis", is_upper=1.1, tis_cap=1.02), [[None] * 3, [1.02] * 2]),
}


def test_every_registered_correction_is_worked_here():
    assert sorted(CASES) == IS_CORRECTIONS.names()


@pytest.mark.parametrize("name", sorted(CASES))
def test_dapo_value_and_gradient_by_hand(name):
    options, weights = CASES[name]
    value, grad, metrics, kept = _run("dapo", **options)
    kept_tokens = sum(w is not None for row in weights for w in row)
    # dapo: sum over kept tokens of -A_i w_t, over the kept-token count.
    expected = sum(-float(ADV[i]) * w for i, row in enumerate(weights) for w in row if w is not None) / kept_tokens
    assert value == pytest.approx(expected, rel=1e-12)
    for i, row in enumerate(weights):
        for t, w in enumerate(row):
            want = 0.0 if w is None else -float(ADV[i]) * w / kept_tokens
            assert float(grad[i, t]) == pytest.approx(want, rel=1e-12, abs=1e-15), (i, t)
            assert bool(kept[i, t]) == (w is not None)
    assert float(grad[1, 2]) == 0.0  # padding
    assert metrics["tokens/sum"] == kept_tokens and metrics["nonfinite_tokens/sum"] == 0
    assert metrics["is/masked_tokens"] == pytest.approx((5 - kept_tokens) / 5)
    assert metrics["is/masked_tokens/sum"] == 5 - kept_tokens
    dropped_sequences = sum(all(w is None for w in row) for row in weights)
    assert metrics["is/masked_sequences"] == pytest.approx(dropped_sequences / 2)
    kept_weights = [w for row in weights for w in row if w is not None]
    assert metrics["is/weight"] == pytest.approx(sum(kept_weights) / len(kept_weights), rel=1e-12)


def test_ratio_statistics_and_truncation_metrics():
    _, _, metrics, _ = _run("dapo", tis_mode="token")
    assert metrics["is/ratio"] == pytest.approx((0.4 + 1.5 + 3.0 + 1.2 + 0.9) / 5, rel=1e-12)
    assert metrics["is/ratio/min"] == pytest.approx(0.4, rel=1e-12)
    assert metrics["is/ratio/max"] == pytest.approx(3.0, rel=1e-12)
    assert metrics["is/seq_ratio"] == pytest.approx((GEO0 + GEO1) / 2, rel=1e-12)
    assert metrics["is/seq_ratio/max"] == pytest.approx(GEO0, rel=1e-12)
    assert metrics["is/truncated"] == pytest.approx(1 / 5)  # only rho = 3 exceeds C = 2
    # Engine-vs-trainer KL(pi_rollout || pi_old), k3 per token: rho - log rho - 1.
    k3 = [r - math.log(r) - 1 for r in (0.4, 1.5, 3.0, 1.2, 0.9)]
    assert metrics["mismatch/kl_k3"] == pytest.approx(sum(k3) / 5, rel=1e-10)


def test_grpo_length_and_gspo_sequence_by_hand():
    # grpo, token_mask: seq 0 keeps 2 tokens (|y_0| = 2): (-(0.4 + 1.5) / 2 + 2 (1.2 + 0.9) / 2) / 2 sequences.
    value, grad, _, _ = _run("grpo", tis_mode="token_mask")
    assert value == pytest.approx((-(0.4 + 1.5) / 2 + 2 * (1.2 + 0.9) / 2) / 2, rel=1e-12)
    assert float(grad[0, 0]) == pytest.approx(-0.4 / 2 / 2, rel=1e-12) and float(grad[0, 2]) == 0.0
    # gspo, sequence_mask below 1.1: seq 0 dropped, seq 1 (s = 1, A = -2) weighted by 1.08^(1/2), N_seq = 1.
    value, grad, metrics, _ = _run("gspo", tis_mode="sequence_mask", is_upper=1.1)
    assert value == pytest.approx(2 * GEO1, rel=1e-12)
    # d/d logprob_t of -A s with s the geometric mean: -A s / |y| per token.
    assert grad[1, :2].tolist() == pytest.approx([2 * GEO1 / 2] * 2, rel=1e-12)
    assert grad[0].abs().sum() == 0 and metrics["sequences/sum"] == 1


def test_gspo_applies_a_token_level_correction_to_each_token_by_hand():
    # The decoupled objective under gspo: token t's term -A_i s_i w_t / |y_i| (s_i = 1 here), weights min(rho_t, 2):
    # seq 0: -(0.4 + 1.5 + 2) / 3 = -1.3; seq 1: 2 (1.2 + 0.9) / 2 = 2.1; over N_seq = 2 sequences.
    value, grad, metrics, _ = _run("gspo", tis_mode="token")
    assert value == pytest.approx((-1.3 + 2.1) / 2, rel=1e-12)
    want = [[-0.4 / 3 / 2, -1.5 / 3 / 2, -2.0 / 3 / 2], [2 * 1.2 / 2 / 2, 2 * 0.9 / 2 / 2, 0.0]]
    assert grad.tolist()[0] == pytest.approx(want[0], rel=1e-12) and grad.tolist()[1] == pytest.approx(want[1], rel=1e-12, abs=0)
    assert metrics["is/truncated"] == pytest.approx(1 / 5) and metrics["sequences/sum"] == 2
    # The sequence-level correction instead weights every token of a sequence by the geometric mean.
    _, grad_seq, _, _ = _run("gspo", tis_mode="sequence")
    assert grad_seq[0].tolist() == pytest.approx([-GEO0 / 3 / 2] * 3, rel=1e-12)


def test_bounds_compare_ratios_in_log_space():
    cfg = AlgorithmConfig(loss="dapo", tis_mode="icepop", is_lower=0.39, is_upper=3.01)
    _, old, rollout = _inputs()
    kept = rejection_response_mask(cfg, old, rollout, MASK)
    assert kept[0].tolist() == [True, True, True]
    cfg = AlgorithmConfig(loss="dapo", tis_mode="icepop", is_lower=0.41, is_upper=2.99)
    assert rejection_response_mask(cfg, old, rollout, MASK)[0].tolist() == [False, True, False]
    huge = rollout.clone()
    huge[1, 0] = old[1, 0] - 80.0  # rho = e^80 (beyond the exp clamp): still dropped, never NaN
    kept = rejection_response_mask(cfg, old, huge, MASK)
    assert not bool(kept[1, 0])


@pytest.mark.parametrize("loss", ["dapo", "grpo", "gspo_token", "gspo"])
def test_all_masked_microbatch_gives_zero_loss_zero_gradient_and_is_counted(loss):
    mode = "sequence_mask" if loss == "gspo" else "icepop"
    cfg = AlgorithmConfig(loss=loss, tis_mode=mode, is_lower=0.5, is_upper=1.05, beta=0.1, entropy_coeff=0.1)
    logprobs, old, rollout = _inputs()
    rollout = old - 3.0  # rho = e^3 = 20 everywhere: outside the band
    entropy = torch.rand(2, 3, dtype=DT, requires_grad=True)
    kept = rejection_response_mask(cfg, old, rollout, MASK)
    assert not kept.any()
    denom = compute_loss_denominators([kept], max_response_tokens=4)
    value, metrics = get_policy_loss(loss)(
        logprobs, old, ADV, MASK, cfg, denom, rollout_logprobs=rollout, ref_logprobs=old - 0.3, entropy=entropy
    )
    value.backward()
    assert float(value) == 0.0 and value.requires_grad
    assert float(logprobs.grad.abs().sum()) == 0.0 and float(entropy.grad.abs().sum()) == 0.0
    final = finalize_metrics(metrics)
    assert final["is/masked_tokens"] == 1.0 and final["is/masked_tokens/sum"] == 5 and final["is/masked_sequences"] == 1.0
    assert final["tokens/sum"] == 0 and final["nonfinite_tokens/sum"] == 0


def test_no_correction_keeps_the_mask_and_defaults_sit_beside_each_entry():
    _, old, rollout = _inputs()
    assert rejection_response_mask(AlgorithmConfig(loss="dapo"), old, rollout, MASK) is MASK
    icepop = IS_CORRECTIONS.get("icepop")
    assert (icepop.level, icepop.defaults.lower, icepop.defaults.upper) == ("token", 0.5, 5.0)
    assert IS_CORRECTIONS.get("sequence").defaults.cap == 2.0
    with pytest.raises(ValueError, match=r"unknown importance-sampling correction 'tis' \(algorithm.tis_mode\)"):
        IS_CORRECTIONS.get("tis")
