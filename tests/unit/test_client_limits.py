"""Rollout client limits by hand-worked numbers: prompts in flight per engine, start-up timeouts by model size."""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError, RolloutConfig
from megatron_rl.rollout.client_limits import health_interval_s, model_gib, prompts_in_flight, start_timeout_s


def test_prompts_in_flight_fill_each_engines_sequence_slots():
    assert prompts_in_flight(256, 8) == 32  # 256 sequences / 8 samples per prompt
    assert 16 * prompts_in_flight(256, 8) == 512  # 16 engines: 8x the old fixed cap of 64
    assert prompts_in_flight(6, 2) == 3
    assert prompts_in_flight(4, 8) == 1  # a prompt bigger than the slots still runs, alone
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        prompts_in_flight(0, 4)


def test_start_up_timeout_scales_with_the_model_unless_set(tmp_path):
    with open(tmp_path / "model-00001-of-00002.safetensors", "wb") as f:
        f.truncate(6 << 30)  # sparse: 6 GiB long, no disk used
    with open(tmp_path / "model-00002-of-00002.safetensors", "wb") as f:
        f.truncate(4 << 30)
    (tmp_path / "config.json").write_text("{}")
    assert model_gib(tmp_path) == 10.0
    assert start_timeout_s(0, tmp_path) == 300 + 30 * 10
    assert start_timeout_s(120, tmp_path) == 120  # set by hand: taken as is
    assert start_timeout_s(0, None) == 300  # servers whose model is not on this machine
    assert start_timeout_s(0, tmp_path / "elsewhere") == 300


def test_health_checks_follow_the_request_timeout_up_to_30_s():
    assert health_interval_s(600) == 30 and health_interval_s(5) == 5 and health_interval_s(0.01) == 0.05


def test_timeouts_are_validated():
    RolloutConfig(server_start_timeout_s=0).validate()
    with pytest.raises(ConfigError, match="server_start_timeout_s=-1"):
        RolloutConfig(server_start_timeout_s=-1).validate()
    with pytest.raises(ConfigError, match="request_timeout_s=0"):
        RolloutConfig(request_timeout_s=0).validate()
