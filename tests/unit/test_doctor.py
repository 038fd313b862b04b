"""`megatron-rl doctor`: one line per check and the exit code, on one process and on two (real gloo), and a FAIL.

What each line must say is worked out here from the platform (availability.detect)
and the inputs, not read back from the doctor.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl import doctor
from megatron_rl.doctor import Check
from tests.distributed.harness import run_distributed
from tests.extras import available

REPO = Path(__file__).resolve().parents[2]
PRESET = "configs/tiny-gspo.yaml"  # rollout.engine=vllm: vLLM in this process, so the versions check needs it
VLLM = available("vllm")  # absent on a GPU node without the gpu extra: then versions is a FAIL naming it


def _overrides(tmp: Path, model_path: str | None = None) -> list[str]:
    return [f"model.path={model_path or tmp / 'tiny'}", f"checkpoint.dir={tmp / 'ckpt'}", f"logging.dir={tmp}"]


def _line(text: str, name: str) -> str:
    found = [line for line in text.splitlines() if re.match(rf"^(ok|warn|FAIL|skip)\s+{name}: ", line)]
    assert len(found) == 1, text
    return found[0]


def test_single_process_cli(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "megatron_rl.cli", "doctor", "--config", PRESET, *_overrides(tmp_path)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = result.stdout
    assert result.returncode == (0 if VLLM else 1), out + result.stderr[-3000:]
    versions = _line(out, "versions")
    assert versions.startswith(("ok ", "warn ") if VLLM else ("FAIL ",)) and f"torch {torch.__version__}" in versions
    cuda = torch.cuda.is_available()
    assert _line(out, "gpus").startswith("ok" if cuda else "skip")
    forward = _line(out, "forward")
    assert forward.startswith("ok") and ("cuda" if cuda else "on cpu, layer spec: local") in forward
    assert float(re.search(r"max \|logits - transformers\| (\S+) in", forward).group(1)) < 1e-3
    assert _line(out, "collectives").startswith("ok    collectives: 1 rank(s) over")
    assert _line(out, "disk").startswith(f"ok    disk: checkpoint.dir={tmp_path / 'ckpt'}")
    assert _line(out, "paths").startswith("ok    paths: model.path checked on 1 rank(s)")
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("doctor: ") and f" {0 if VLLM else 1} FAIL" in summary
    assert ("skipped: gpus (no CUDA device here)" in summary) == (not cuda)
    # the libraries' import warnings and progress bars are not between the check lines, and nothing was written
    # into the run's directory
    assert "UserWarning" not in result.stderr and "Writing model shards" not in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "logs").exists()


def _doctor_rank(rank: int, world_size: int, tmp: str, model_path: str) -> tuple[int, str]:
    buf = io.StringIO()
    code = doctor.run(PRESET, [*_overrides(Path(tmp), model_path), "model.make_tiny_if_missing=''"], out=buf)
    return code, buf.getvalue()


def test_two_processes_over_gloo_and_a_missing_model_path_fails(tmp_path):
    """Two ranks (real gloo): collectives over both, and model.path missing on every rank is a FAIL, exit 1 on both."""
    missing = str(tmp_path / "no-such-model")
    (code0, out0), (code1, out1) = run_distributed(_doctor_rank, 2, str(tmp_path), missing, timeout=600)
    assert (code0, code1) == (1, 1), out0
    assert out1 == ""  # rank 0 reports for everyone
    collectives = _line(out0, "collectives")
    assert collectives.startswith("ok    collectives: 2 rank(s) over gloo, 4 MiB")
    assert re.search(r"slowest rank [01] ", collectives)
    paths = _line(out0, "paths")
    assert paths.startswith("FAIL  paths:") and f"model.path='{missing}' is missing on rank(s) [0, 1]" in paths
    assert "-- fix: " in paths and "set model.path" in paths
    assert f", {1 if VLLM else 2} FAIL" in out0.strip().splitlines()[-1], out0  # the paths (and vLLM where absent)


def test_paths_differing_between_ranks_are_named():
    cfg = type("Cfg", (), {"model": type("M", (), {"make_tiny_if_missing": ""})()})()
    same = {"model.path": "/m -> dir abc", "data.path": "/d.jsonl -> file 10"}
    other = {"model.path": "/m -> dir abd", "data.path": "/d.jsonl -> file 10"}
    assert doctor.check_paths(cfg, [same, same]).status == "ok"
    check = doctor.check_paths(cfg, [same, other, same])
    assert check.status == "FAIL" and "model.path differs between ranks" in check.fix and "data.path" not in check.fix


def test_merge_keeps_the_worst_rank_and_names_it():
    per_rank = [
        [Check(name="versions", status="ok", detail="a"), Check(name="gpus", status="ok", detail="g0")],
        [Check(name="versions", status="ok", detail="a"), Check(name="gpus", status="FAIL", detail="g1", fix="f")],
    ]
    merged = doctor.merge(per_rank)
    assert [c.name for c in merged] == ["versions", "gpus"]
    assert merged[1].status == "FAIL" and merged[1].detail == "rank 1: g1" and merged[1].line().endswith("-- fix: f")
    assert merged[0].detail == "rank 0: a"


def test_missing_library_is_a_fail_naming_the_extra(monkeypatch):
    from megatron_rl.config.core import load_config
    from megatron_rl.config.schema import RLConfig
    from megatron_rl.parallel.availability import Availability

    cfg = load_config(RLConfig, str(REPO / PRESET), [])
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: None if dist.startswith("vllm") else real(dist))
    check = doctor.check_versions(cfg, Availability(cuda=False, transformer_engine=False, apex=False, grouped_gemm=False))
    assert check.status == "FAIL" and "vLLM missing" in check.detail and "pip install -e '.[cpu]'" in check.fix
    gpu = doctor.check_versions(cfg, Availability(cuda=True, transformer_engine=False, apex=False, grouped_gemm=False))
    assert "'.[gpu]'" in gpu.fix  # on a GPU node vLLM comes with the gpu extra


@pytest.mark.parametrize("world", [2, 4, 8])
def test_bus_bandwidth_factor_is_nccl_tests(world, monkeypatch):
    """all-reduce busbw = S/t x 2(n-1)/n (nccl-tests' PERFORMANCE.md): faked world and timings, worked by hand."""
    import torch.distributed as dist

    times = iter([0.002, 0.001])  # this rank's all-reduce, then its broadcast
    monkeypatch.setattr(dist, "get_world_size", lambda: world)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_backend", lambda: "fake")
    monkeypatch.setattr(doctor, "_timed", lambda op, device, repeats: next(times))
    monkeypatch.setattr(dist, "all_reduce", lambda t: None)
    monkeypatch.setattr(dist, "broadcast", lambda t, src: t.zero_())

    def all_gather(out, t):
        for i, o in enumerate(out):
            o.copy_(t)
            o[0] = 0.002 * (1 + (i == world - 1))  # the last rank is twice as slow

    monkeypatch.setattr(dist, "all_gather", all_gather)
    check = doctor.check_collectives(torch.device("cpu"), 8 * 2**20)
    expected = 8 * 2**20 / 0.004 * 2 * (world - 1) / world / 1e9
    assert f"(busbw {expected:.2f} GB/s)" in check.detail and f"slowest rank {world - 1} " in check.detail
    assert f"(busbw {8 * 2**20 / 0.001 / 1e9:.2f} GB/s)" in check.detail  # broadcast: S/t


def _fake_gpus(monkeypatch, count: int, free: int):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_gpus_against_the_preset_and_the_planners_peak(monkeypatch):
    """Faked devices (any machine): too few GPUs, too little free memory for the planner's peak, and enough."""
    from megatron_rl.config.core import load_config
    from megatron_rl.config.schema import RLConfig
    from megatron_rl.parallel.availability import Availability
    from megatron_rl.plan.report import load_spec
    from megatron_rl.plan.planner import plan

    cfg = load_config(RLConfig, str(REPO / "configs" / "tiny-gspo-1x8h100.yaml"), [])
    cuda = Availability(cuda=True, transformer_engine=False, apex=False, grouped_gemm=False)
    peak = plan(cfg, load_spec(cfg)).peak.total  # the planner's own estimate, compared by the doctor
    _fake_gpus(monkeypatch, 4, 2**40)
    few = doctor.check_gpus(cfg, cuda, local_world=1)
    assert few.status == "FAIL" and "cluster.gpus_per_node=8 but 4 visible" in few.fix
    _fake_gpus(monkeypatch, 8, int(peak) - 1)
    short = doctor.check_gpus(cfg, cuda, local_world=8)
    assert short.status == "FAIL" and "planner's peak" in short.detail
    _fake_gpus(monkeypatch, 8, int(peak) + 2**20)
    assert doctor.check_gpus(cfg, cuda, local_world=8).status == "ok"
    shared = doctor.check_gpus(cfg, cuda, local_world=16)
    assert shared.status == "FAIL" and "16 processes on this node share 8 GPU(s)" in shared.fix


def test_the_forward_check_runs_the_model_it_is_given(tmp_path):
    """model.path holds a model (a tied tiny Llama, as SmolLM2 is): that model's forward is checked, not the tiny
    Qwen3-MoE's; its logits are compared with transformers' forward of the same checkpoint."""
    from megatron_rl.models.tiny import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "llama", "llama", seed=0, tie_word_embeddings=True)
    ((code, out),) = run_distributed(_doctor_rank, 1, str(tmp_path), str(model), timeout=600)
    forward = _line(out, "forward")
    assert forward.startswith(f"ok    forward: {model} (") and "M parameters) on cpu" in forward, out
    assert float(re.search(r"max \|logits - transformers\| (\S+) in", forward).group(1)) < 1e-3


def test_a_model_too_large_to_load_here_is_checked_as_the_tiny_one(tmp_path, monkeypatch):
    from megatron_rl.config import RLConfig, load_config
    from megatron_rl.models.tiny import make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "moe", "qwen3_moe", seed=0, with_tokenizer=False)
    cfg = load_config(RLConfig, str(REPO / PRESET), [f"model.path={model}"])
    path, about = doctor.given_model(cfg)
    assert path == model and about.startswith(f"{model} (")
    monkeypatch.setattr(doctor, "FORWARD_MAX_PARAMS", 1000)
    assert doctor.given_model(cfg)[0] is None and "over the 0.0B this check loads" in doctor.given_model(cfg)[1]
    (model / "model.safetensors").unlink()
    assert doctor.given_model(cfg) == (None, f"{model} has no safetensors weights")
