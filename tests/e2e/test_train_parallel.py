"""The RL loop on two and four trainer processes (torchrun) with the real engine: expert, context and tensor parallel.

What is checked against something independent of the loop: the engine's
logprobs equal the sharded actor's after every push (check_rows), also when
the actor's experts are GroupedMLP (EP2) and when owner ranks push their own
shards as sparse deltas (TP2 x EP2); context parallel's first step equals one
process's.
"""

from __future__ import annotations

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)
from megatron_rl.metrics import read_metrics
from tests.e2e.train_runs import check_rows, run_ok, train_command


def test_two_processes_expert_parallel_grouped_experts_on_a_tiny_model_the_preset_builds(tmp_path):
    # The routed experts as megatron-core's GroupedMLP (fused weight1 / weight2 per EP rank): its export pushes
    # them to the engine, whose logprobs must equal the actor's (check_rows). The colocated run below keeps
    # SequentialMLP experts.
    model_dir = tmp_path / "models" / "tiny-moe"  # absent: both ranks start at once and one of them builds it
    run_ok(train_command("tiny-gspo-cpu2.yaml", model_dir, tmp_path / "run", "train.steps=2", "model.moe_grouped_gemm=true",
                  "model.make_tiny=true", nproc=2),
         timeout=400)
    check_rows(read_metrics(tmp_path / "run" / "metrics.jsonl"), 2)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny-moe.lock", "tiny-moe"]  # no half-built copy


def test_context_parallel_packed_first_step_equals_one_process(model_dir, tmp_path):
    """`megatron-rl train` on two processes with parallel.context_parallel=2 and packed sequences, as users run it
    (rank 0 generates, actor.distribute shares the step, each CP rank trains its chunks of every sequence):
    the first step's loss, response-token count and gradient norm equal one process's within 1e-5 relative.
    One optimizer step per RL step, so every number is taken at the same weights."""
    common = ("train.steps=1", "train.mini_batches_per_step=1", "train.pack_sequences=true",
              "train.max_tokens_per_microbatch=256")
    run_ok(train_command("tiny-gspo.yaml", model_dir, tmp_path / "one", *common))
    run_ok(train_command("tiny-gspo-cpu2.yaml", model_dir, tmp_path / "cp2", *common, "parallel.expert_parallel=1",
                  "parallel.context_parallel=2", nproc=2), timeout=400)
    (one,), (cp2,) = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "cp2" / "metrics.jsonl")
    assert one["response/length_mean"] == cp2["response/length_mean"]  # the same samples (same seed, same engine)
    assert one["tokens/sum"] == cp2["tokens/sum"] > 0, (one["tokens/sum"], cp2["tokens/sum"])
    for key in ("loss/sum", "grad_norm"):
        assert abs(cp2[key] - one[key]) <= 1e-5 * abs(one[key]), (key, one[key], cp2[key])
    assert one["batch/packed_fraction"] == cp2["batch/packed_fraction"] == 1.0


def test_tp2_ep2_trainer_pushes_exact_weights(model_dir, tmp_path):
    # 4 trainer processes (TP2 x EP2, expert TP 1): after each step's gather + push the
    # engine's logprobs of its own samples equal the sharded actor's (checked in check_rows).
    layout = ("parallel.tensor_parallel=2", "parallel.expert_parallel=2", "cluster.cpu_processes=4")
    run_ok(train_command("tiny-gspo.yaml", model_dir, tmp_path, "train.steps=2", *layout, nproc=4), timeout=600)
    check_rows(read_metrics(tmp_path / "metrics.jsonl"), 2)


def test_tp2_ep2_owners_push_their_own_shards_as_sparse_deltas(model_dir, tmp_path):
    # the same with rollout.weight_senders=owners (every owner rank broadcasts its own buckets into the engine
    # process's worker) and sparse deltas after the first push: the engine's logprobs still equal the actor's
    layout = ("parallel.tensor_parallel=2", "parallel.expert_parallel=2", "cluster.cpu_processes=4")
    owners = ("rollout.weight_senders=owners", "rollout.weight_delta=true", "rollout.weight_bucket_mb=0.05")
    result = run_ok(train_command("tiny-gspo.yaml", model_dir, tmp_path, "train.steps=3", *layout, *owners, nproc=4), timeout=600)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    check_rows(rows, 3)
    # the push before step 0 goes in full (no base); those after steps 0, 1, 2 as deltas (each tensor's checksum
    # checked on the engine's worker: a wrong bit breaks the push)
    # (a step whose rewards are all equal leaves the weights as they were: its delta carries nothing)
    assert [r["weight_sync/delta"] for r in rows] == [1.0, 1.0, 1.0], rows
    assert "Traceback" not in result.stderr

