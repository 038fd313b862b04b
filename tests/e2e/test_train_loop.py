"""The whole RL loop with the real engine, one process: every algorithm preset, an engine restart mid-run, R3 routing,
off-policy and async runs.

GSPO's preset runs as the command a user types (`python -m megatron_rl.train`),
which also checks where its logs go; the other runs are made in one process on
shared engines (tests/e2e/loop_runs.py), each a full run of the trainer; the
off-policy and async runs, which generate beside training, are commands too. What is
checked against something independent of the loop: the engine's logprobs of
the sampled tokens equal the megatron actor's within 1e-4 after every push and
the weight version advances by one per step (check_rows), the engine's routes
equal the trainer's router, and the async stream's bound and data position
against the scenario worked by hand. Runs on two and four processes:
test_train_parallel.py (with two engines hosted by the trainer ranks); kill-and-resume and offload:
test_train_resume.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)
from megatron_rl.metrics import read_metrics
from tests.e2e.loop_runs import RUNS
from tests.e2e.subprocess_runs import run_module
from tests.e2e.train_runs import check_rows, run_ok, train_command


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return run_module("tests.e2e.loop_runs", tmp_path_factory.mktemp("loop"), timeout=600)


def test_the_command_runs_gspos_preset_with_its_logs_in_the_run_directory(model_dir, tmp_path):
    # a held-out set of 4 prompts, one sample each, scored at steps 0, 1 and 2
    extra = ["train.eval_every=1", "data.eval_sets={held: synthetic:first_letter8:4:5}"]
    result = run_ok(train_command("tiny-gspo.yaml", model_dir, tmp_path, "train.steps=2", *extra), VLLM_LOGGING_LEVEL="INFO")
    check_rows(read_metrics(tmp_path / "metrics.jsonl"), 2, mini_batches=2)
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


@pytest.mark.parametrize("preset", [name for name in RUNS if name.endswith(".yaml")])
def test_algorithm_preset_trains(runs, preset):
    run = runs / preset
    check_rows(read_metrics(run / "metrics.jsonl"), 2, mini_batches=1)  # the presets' train.mini_batches_per_step: 1
    # this run's pushes (before each of its 2 steps and after the last), each a reload in the engine, in its own log
    assert (run / "logs" / "vllm.log").read_text().count("Reloading and processing weights took") == 3
    assert (run / "ckpt" / "latest").read_text().strip() == "step_00000002"


def test_a_batch_that_fails_inside_the_engine_restarts_it_and_the_run_goes_on(runs):
    # Step 1's batch raised inside the engine's model step (after the push of the step-1 weights): the engine was
    # restarted from the model directory, given the run's weights again (exported by the actor anew) and the batch
    # generated again. The engine's logprobs equal the actor's at step 1 too (check_rows): the restarted engine serves
    # the trainer's weights, not the directory's. The restart is counted.
    run = runs / "restart"
    rows = read_metrics(run / "metrics.jsonl")
    check_rows(rows, 2, mini_batches=2)
    assert [r["rollout/engine_restarts_total"] for r in rows] == [0.0, 1.0], rows
    # the run's pushes (before each of its 2 steps and after the last) and the restarted engine's step-1 weights again
    assert (run / "logs" / "vllm.log").read_text().count("Reloading and processing weights took") == 4
    for name in RUNS:  # the runs of this engine before it did not restart it
        assert [r["rollout/engine_restarts_total"] for r in read_metrics(runs / name / "metrics.jsonl")] == [0.0, 0.0]


def test_r3_engine_routes_equal_the_trainer_router(runs):
    # The engine captures each token's top-k experts; the trainer's router, fed the same tokens
    # and weights, picks the same sets (engine_vs_trainer = 0) and replays them (drift = 0).
    rows = read_metrics(runs / "r3" / "metrics.jsonl")
    check_rows(rows, 2, mini_batches=2)
    for r in rows:
        assert r["routing/engine_vs_trainer"] < 0.01, r
        assert r["routing/drift"] == 0.0, r


def test_one_step_off_policy(model_dir, tmp_path):
    # Generation of step k+1 overlaps training of step k, so from step 1 on the samples come
    # from the weights one update behind (version k - 1) and truncated IS corrects for it.
    extra = ("train.off_policy_lag=1", "algorithm.tis_mode=sequence", "train.steps=3", "data.reward=tests.e2e.train_runs:odd_length_reward")
    run_ok(train_command("tiny-gspo.yaml", model_dir, tmp_path, *extra))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1]
    # step 0 is on-policy: the engine's logprobs are the trainer's, every importance ratio 1
    assert rows[0]["mismatch/abs_logprob_diff/max"] < 1e-4, rows[0]
    assert 1 - 1e-3 < rows[0]["is/ratio/min"] <= rows[0]["is/ratio/max"] < 1 + 1e-3, rows[0]
    assert rows[2]["mismatch/abs_logprob_diff"] > 1e-4  # the engine's policy lags the trainer's
    assert rows[2]["is/ratio/max"] - rows[2]["is/ratio/min"] > 1e-4, rows[2]  # ... and the ratios correct for it


def _consumed_groups(rows: list[dict]) -> int:
    """Prompts the asynchronous stream consumed over these steps: trained, dropped as stale, or filtered."""
    return sum(4 + int(r["async/dropped_stale_groups"]) + int(r["async/filtered_groups"]) for r in rows)


def test_async_staleness_bound_and_resume(model_dir, tmp_path):
    # Rollout runs beside training and pushes interrupt it (partial rollouts), dynamic sampling filters
    # the stream (groups of equal rewards are consumed, never trained); the second run resumes
    # the first's last checkpoint with a looser bound. Every trained group is within the bound, and
    # the data position is exactly the prompts consumed (none trained twice, in-flight ones regenerated).
    common = ("train.partial_rollouts=true", "algorithm.tis_mode=sequence_mask_tis", "checkpoint.save_every=2",
              "algorithm.dynamic_sampling=true", "data.reward=tests.e2e.train_runs:odd_length_reward")
    run_ok(train_command("tiny-gspo.yaml", model_dir, tmp_path, "train.max_staleness=1", "train.steps=4", *common))
    run_ok(train_command("tiny-gspo.yaml", model_dir, tmp_path, "train.max_staleness=2", "train.steps=6", "checkpoint.resume=auto", *common))
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
        assert "is/masked_sequences" in r and r["optimizer_steps"] == 2 * (r["step"] + 1)  # tiny-gspo: 2 mini-batches
    assert any(r["async/staleness_max"] >= 1 for r in rows[1:4]), "generation never ran ahead of training"
    assert rows[4]["rollout/weight_version"] == 4  # after the resume the stream starts on the resumed weights

    def cursor(step: int) -> int:
        state = json.loads((tmp_path / "ckpt" / f"step_{step:08d}" / "trainer_state.json").read_text())
        assert state["data"]["epoch"] == 0
        return state["data"]["cursor"]

    assert cursor(4) == _consumed_groups(rows[:4])
    assert cursor(6) == cursor(4) + _consumed_groups(rows[4:])

