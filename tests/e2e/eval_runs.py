"""The commands of tests/e2e/test_evaluation.py, made in one process (`megatron_rl.cli.main`, as typed).

    python -m tests.e2e.eval_runs OUT MODEL_DIR

On the tiny Qwen3-MoE model at MODEL_DIR, each in OUT/<name>, its standard
output in OUT/<name>.stdout:
- plain: GSPO's preset, 2 steps, a checkpoint after each;
- evaluated: the same, evaluated on eval_sets(OUT) before training and after every step;
- cli1: `megatron-rl eval` on evaluated's step-1 checkpoint (converted on the fly; an in-process engine);
- cli0: `megatron-rl eval` on the model directory (weights 0) with two vLLM servers sharing the prompts.
Each command starts its own engines and ends them.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from tests.e2e.train_runs import PARITY, REPO, run_overrides

K = 4
TRAIN = ("train.steps=2", "checkpoint.save_every=1", "checkpoint.keep_last=3")


def odd_length_reward(response: str, answer, *, prompt: str = "") -> float:
    """A reward a random model scores about half the time (response length parity): non-trivial pass@k and maj@k."""
    return float(len(response) % 2)


odd_length_reward.final_answer = lambda response: str(len(response) % 2)  # maj@k votes on the parity


def eval_sets(out: Path) -> str:
    """The data.eval_sets override: 6 prompts from two sources (k=K, the parity reward) and a second set (k=2)."""
    from megatron_rl.data.tasks import synthetic_rows

    rows = synthetic_rows("synthetic:first_letter8:6:11")
    mixed = out / "mixed.jsonl"
    if not mixed.exists():
        mixed.write_text("".join(json.dumps({**r, "data_source": "even" if i % 2 == 0 else "odd"}) + "\n" for i, r in enumerate(rows)))
    return (
        f"data.eval_sets={{mixed: {{path: {mixed}, k: {K}, reward: 'tests.e2e.eval_runs:odd_length_reward'}}, "
        "letters: {path: 'synthetic:first_letter8:3:5', k: 2, temperature: 1.0, top_p: 1.0}}"
    )


def commands(out: Path, model_dir: Path) -> dict[str, list[str]]:
    config = ["--config", str(REPO / "configs" / "tiny-gspo.yaml")]
    step1 = out / "evaluated" / "ckpt" / "step_00000001"
    return {
        "plain": ["train", *config, *run_overrides(model_dir, out / "plain"), *TRAIN],
        "evaluated": ["train", *config, *run_overrides(model_dir, out / "evaluated"), *TRAIN, "train.eval_every=1", eval_sets(out)],
        # the training runs' data.reward (PARITY) is the `letters` set's too
        "cli1": ["eval", *config, f"model.path={model_dir}", f"checkpoint.load={step1}", f"logging.dir={out / 'cli1'}", PARITY,
                 eval_sets(out)],
        "cli0": ["eval", *config, f"model.path={model_dir}", "rollout.engines=2", f"logging.dir={out / 'cli0'}", PARITY,
                 eval_sets(out)],
    }


def main(out: Path, model_dir: Path) -> None:
    from megatron_rl.cli import main as command

    for name, args in commands(out, model_dir).items():
        with open(out / f"{name}.stdout", "w") as stdout, contextlib.redirect_stdout(stdout):
            code = command(args)
        if code:
            raise SystemExit(f"{name}: megatron-rl {args[0]} exited {code}; its output: {out / f'{name}.stdout'}")


if __name__ == "__main__":
    from tests.e2e.subprocess_runs import run_as_main

    run_as_main(main)
