"""Fixtures of the e2e modules."""

from pathlib import Path

import pytest

from megatron_rl.models.tiny import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE model (seed 0) in HF format, made once per module."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny-moe", "qwen3_moe", seed=0)
