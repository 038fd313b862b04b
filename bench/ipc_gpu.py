"""Weights by memory handle between two processes on one device: push GB/s against a plain copy.

    python bench/ipc_gpu.py                 # on a CUDA GPU: writes bench/results/ipc_<gpu name>.json
    python bench/ipc_gpu.py --device cpu    # the host shared-memory variant of the same path (ipc_cpu.json)

The pushing process holds a bf16 model (LAYERS layers of attention and MLP
matrices) on the device and pushes it bucket by bucket as the trainer's
export yields it on the pushing rank (models.export_hf_weights(fresh=False):
its parameters themselves) through weight_sync.push's protocol with
weight_sync.ipc's IpcSender (reduce_tensor handles). By reference (the
default rows) the worker maps the parameters' own memory and copies straight
from it (weight_sync.ipc_reference: CUDA IPC handles of their blocks on a GPU,
shared memory on the host); otherwise (by_reference false: a TP gather's
results) each bucket is written into a shared buffer (the one copy on the
pushing side) while the worker loads the one before. The engine-worker
process runs the real worker extension (rollout.worker_ext: rebuild from the
handle, manifest check, streaming load) over a model runner that copies each
tensor into a torch module's parameters on the same device: what vLLM's load
does, without vLLM (its CUDA build is not installed on the GPU machine).

`--relay` measures colocated servers' form instead (weight_sync.ipc.IpcRelay):
two trainer ranks, each with an engine worker on its device; rank 0's export
is copied to rank 1 over the trainer's group (NCCL on GPUs, which needs two;
gloo on the host) and each worker maps its own rank's copy. It writes
ipc_relay_<device>.json.

Reported: push GB/s (fastest of REPEATS after a warm-up, and the median; a
plain copy of the same bytes is timed just before each push, so both see the
same load on a shared machine),
the engine-worker calls per push and the buffers the worker had to map anew
per push (weight_sync.ipc_receive.IpcReceiver keeps the mapping of a buffer the
pushing side writes again; `batch_buckets` > 1 sends that many buckets'
handles in one call),
the same bytes copied once with `Tensor.copy_` on the device in the same run
(the ratio copy time / push time says how close a push comes to moving its
bytes once), the most bytes of shared buckets alive at once on the pushing
side, and what the worker's loading held.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REPEATS = 5


def make_checkpoint(path: Path, hidden: int, layers: int) -> Path:
    """A bf16 safetensors checkpoint: per layer q/k/v/o (hidden x hidden) and gate/up/down (hidden x 4 hidden)."""
    import torch
    from safetensors.torch import save_file

    state = {}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            state[f"layers.{i}.attn.{name}.weight"] = torch.zeros(hidden, hidden, dtype=torch.bfloat16)
        for name, shape in (("gate", (4 * hidden, hidden)), ("up", (4 * hidden, hidden)), ("down", (hidden, 4 * hidden))):
            state[f"layers.{i}.mlp.{name}.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    return path


def measure(device: str, hidden: int, layers: int, bucket_mb: int, batch_buckets: int = 1,
            by_reference: bool = True) -> dict:
    import torch

    from megatron_rl.weight_sync.push import PushTarget, stream_push
    from megatron_rl.weight_sync import WeightStream, bucketize, manifest_from_checkpoint
    from megatron_rl.weight_sync.ipc import IpcSender
    from megatron_rl.weight_sync.ipc_reference import allow_by_reference
    from megatron_rl.weight_sync.stream import entries_of
    from tests.worker_process import WorkerProcess

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(Path(tmp) / "model", hidden, layers)
        manifest = manifest_from_checkpoint(model_dir)
        state = _random_state(model_dir, device)
        if by_reference:  # as the trainer's parameters for a push (weight_sync.ipc_reference; on the host they move
            allow_by_reference(list(state.values()))  # into shared memory, on a GPU their blocks are noted)
        num_bytes = sum(t.numel() * t.element_size() for t in state.values())
        buckets = list(bucketize(state.items(), bucket_mb << 20))
        worker = WorkerProcess(model_dir, device)
        answers: list = []

        def call(method, *args):
            answer = worker.call(method, *args)
            if method == "mrl_ipc_receive":
                answers.append(answer)
            return answer

        target = PushTarget("worker", call, lambda b: b, lambda: None)
        push_s, alive, staged, calls, mapped = [], 0, 0, 0, 0
        pools: list = []  # on the host the engine keeps its shared buffers across pushes (rollout.vllm_engine)

        def sender() -> IpcSender:
            made = IpcSender(torch.device(device), timeout_s=600, batch_buckets=batch_buckets,
                             pool=pools[0] if pools else None)
            if device == "cpu" and not pools:
                pools.append(made.pool)
            return made

        copy_s: list[float] = []
        plain_copy = _plain_copy(state, device)
        try:
            for version in range(1, REPEATS + 2):
                # the export's buckets as models.export_hf_weights(fresh=False) yields them on the pushing rank: its
                # parameters themselves (by reference, or written straight into the shared buffers)
                stream = WeightStream(entries_of(buckets), (list(b) for b in buckets))
                copy_time = plain_copy()  # the same bytes copied once, just before each push (a shared machine)
                if version > 1:
                    copy_s.append(copy_time)
                answers.clear()
                begin = time.perf_counter()
                result = stream_push([target], stream, version, manifest=manifest, repack_moe=False, sender=sender)
                elapsed = time.perf_counter() - begin
                if version > 1:  # the first push is a warm-up
                    push_s.append(elapsed)
                    alive, staged = max(alive, result.buffer_bytes), max(staged, result.commits[0]["peak_staged_bytes"])
                    calls, mapped = len(answers), sum(int(a.get("mapped", 0)) for a in answers)
            pushed = float(sum(t.float().sum() for t in worker.call("state").values()))
        finally:
            worker.stop()
        expected = float(sum(t.float().sum() for t in state.values()))
    return {
        "hidden": hidden, "layers": layers, "bytes": num_bytes, "bucket_mb": bucket_mb, "buckets": len(buckets),
        "batch_buckets": batch_buckets, "by_reference": by_reference, "worker_calls_per_push": calls, "worker_buffers_mapped_per_push": mapped,
        "weights_arrived": abs(pushed - expected) <= 1e-3 * max(1.0, abs(expected)),
        "push_s": [round(x, 4) for x in push_s],
        "push_gb_per_s": round(num_bytes / min(push_s) / 1e9, 3),
        "push_gb_per_s_median": round(num_bytes / statistics.median(push_s) / 1e9, 3),
        "plain_copy_gb_per_s": round(num_bytes / min(copy_s) / 1e9, 3),
        "push_vs_plain_copy_speed_ratio": round(min(copy_s) / min(push_s), 4),
        "push_vs_plain_copy_speed_ratio_median": round(statistics.median(copy_s) / statistics.median(push_s), 4),
        "peak_shared_bytes": alive,
        "peak_shared_in_buckets": round(alive / (bucket_mb << 20), 2),
        "peak_engine_worker_staged_bytes": staged,
        "peak_engine_worker_staged_in_buckets": round(staged / (bucket_mb << 20), 2),
        "peak_shared_vs_model": round(alive / num_bytes, 4),
    }


def _relay_rank(rank: int, world_size: int, init: str, model_dir: str, device: str, bucket_mb: int, out: str) -> None:
    """One trainer rank of the relay measurement (rank 0 pushes and times; each rank reports its shared bytes)."""
    import torch
    import torch.distributed as dist

    from megatron_rl.weight_sync.push import PushTarget, stream_push
    from megatron_rl.weight_sync import WeightStream, bucketize, manifest_from_checkpoint
    from megatron_rl.weight_sync.ipc import IpcRelay, IpcSender
    from megatron_rl.weight_sync.stream import entries_of
    from tests.worker_process import WorkerProcess

    on_gpu = device.startswith("cuda")
    local = torch.device(f"cuda:{rank}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init, rank=rank, world_size=world_size)
    objects = dist.new_group(backend="gloo") if on_gpu else dist.group.WORLD
    relay = IpcRelay(rank=rank, ranks=list(range(world_size)), engine_ranks=[[r] for r in range(world_size)],
                     group=dist.group.WORLD, object_group=objects, device=local)
    state = _random_state(Path(model_dir), str(local))
    buckets = list(bucketize(state.items(), bucket_mb << 20))
    workers = [WorkerProcess(Path(model_dir), str(torch.device(f"cuda:{r}") if on_gpu else "cpu"))
               for r in range(world_size)] if rank == 0 else []
    targets = [PushTarget(f"engine {r}", w.call, lambda b: b, lambda: None) for r, w in enumerate(workers)]
    push_s, peak, staged = [], 0, 0
    try:
        for version in range(1, REPEATS + 2):
            export = (list(b) if rank == 0 else [] for b in buckets)  # the parameters themselves (fresh=False)
            stream = relay.wrap(WeightStream(entries_of(buckets) if rank == 0 else [], export))
            dist.barrier()
            begin = time.perf_counter()
            if rank == 0:
                result = stream_push(targets, stream, version, manifest=manifest_from_checkpoint(model_dir),
                                     repack_moe=False, sender=lambda: IpcSender(relay=relay, timeout_s=600))
                staged = max(staged, max(c["peak_staged_bytes"] for c in result.commits))
            else:
                for _ in stream:
                    pass
            dist.barrier()
            if version > 1:  # the first push is a warm-up
                push_s.append(time.perf_counter() - begin)
            peak = max(peak, relay.pool.peak_shared_bytes)
            relay.close()
        arrived = None
        if rank == 0:
            expected = float(sum(t.float().sum() for t in state.values()))
            sums = [float(sum(t.float().sum() for t in w.call("state").values())) for w in workers]
            arrived = all(abs(x - expected) <= 1e-3 * max(1.0, abs(expected)) for x in sums)
    finally:
        for worker in workers:
            worker.stop()
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"push_s": push_s, "peak_shared_bytes": peak, "staged": staged, "arrived": arrived,
         "bytes": sum(t.numel() * t.element_size() for t in state.values()), "buckets": len(buckets)}))
    dist.destroy_process_group()


def measure_relay(device: str, hidden: int, layers: int, bucket_mb: int) -> dict:
    """Two trainer ranks, an engine worker on each one's device, the export shared by IpcRelay."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_checkpoint(Path(tmp) / "model", hidden, layers)
        mp.spawn(_relay_rank, args=(2, f"file://{tmp}/init", str(model_dir), device, bucket_mb, tmp), nprocs=2)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
        state = _random_state(model_dir, device)
    copy_s = _plain_copy_s(state, device)
    push_s, num_bytes = ranks[0]["push_s"], ranks[0]["bytes"]
    return {
        "hidden": hidden, "layers": layers, "bytes": num_bytes, "bucket_mb": bucket_mb, "buckets": ranks[0]["buckets"],
        "trainer_ranks": 2, "engines": 2, "weights_arrived": ranks[0]["arrived"],
        "push_s": [round(x, 4) for x in push_s],
        "push_gb_per_s": round(num_bytes / min(push_s) / 1e9, 3),
        "push_gb_per_s_median": round(num_bytes / statistics.median(push_s) / 1e9, 3),
        "plain_copy_gb_per_s": round(num_bytes / min(copy_s) / 1e9, 3),
        "push_vs_plain_copy_speed_ratio": round(min(copy_s) / min(push_s), 4),
        "peak_shared_bytes_per_rank": [r["peak_shared_bytes"] for r in ranks],
        "peak_shared_in_buckets_per_rank": [round(r["peak_shared_bytes"] / (bucket_mb << 20), 2) for r in ranks],
        "peak_engine_worker_staged_bytes": ranks[0]["staged"],
        "peak_shared_vs_model": round(max(r["peak_shared_bytes"] for r in ranks) / num_bytes, 4),
        "torch": torch.__version__,
    }


def _random_state(model_dir: Path, device: str) -> dict:
    import torch
    from safetensors.torch import load_file

    generator = torch.Generator(device=device).manual_seed(0)
    return {name: torch.randn(t.shape, generator=generator, device=device).to(torch.bfloat16)
            for name, t in load_file(str(model_dir / "model.safetensors")).items()}


def _plain_copy_s(state: dict, device: str) -> list[float]:
    copy = _plain_copy(state, device)
    copy()
    return [copy() for _ in range(REPEATS)]


def _plain_copy(state: dict, device: str):
    """A function timing one `Tensor.copy_` of every tensor of `state` into targets made (and touched) once."""
    import torch

    targets = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():
        targets[k].copy_(v)

    def copy() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        begin = time.perf_counter()
        for k, v in state.items():
            targets[k].copy_(v)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - begin

    return copy


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--relay", action="store_true", help="two trainer ranks, a worker on each one's device")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/ipc_gpu.py needs a CUDA GPU (none here); `--device cpu` runs the shared-memory variant")
    if args.relay and args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("bench/ipc_gpu.py --relay needs two GPUs (NCCL refuses two ranks on one); `--device cpu` "
                         "runs the shared-memory variant")
    if args.device == "cuda":
        device, name = "cuda:0", torch.cuda.get_device_name(0)
        # bf16, 16 x hidden^2 parameters a layer: 16 x 4096^2 x 2 bytes = 537 MB; 2 and 16 layers (1.1 / 8.6 GB)
        # 128 MB buckets with their handles sent 1 and 4 at a time (IpcSender.batch_buckets); the parameters'
        # own blocks by reference (CUDA IPC), and last as a TP gather's results would go: through the buffers
        runs = [(4096, 2, 512), (4096, 16, 512), (4096, 16, 128), (4096, 16, 128, 4), (4096, 16, 512, 1, False),
                (4096, 16, 128, 1, False)]
    else:
        device, name = "cpu", "cpu"
        # 16 x 1024^2 x 2 bytes = 33.5 MB a layer, 268 MB in all; the parameters in shared memory (by reference),
        # and last as a TP gather's results would go: not in shared memory, written into the buckets' buffers
        runs = [(1024, 8, 32), (1024, 8, 8), (1024, 8, 8, 4), (1024, 8, 32, 1, False), (1024, 8, 8, 1, False)]
    if args.relay:
        runs = [run[:3] for run in runs if len(run) == 3]
    load_before = round(os.getloadavg()[0], 2)
    rows = [(measure_relay if args.relay else measure)(device, *run) for run in runs]
    for row in rows:
        print(json.dumps(row), flush=True)
    result = {
        "device": name,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, torch {torch.__version__}",
        "transport": "reduce_tensor handles (CUDA IPC on a GPU, shared memory on the host), pushing process -> "
                     "engine-worker process on the same device; worker extension loading into a module's parameters",
        "dtype": "bfloat16",
        "load_average_1min": [load_before, round(os.getloadavg()[0], 2)],  # before and after: a shared machine
        "runs": rows,
        "note": "push = wall time from the first bucket to the worker's commit (with by_reference the worker copies "
                "straight from the parameters: their blocks by CUDA IPC handle, on the host in shared memory, "
                "weight_sync.ipc_reference; without, each bucket is written from the parameters into a shared "
                "buffer, the worker loading the one before meanwhile); ratio = "
                "plain-copy time / push time of the same bytes on the same device in the same run (a copy timed just "
                "before each push); shared bytes alive = buffers the pushing side kept for the worker at once.",
    }
    for by_reference in (False, True):  # the smallest buckets against the largest: one per call, the same model
        single = [r for r in rows if r.get("batch_buckets", 1) == 1 and r["bytes"] == rows[-1]["bytes"]
                  and bool(r.get("by_reference")) == by_reference]
        if len(single) >= 2:
            small, large = min(single, key=lambda r: r["bucket_mb"]), max(single, key=lambda r: r["bucket_mb"])
            result["small_vs_large_bucket_ratio" + ("_by_reference" if by_reference else "")] = {
                "buckets_mb": [small["bucket_mb"], large["bucket_mb"]],
                "ratio": round(small["push_vs_plain_copy_speed_ratio"] / large["push_vs_plain_copy_speed_ratio"], 3)}
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    if args.relay:
        result["transport"] = ("weight_sync.ipc.IpcRelay: rank 0's export copied to rank 1 over the trainer's group "
                               "(NCCL on GPUs, gloo on the host), each rank's copy shared by reduce_tensor handles "
                               "with the engine-worker process on its device")
    out = ROOT / "bench" / "results" / f"ipc_{'relay_' if args.relay else ''}{slug}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
