"""`megatron-rl plan` on CPU clusters: the machine's memory is the budget, shared by the trainer processes on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.plan.memory import GIB
from megatron_rl.plan.report import plan_preset

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _machine_bytes() -> int:
    """MemTotal of /proc/meminfo, or the cgroup's memory limit where lower (read here, not through the planner)."""
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = Path(path).read_text().strip() if Path(path).exists() else ""
        if text.isdigit():
            total = min(total, int(text))
    return total


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="no /proc/meminfo on this system (Linux only)")
@pytest.mark.parametrize(("preset", "processes"), [("tiny-gspo.yaml", 1), ("tiny-gspo-cpu2.yaml", 2)])
def test_a_cpu_run_is_judged_by_the_machines_memory(preset, processes):
    plan = plan_preset(str(CONFIGS / preset))
    assert plan.budget == _machine_bytes() - processes * GIB  # each process's runtime (python, torch, megatron-core)
    peak = plan.peak
    # every rank holds an actor; rank 0 also the engine: the others' actors count against the same memory
    assert plan.need(peak) == pytest.approx(peak.total + (processes - 1) * peak.actor)
    assert plan.fits and "of this machine's memory" in plan.verdict()


def test_the_cpu_engine_counts_its_packed_embedding_and_output_layer():
    plan = plan_preset(str(CONFIGS / "tiny-gspo.yaml"))
    spec, engine = plan.spec, plan.engine
    vocab_matrix = 256 * 64 * 4  # the tiny model: vocabulary 256 (padded to 256) x hidden 64, fp32
    assert spec.padded_vocab(1) * spec.hidden_size * 4 == vocab_matrix
    # weights + a packed copy of the embedding and of the output layer + rollout.kv_cache_gib (1.0) + vLLM's 0.7 GiB
    assert engine.reserved == pytest.approx(spec.total_params() * 4 + 2 * vocab_matrix + 1.0 * GIB + 0.7 * GIB)


def test_a_cpu_run_over_the_machines_memory_says_so_in_its_terms():
    plan = plan_preset(str(CONFIGS / "tiny-gspo.yaml"), ["rollout.kv_cache_gib=100000"])
    verdict = plan.verdict()
    assert not plan.fits and "does not fit: in the training phase the run needs" in verdict
    assert "but this machine has" in verdict and "device" not in verdict
    assert verdict.endswith("100000 of them its KV cache: lower rollout.kv_cache_gib")
