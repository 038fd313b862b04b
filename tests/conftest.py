"""Test-wide environment: offline, quiet, deterministic, CPU."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# pytest-xdist runs N test modules at once: each worker (and what it starts, which inherits this) gets its share of
# the cores, not every core each (2 workers of 2 threads on 2 cores spin against each other: a transformers
# warm-up ran 6x slower beside another). The trainer takes OMP_NUM_THREADS as its torch threads.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    if "torch" in sys.modules:  # imported before this file: its pool may have read the environment already
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

import pytest  # noqa: E402

from tests.extras import REQUIRE_EXTRAS, missing_reason, registry_unreachable  # noqa: E402


def pytest_collection_modifyitems(config, items):
    _skip_missing_extras(items)
    _skip_gpu_tests(items)
    _skip_network_tests(items)


def _skip_network_tests(items):
    """Tests marked network (they download from the registry) are skipped, saying so, where it is unreachable
    (an air-gapped GPU node); the registry is asked once, and only when such a test was collected."""
    marked = [item for item in items if "network" in item.keywords]
    reason = registry_unreachable() if marked else None
    for item in marked if reason else []:
        item.add_marker(pytest.mark.skip(reason=reason))


def _skip_missing_extras(items):
    """A test marked extra(name, *modules) is skipped, naming the extra to install, when a module (or a
    'bin:NAME' executable) is absent (tests/extras.py)."""
    if REQUIRE_EXTRAS:
        return
    for item in items:
        for mark in item.iter_markers("extra"):
            extra, *modules = mark.args
            reason = missing_reason(extra, modules)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


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


def pytest_collection_finish(session):
    """What the collected modules imported (torch, megatron-core, vLLM, transformers: about 650k objects) lives as
    long as the session: frozen, the interpreter's automatic full collections during the tests pass it by."""
    import gc

    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    """And the collections at the interpreter's exit (cli.finished does the same for the project's processes)."""
    import gc

    gc.freeze()
