"""Rollout engine numbers on CPU: start time, generation tokens/s, routed-expert capture overhead.

    python bench/rollout.py                # writes bench/results/rollout.json

Model: the tiny Qwen3-MoE of the tests (2 layers, hidden 64, 8 experts top-2,
vocab 256, fp32). Batch: 32 prompts of 8-12 tokens x n=4 samples x 32 new
tokens (ignore_eos, so every sample has exactly 32) = 4,096 response tokens.
One in-process engine started with return_routed_experts=True (so prefix
caching is off for both modes and the comparison is only the capture);
batches with and without `return_routed_experts` alternate, REPEATS each
after a warm-up; tokens/s = response tokens / the fastest generate() (other
processes on a shared machine only ever add time; medians are reported too).
The capture ratio = fastest time with capture / fastest time without.
Engine start: wall time of VLLMEngine(...) after vLLM is imported (import
time reported separately).
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

PROMPTS, N, NEW_TOKENS, REPEATS = 32, 4, 32, 5


def main() -> None:
    from megatron_rl.config import RolloutConfig
    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.rollout import SamplingSpec, VLLMEngine

    load_start = os.getloadavg()[0]
    begin = time.perf_counter()
    import vllm  # noqa: F401

    import_s = time.perf_counter() - begin
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(4, 256) for _ in range(rng.randint(7, 11))] for _ in range(PROMPTS)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "tiny-moe", family="qwen3_moe", seed=0)
        begin = time.perf_counter()
        engine = VLLMEngine(model_dir, RolloutConfig(kv_cache_gib=0.5, max_model_len=256, return_routed_experts=True))
        start_s = time.perf_counter() - begin

        def run(capture: bool, seed: int) -> float:
            spec = SamplingSpec(n=N, max_new_tokens=NEW_TOKENS, seed=seed, ignore_eos=True, return_routed_experts=capture)
            t0 = time.perf_counter()
            rollouts = engine.generate(prompts, spec)
            seconds = time.perf_counter() - t0
            assert sum(s.response_length for s in rollouts) == PROMPTS * N * NEW_TOKENS
            assert (rollouts.samples[0].routed_experts is not None) == capture
            return seconds

        run(False, 0), run(True, 0)  # warm-up
        plain, captured = [], []
        for i in range(REPEATS):
            plain.append(run(False, i + 1))
            captured.append(run(True, i + 1))
        engine.shutdown()

    tokens = PROMPTS * N * NEW_TOKENS
    plain_best, captured_best = min(plain), min(captured)
    result = {
        "device": "cpu",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "load_average_1min_at_start_and_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "model": "tiny qwen3_moe (2 layers, hidden 64, 8 experts top-2, vocab 256, fp32)",
        "batch": {"prompts": PROMPTS, "n": N, "new_tokens": NEW_TOKENS, "response_tokens": tokens},
        "vllm_import_s": round(import_s, 2),
        "engine_start_s": round(start_s, 2),
        "generate_s": [round(x, 3) for x in plain],
        "tokens_per_s": round(tokens / plain_best, 1),
        "tokens_per_s_median": round(tokens / statistics.median(plain), 1),
        "generate_with_routed_experts_s": [round(x, 3) for x in captured],
        "tokens_per_s_with_routed_experts": round(tokens / captured_best, 1),
        "routed_experts_capture_time_ratio": round(captured_best / plain_best, 3),
        "routed_experts_capture_time_ratio_median": round(statistics.median(captured) / statistics.median(plain), 3),
    }
    out = ROOT / "bench" / "results" / "rollout.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
