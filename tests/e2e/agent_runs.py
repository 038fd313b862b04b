"""The agent demo trained twice in one process on one vLLM engine; tests/e2e/test_agent_training.py checks it.

    python -m tests.e2e.agent_runs OUT

The demo's model (tiny Qwen3-MoE) after the lookup episode's format warm-up
(megatron_rl.demo.warm_up_format(agent=True): the tool call and an answer
letter drawn independently of the tool's value), then GSPO with
configs/tiny-gspo-agent.yaml until the last 10 steps average TARGET (at most
LEARN_STEPS) synchronously (OUT/sync), then STALE_STEPS steps with max_staleness=1
(OUT/staleness_1; pushes land between engine calls, so between two turns of an episode). Each run's episodes trace is in its
directory (episodes.jsonl).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LEARN_STEPS, TARGET, WARM_UP_STEPS = 150, 0.6, 200  # TARGET: almost 5x chance (1/8), about 65 steps
STALE_STEPS = 8  # the max_staleness=1 run shows the mechanics (pushes between turns, staleness 1), not learning again


def agent_config(model_dir: Path, out: Path, *overrides: str):
    from megatron_rl.config import RLConfig, load_config

    return load_config(RLConfig, str(REPO / "configs" / "tiny-gspo-agent.yaml"), [
        f"model.path={model_dir}", f"logging.dir={out}", f"checkpoint.dir={out / 'ckpt'}", "checkpoint.save_every=0",
        "logging.progress_bar=false", f"train.steps={LEARN_STEPS}", f"train.stop_at_reward={TARGET}", *overrides,
    ])


def main(out: Path) -> None:
    from megatron_rl.demo import warm_up_format
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.rollout import make_engine
    from megatron_rl.trainer import run

    from megatron_rl.rollout.agents.lookup import install_chat_template

    model_dir = make_tiny_model_dir(out / "model", "qwen3_moe", seed=0)
    install_chat_template(model_dir)
    warm_up_format(model_dir, "synthetic:lookup8:2048", agent=True, steps=WARM_UP_STEPS)
    engine = make_engine(model_dir, agent_config(model_dir, out).rollout)
    wall = {}
    try:
        stale = ("train.max_staleness=1", "algorithm.tis_mode=token", f"train.steps={STALE_STEPS}", "train.stop_at_reward=0")
        for name, extra in (("sync", ()), ("staleness_1", stale)):
            start = time.perf_counter()
            run(agent_config(model_dir, out / name, *extra), engine=engine)
            wall[name] = time.perf_counter() - start
    finally:
        engine.shutdown()
    (out / "wall_s.json").write_text(json.dumps(wall))


if __name__ == "__main__":
    from tests.e2e.subprocess_runs import run_as_main

    run_as_main(main)
