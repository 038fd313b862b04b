"""The one-process runs of tests/e2e/test_train_loop.py, in one process on shared vLLM engines.

    python -m tests.e2e.loop_runs OUT

On the tiny Qwen3-MoE model (seed 0, OUT/model), each a full `trainer.run` of its
preset with the e2e runs' overrides (tests/e2e/train_runs.run_overrides), in
OUT/<name>:
- the algorithm presets other than GSPO (tiny-dapo, tiny-dr_grpo, tiny-grpo),
  2 steps each (GSPO's preset runs as its own command in the test, which checks
  what the command prints and logs), on one engine started once;
- restart: GSPO's preset, 2 steps, last on that engine; once the weights of
  step 1 are in, its batch fails inside the engine (fail_after_push): the engine
  restarts in the middle of the run, gets the run's weights again (exported by
  the actor anew) and the run goes on;
- then r3 (routing replay from the engine's routes) on a second engine that
  returns them.
Each run's first push puts its own initial weights into the engine, so runs do
not see each other's updates. The runs that generate beside training (off-policy,
async) stay commands of their own in the test: as the fourth run of a process
whose earlier runs had ended, one-step off-policy's first training forward once
found megatron's tensor-parallel group None. An engine restart then destroyed the
trainer's groups (no longer: rollout.vllm_engine, "Process groups"); whether one
caused that failure is not known.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.e2e.train_runs import REPO, run_overrides

ODD_LENGTH = "data.reward=tests.e2e.train_runs:odd_length_reward"
RUNS = {
    "tiny-dapo.yaml": ("tiny-dapo.yaml", "train.steps=2", ODD_LENGTH),
    "tiny-dr_grpo.yaml": ("tiny-dr_grpo.yaml", "train.steps=2"),
    "tiny-grpo.yaml": ("tiny-grpo.yaml", "train.steps=2"),
}
"""Run name -> preset and overrides."""
RESTART = ("tiny-gspo.yaml", "train.steps=2", "train.offload=all")
"""The actor's state on the host while the engine generates: the restarted engine's re-export brings the
parameters back for itself (Trainer._reexport)."""
R3 = ("tiny-gspo.yaml", "algorithm.routing_replay=R3", "rollout.return_routed_experts=true", "train.steps=2")


def config(model_dir: Path, out: Path, preset: str, *overrides: str):
    from megatron_rl.config import RLConfig, load_config

    return load_config(RLConfig, str(REPO / "configs" / preset), [*run_overrides(model_dir, out), *overrides])


def fail_after_push(engine, version: int) -> None:
    """Once weight `version` is pushed into the in-process `engine`, its next model step raises (once)."""
    from tests.e2e.vllm_helpers import fail_next_step

    push = engine.update_weights

    def update_weights(buckets, pushed: int, **kwargs):
        result = push(buckets, pushed, **kwargs)
        if pushed == version:
            engine.update_weights = push
            engine._llm.collective_rpc(fail_next_step)
        return result

    engine.update_weights = update_weights


def main(out: Path) -> None:
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.rollout import make_engine
    from megatron_rl.trainer import run

    model_dir = make_tiny_model_dir(out / "model", "qwen3_moe", seed=0)
    wall = {}

    def train(engine, name: str, preset: str, *overrides: str) -> None:
        start = time.perf_counter()
        run(config(model_dir, out / name, preset, *overrides), engine=engine)
        wall[name] = time.perf_counter() - start

    for runs in ({**RUNS, "restart": RESTART}, {"r3": R3}):
        first = next(iter(runs.values()))
        engine = make_engine(model_dir, config(model_dir, out / "engine", *first).rollout)
        try:
            for name, (preset, *overrides) in runs.items():
                if name == "restart":
                    fail_after_push(engine, version=1)
                train(engine, name, preset, *overrides)
        finally:
            engine.shutdown()
    (out / "wall_s.json").write_text(json.dumps(wall))


if __name__ == "__main__":
    from tests.e2e.subprocess_runs import run_as_main

    run_as_main(main)
