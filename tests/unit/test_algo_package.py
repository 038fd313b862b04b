"""megatron_rl.algorithms stays pure torch, never syncs inside the loss, and agrees with the config."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms import ADVANTAGES, IS_CORRECTIONS, POLICY_LOSSES, NonFiniteLogprobsError, check_finite_logprobs, check_step_metrics
from megatron_rl.config import AlgorithmConfig, ConfigError, from_dict
from megatron_rl.config.algorithm import (
    ADVANTAGE_NAMES, IS_CORRECTION_NAMES, POLICY_LOSS_NAMES, TOKEN_LEVEL_IS_CORRECTIONS, TRUNCATING_IS_CORRECTIONS,
)

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl" / "algorithms"


def test_no_host_sync_call_in_the_package():
    for path in PACKAGE.glob("*.py"):
        assert ".item(" not in path.read_text(), f"{path.name} calls .item(): a host sync (use tensors, or .tolist() outside the loss)"


def test_imports_nothing_of_the_project_and_no_megatron_or_vllm():
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in ("megatron", "vllm", "transformer_engine"), f"{path.name} imports {name}"
                if top == "megatron_rl":
                    assert name.startswith("megatron_rl.algorithms"), f"{path.name} imports {name}"


def test_config_names_match_the_registries():
    assert list(POLICY_LOSS_NAMES) == POLICY_LOSSES.names()
    assert list(ADVANTAGE_NAMES) == ADVANTAGES.names()
    assert list(IS_CORRECTION_NAMES) == IS_CORRECTIONS.names()
    assert sorted(TOKEN_LEVEL_IS_CORRECTIONS) == sorted(n for n in IS_CORRECTIONS.names() if IS_CORRECTIONS.get(n).level == "token")
    assert sorted(TRUNCATING_IS_CORRECTIONS) == sorted(n for n in IS_CORRECTIONS.names() if not IS_CORRECTIONS.get(n).drops)
    with pytest.raises(ConfigError, match="valid names: none, icepop, sequence"):
        from_dict(AlgorithmConfig, {"tis_mode": "tis"})
    with pytest.raises(ConfigError, match="is_lower=3.0, algorithm.is_upper=2.0"):
        from_dict(AlgorithmConfig, {"loss": "dapo", "tis_mode": "icepop", "is_lower": 3.0, "is_upper": 2.0})
    with pytest.raises(ConfigError, match="set tis_mode=none"):
        from_dict(AlgorithmConfig, {"bypass_mode": True, "tis_mode": "sequence"})
    with pytest.raises(ConfigError, match="routing_replay=R3"):
        from_dict(AlgorithmConfig, {"bypass_mode": True, "routing_replay": "R2"})
    with pytest.raises(ConfigError, match="valid names: dapo, dr_grpo, grpo, gspo, gspo_token"):
        from_dict(AlgorithmConfig, {"loss": "ppo"})
    assert from_dict(AlgorithmConfig, {"loss": "gspo", "tis_mode": "token"}).tis_mode == "token"  # applied per token
    assert from_dict(AlgorithmConfig, {"loss": "dapo"}).eps_high is None  # the loss's default applies


def test_check_finite_logprobs():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    old = torch.tensor([[0.0, float("nan"), float("nan")], [-1.0, 0.0, 0.0]])
    assert check_finite_logprobs(mask, old_logprobs=old, ref_logprobs=None) == {"old_logprobs": 1}
    with pytest.raises(NonFiniteLogprobsError, match="all 3 response tokens have a NaN or inf rollout_logprobs"):
        check_finite_logprobs(mask, old_logprobs=old, rollout_logprobs=torch.full((2, 3), float("inf")))
    assert check_finite_logprobs(torch.zeros(2, 3, dtype=torch.bool), old_logprobs=old) == {"old_logprobs": 0}
    with pytest.raises(ValueError, match="shape"):
        check_finite_logprobs(mask, old_logprobs=old[:, :2])
    check_step_metrics({"tokens/sum": 3.0, "nonfinite_tokens/sum": 1.0})
    with pytest.raises(NonFiniteLogprobsError, match="every one of the step's 4 response tokens"):
        check_step_metrics({"tokens/sum": 0.0, "nonfinite_tokens/sum": 4.0})


def test_corrections_that_say_they_drop_nothing_keep_every_token():
    from megatron_rl.algorithms.importance import get_is_correction, is_correction_params

    log_rho = torch.tensor([[-30.0, -2.0, -0.5, 0.0, 0.5, 2.0, 30.0]])
    for name in IS_CORRECTIONS.names():
        entry = get_is_correction(name)
        params = is_correction_params(AlgorithmConfig(loss="dapo", tis_mode=name))
        _, keep, _ = entry.weights(log_rho, params)
        assert bool(keep.all()) == (not entry.drops), name  # a dropping one drops ratios of e^-30 or e^30
