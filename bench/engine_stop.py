"""Shutdown time of a vLLM engine, the project's against vLLM's own: an engine whose core runs in a process of its own,
and an in-process engine's last shutdown in a process that ends after it (a `megatron-rl train` or `eval` process).

    python bench/engine_stop.py          # writes bench/results/engine_stop.json

On the tiny Qwen3-MoE (the e2e tests'), float32, a 0.25 GiB KV cache, two variants built from the same vllm.LLM
arguments (VLLMEngine.engine_args):
- "project": VLLMEngine. With rollout.multiprocessing=true (what rank 0 of every multi-rank trainer run starts on the
  CPU: the worker inside the engine core) its core imports the worker extension (megatron_rl.rollout.worker_ext), which
  keeps the heap frozen through the core's shutdown and at its exit; in-process, the process says that it ends after
  its closes (megatron_rl.heap.process_ends_after_close, as the CLI does), and the heap stays frozen through the
  engine's shutdown;
- "vllm": vllm.LLM with the same arguments less the worker extension, shut down as vLLM does.
Each generates once (so the core has served), then is timed from the shutdown call to its return
(llm_engine.engine_core.shutdown(), which waits for a core process to be gone).
And a server (rollout.server_supervisor.VLLMServer, what colocated and evaluation engines start), after one completion,
timed from the stop until:
- "project": VLLMServer.stop(), every process the server started is dead (the API server, its engine core, and the
  resource tracker the API server leaves orphaned, killed: dead means gone or a zombie its new parent has yet to reap);
- "vllm": the API server process has exited after SIGTERM (vLLM's own stop; its orphaned tracker exits on its own
  later, and an engine core whose API server died alone is left running);
- "reaped": as "project", but waiting until the killed orphans are reaped (psutil.wait_procs: the stop before this
  was measured), which only their new parent, the system's init, can do.
Every run is a fresh interpreter whose long-lived imports are frozen first (megatron_rl.heap.import_long_lived, as
trainer.run does); the variants alternate, REPEATS each. Reported: the seconds, their medians and the ratios of the
medians to vLLM's.
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
import json, sys, time
sys.path.insert(0, sys.argv[4])
from megatron_rl.config import RolloutConfig
from megatron_rl.heap import TRAINER_PACKAGES, import_long_lived, process_ends_after_close
from megatron_rl.rollout import SamplingSpec, VLLMEngine
case, variant, model = sys.argv[1], sys.argv[2], sys.argv[3]


def server():
    import os, signal, httpx, psutil
    from megatron_rl.rollout.server_auth import auth_headers
    from megatron_rl.rollout.server_supervisor import VLLMServer
    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=128)
    server = VLLMServer(model, config, log_path=os.devnull)
    server.start()
    answer = httpx.post(f"{server.url}/v1/completions", headers=auth_headers(server.token), timeout=60,
                        json={"model": str(server.model_dir), "prompt": [1, 5, 6, 7, 8], "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    start = time.perf_counter()
    if variant == "project":
        server.stop()
    else:
        process, below = server.process, list(server._below)
        os.killpg(process.pid, signal.SIGTERM)
        process.wait()
        if variant == "reaped":
            for each in below:
                try:
                    each.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(below, timeout=5)
    seconds = time.perf_counter() - start
    server.stop()
    return seconds


def main():
    if case == "server":
        print("RESULT " + json.dumps({"shutdown_s": round(server(), 2)}), flush=True)
        return
    if case == "in_process" and variant == "project":
        process_ends_after_close()
    import_long_lived(*TRAINER_PACKAGES)
    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=128, multiprocessing=case == "multiprocess")
    engine = VLLMEngine(model, config)
    engine.generate([[1, 5, 6, 7, 8]], SamplingSpec(n=2, max_new_tokens=8, seed=1))
    if variant == "vllm":
        import vllm
        args = engine.engine_args()
        del args["worker_extension_cls"]
        engine.shutdown()
        from megatron_rl.rollout.engine_env import engine_core_environment, environment_set
        with environment_set(engine_core_environment(config)):  # the core's threads, as VLLMEngine gives them
            llm = vllm.LLM(**args)
        llm.generate([{"prompt_token_ids": [1, 5, 6, 7, 8]}], vllm.SamplingParams(max_tokens=8))
        start = time.perf_counter()
        llm.llm_engine.engine_core.shutdown()
    else:
        start = time.perf_counter()
        engine.shutdown()
    print("RESULT " + json.dumps({"shutdown_s": round(time.perf_counter() - start, 2)}), flush=True)


if __name__ == "__main__":
    main()
    from megatron_rl.cli import finished
    sys.exit(finished(0))
"""

CASES = {"multiprocess": ("project", "vllm"), "in_process": ("project", "vllm"), "server": ("project", "vllm", "reaped")}


def _run(case: str, variant: str, model_dir: Path, script: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(script), case, variant, str(model_dir), str(ROOT)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"{case} {variant} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])


def main() -> None:
    from megatron_rl.models.tiny import make_tiny_model_dir

    load_start = os.getloadavg()[0]
    runs: dict[str, dict[str, list[dict]]] = {case: {variant: [] for variant in variants} for case, variants in CASES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "model" / "tiny-moe", "qwen3_moe", seed=0)
        script = Path(tmp) / "child.py"  # a file, not -c: the engine core is spawned and imports its parent's main
        script.write_text(CHILD)
        for _ in range(REPEATS):
            for case, variants in CASES.items():
                for variant in variants:
                    runs[case][variant].append(_run(case, variant, model_dir, script))
                    print(case, variant, runs[case][variant][-1], flush=True)
    median = {case: {variant: statistics.median(r["shutdown_s"] for r in rows) for variant, rows in by.items()}
              for case, by in runs.items()}
    result = {
        "what": __doc__.split("\n\n")[0].strip() + " (bench/engine_stop.py docstring)",
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                    "load_start": round(load_start, 2), "load_end": round(os.getloadavg()[0], 2)},
        "runs": runs,
        "median_shutdown_s": median,
        "ratio_over_vllm": {case: {variant: round(m[variant] / m["vllm"], 2) for variant in m if variant != "vllm"}
                            for case, m in median.items()},
    }
    out = ROOT / "bench" / "results" / "engine_stop.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_shutdown_s", "ratio_over_vllm")}, indent=1))


if __name__ == "__main__":
    main()
