"""Start time of a vLLM engine whose core runs in a process of its own, with its worker inside that core or spawned.

    python bench/engine_start.py          # writes bench/results/engine_start.json

Two engines on the tiny Qwen3-MoE (the e2e tests'), float32, a 0.25 GiB KV cache:
- server: a VLLMServer (`python -m vllm.entrypoints.openai.api_server`), timed from its start to /health answering;
- multiprocess: an in-process VLLMEngine with rollout.multiprocessing=true (the engine core in a child process: what
  rank 0 of every multi-rank trainer run starts), timed over vllm.LLM's construction.
Each then generates 64 prompts x 4 samples x 48 tokens once to warm up and 3 times timed (the median: tokens/s).
Each in two variants: "core" (the worker inside the engine-core process, rollout.engine_env.worker_in_engine_core, a
server's with every CPU but one for its model's threads, rollout.engine_env.engine_core_worker_threads: what the
project does on CPU) and "spawned" (vLLM's CPU default, its mp executor: one more interpreter, asked for with
VLLM_ENABLE_V1_MULTIPROCESSING=1 in the server's environment, or distributed_executor_backend="uni", which the CPU
platform turns into "mp"). Every start is a fresh interpreter; the variants alternate, REPEATS each, so both see the
same machine load. Reported: the start seconds, vLLM's processes below the engine, the generation tokens/s, and the
ratios of the medians.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPEATS = 3

CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from megatron_rl.config import RolloutConfig
from tests.e2e.vllm_helpers import vllm_processes_below
kind, variant, model = sys.argv[1], sys.argv[2], sys.argv[3]


def generate(engine):
    # 64 prompts x 4 samples x 48 new tokens (EOS ignored), once to warm up, then 3 times timed: the median
    import statistics, time
    from megatron_rl.rollout import SamplingSpec
    prompts = [[1, 5 + i % 40, 6 + i % 30, 7, 8 + i % 20] for i in range(64)]
    spec = SamplingSpec(n=4, max_new_tokens=48, seed=1, temperature=1.0, ignore_eos=True)
    engine.generate(prompts, spec)
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        rollouts = engine.generate(prompts, spec)
        rates.append(sum(len(s.response_token_ids) for s in rollouts) / (time.perf_counter() - start))
    return round(statistics.median(rates))

if kind == "server":
    from megatron_rl.rollout import VLLMServer
    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=128)
    env = {} if variant == "core" else {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    server = VLLMServer(model, config, log_path=Path(model).parent / "server.log", env=env)
    server.start()
    seconds, processes = server.start_seconds, vllm_processes_below(server.process.pid)
    from megatron_rl.rollout import VLLMServerEngine
    engine = VLLMServerEngine([server], config)
    tokens_per_s = generate(engine)
    engine.shutdown()
else:
    from megatron_rl.rollout import VLLMEngine
    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=128, multiprocessing=True)
    kwargs = {} if variant == "core" else {"distributed_executor_backend": "uni"}
    engine = VLLMEngine(model, config, engine_kwargs=kwargs)
    core = engine._llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid
    seconds, processes = engine.start_seconds, ["VLLM::EngineCore", *vllm_processes_below(core)]
    tokens_per_s = generate(engine)
    engine.shutdown()
print("RESULT " + json.dumps({"start_s": round(seconds, 2), "processes": processes, "generate_tokens_per_s": tokens_per_s}))
"""


def _run(kind: str, variant: str, model_dir: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", CHILD, kind, variant, str(model_dir), str(ROOT)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"{kind} {variant} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    from megatron_rl.models.tiny import make_tiny_model_dir

    load_start = os.getloadavg()[0]
    runs: dict[str, dict[str, list[dict]]] = {kind: {"core": [], "spawned": []} for kind in ("server", "multiprocess")}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "model" / "tiny-moe", "qwen3_moe", seed=0)
        for _ in range(REPEATS):
            for kind, variants in runs.items():
                for variant in variants:
                    variants[variant].append(_run(kind, variant, model_dir))
                    print(kind, variant, variants[variant][-1], flush=True)
    median = {kind: {v: statistics.median(r["start_s"] for r in rs) for v, rs in variants.items()} for kind, variants in runs.items()}
    speed = {kind: {v: statistics.median(r["generate_tokens_per_s"] for r in rs) for v, rs in variants.items()}
             for kind, variants in runs.items()}
    result = {
        "what": __doc__.split("\n\n")[0].strip() + " (bench/engine_start.py docstring)",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2)},
        "runs": runs,
        "median_start_s": median,
        "ratio_core_over_spawned": {kind: round(m["core"] / m["spawned"], 2) for kind, m in median.items()},
        "median_generate_tokens_per_s": speed,
        "generate_ratio_core_over_spawned": {kind: round(m["core"] / m["spawned"], 2) for kind, m in speed.items()},
    }
    out = ROOT / "bench" / "results" / "engine_start.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_start_s", "ratio_core_over_spawned", "median_generate_tokens_per_s",
                                             "generate_ratio_core_over_spawned")}, indent=1))


if __name__ == "__main__":
    main()
