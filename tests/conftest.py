"""Test-wide environment: offline, quiet, deterministic, CPU."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402

# `make test` installs every CPU extra and sets this: there a missing extra fails its tests instead of skipping them.
REQUIRE_EXTRAS = os.environ.get("MEGATRON_RL_REQUIRE_EXTRAS") == "1"


def pytest_collection_modifyitems(config, items):
    _skip_missing_extras(items)
    _skip_gpu_tests(items)


def _skip_missing_extras(items):
    """A test marked extra(name, *modules) is skipped, naming the extra to install, when a module is absent."""
    if REQUIRE_EXTRAS:
        return
    for item in items:
        for mark in item.iter_markers("extra"):
            extra, *modules = mark.args
            missing = [m for m in modules if not _importable(m)]
            if missing:
                reason = f"needs the {extra} extra ({', '.join(missing)} not installed): pip install -e '.[{extra}]'"
                item.add_marker(pytest.mark.skip(reason=reason))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder refusing it, or a module left as None in sys.modules
        return False


def _skip_gpu_tests(items):
    """GPU tests are skipped, saying why, when no CUDA device is present."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
