"""Peak memory and time of checkpoint conversion on a model of a few hundred MB (CPU).

    python bench/convert_memory.py          # writes bench/results/convert_memory.json

Model: Qwen3-MoE, 8 layers, hidden 512, 32 experts of width 256, fp32: about
430 MB of weights, saved by transformers in ~50 MB safetensors shards.

Each measurement runs in a fresh process that first converts a tiny model
both ways (imports, the gloo process group, allocator pools), then takes the
baseline and converts the big one. A thread samples /proc/self/status every
2 ms: VmRSS (resident), RssAnon (heap: tensors) and RssFile (resident pages of
memory-mapped files, i.e. safetensors shards being read); "growth" is peak
minus baseline.

Compared:
  hf_to_mcore            tools/convert_hf_to_mcore.py's library call (streaming, 512 MiB data files)
  hf_to_mcore_64MiB_files  the same with --max-file-size 64MiB
  mcore_to_hf            tools/convert_mcore_to_hf.py's, --bucket-size 64MiB (streaming)
  mcore_to_hf_default    the same with the default 1 GiB bucket (the whole model fits in one)
  build_and_save         what conversion costs without streaming: build the model,
                         load the HF weights (models/loading.py), dist_checkpointing.save
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = dict(
    family="qwen3_moe",
    with_tokenizer=False,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    moe_intermediate_size=256,
    intermediate_size=1024,
    max_shard_size="50MB",
)


def _status() -> dict[str, float]:
    fields = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return fields


class _Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _status()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now = _status()
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}
            time.sleep(0.002)


def _warm_up(tmp: str) -> None:
    """Convert a tiny model both ways first: imports, process group and allocator pools belong to the baseline."""
    from megatron_rl.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf
    from megatron_rl.models.tiny import make_tiny_model_dir

    tiny = make_tiny_model_dir(f"{tmp}/tiny", family="qwen3_moe", with_tokenizer=False)
    convert_hf_to_mcore(tiny, f"{tmp}/tiny-mcore")
    convert_mcore_to_hf(f"{tmp}/tiny-mcore", f"{tmp}/tiny-hf")


def _child(mode: str, src: str, dst: str) -> dict:
    import warnings

    warnings.simplefilter("ignore")
    from megatron_rl.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf

    with tempfile.TemporaryDirectory() as tmp:
        _warm_up(tmp)
    baseline = _status()
    sampler = _Sampler()
    sampler.start()
    start = time.perf_counter()
    if mode == "hf_to_mcore":
        convert_hf_to_mcore(src, dst)
    elif mode == "hf_to_mcore_64MiB_files":
        convert_hf_to_mcore(src, dst, max_file_size="64MiB")
    elif mode == "mcore_to_hf":
        convert_mcore_to_hf(src, dst, bucket_size="64MiB")
    elif mode == "mcore_to_hf_default":
        convert_mcore_to_hf(src, dst)
    elif mode == "build_and_save":
        from megatron.core import dist_checkpointing

        from megatron_rl.config import ModelConfig, ParallelConfig
        from megatron_rl.models import build_model, load_hf_config, model_shape
        from megatron_rl.parallel import destroy_parallel, init_parallel

        ctx = init_parallel(ParallelConfig(backend="gloo"), shape=model_shape(load_hf_config(src)))
        (model,) = build_model(ModelConfig(path=src), ctx)
        os.makedirs(dst)
        dist_checkpointing.save(model.sharded_state_dict(), dst)
        destroy_parallel(ctx)
    seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    peak = sampler.peak
    return {
        "seconds": round(seconds, 2),
        "baseline_mib": {k: round(v) for k, v in baseline.items()},
        "peak_mib": {k: round(v) for k, v in peak.items()},
        "growth_mib": {k: round(peak[k] - baseline[k]) for k in peak},
    }


def _run(mode: str, src: str, dst: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, src, dst], capture_output=True, text=True, check=False, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    if done.returncode:
        raise RuntimeError(f"{mode} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from megatron_rl.models.tiny import make_tiny_model_dir

    with tempfile.TemporaryDirectory(prefix="convert-bench-") as tmp:
        hf_dir = make_tiny_model_dir(Path(tmp) / "hf", seed=0, **MODEL)
        weights_mib = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors")) / 2**20
        shards = len(list(hf_dir.glob("*.safetensors")))
        largest_shard_mib = max(p.stat().st_size for p in hf_dir.glob("*.safetensors")) / 2**20
        results = {
            "hf_to_mcore": _run("hf_to_mcore", str(hf_dir), f"{tmp}/mcore"),
            "hf_to_mcore_64MiB_files": _run("hf_to_mcore_64MiB_files", str(hf_dir), f"{tmp}/mcore-64"),
            "mcore_to_hf": _run("mcore_to_hf", f"{tmp}/mcore", f"{tmp}/back"),
            "mcore_to_hf_default": _run("mcore_to_hf_default", f"{tmp}/mcore", f"{tmp}/back-default"),
            "build_and_save": _run("build_and_save", str(hf_dir), f"{tmp}/megatron-save"),
        }
    report = {
        "model": {k: v for k, v in MODEL.items() if k != "with_tokenizer"},
        "weights_mib": round(weights_mib),
        "hf_shards": shards,
        "largest_shard_mib": round(largest_shard_mib),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
        "load_average_1min_at_end": round(os.getloadavg()[0], 1),  # seconds are noisy on a shared machine; memory is not
        "results": results,
    }
    out = ROOT / "bench" / "results" / "convert_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"model: {report['weights_mib']} MiB in {shards} shards (largest {report['largest_shard_mib']} MiB)")
    print(f"{'mode':<26}{'seconds':>8}{'base RSS':>10}{'peak RSS':>10}{'growth':>8}{'anon+':>8}{'file+':>8}  (MiB)")
    for mode, r in results.items():
        g = r["growth_mib"]
        print(f"{mode:<26}{r['seconds']:>8}{r['baseline_mib']['VmRSS']:>10}{r['peak_mib']['VmRSS']:>10}{g['VmRSS']:>8}{g['RssAnon']:>8}{g['RssFile']:>8}")
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(_child(*sys.argv[2:])))
    else:
        main()
