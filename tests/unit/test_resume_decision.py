"""Which checkpoint a run starts from (checkpoint.resume.decide_resume), decided once: the start-up checks and the load
use that one decision, a torchrun restart included, and the chosen checkpoint is checked complete once.

The checkpoints are real ones: megatron dist checkpoints written by checkpoint.state.save_checkpoint in a process of
their own (a gloo group of one), each holding one tensor filled with its step number, so a load shows which
checkpoint it read. A save that was cut short is left as a crash leaves it: its `.step_XXXXXXXX.partial` directory
without trainer_state.json, `latest` still naming the save before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_rl.checkpoint import state as checkpoint_state
from megatron_rl.checkpoint.resume import NO_MESSAGE, ResumeDecision, decide_resume
from megatron_rl.checkpoint.state import CheckpointError
from megatron_rl.config import CheckpointConfig, RLConfig, load_config
from megatron_rl.models.tiny import tiny_hf_config
from megatron_rl.preflight import check_before_start, model_architecture

REPO = Path(__file__).resolve().parents[2]
PRESET = str(REPO / "configs" / "tiny-gspo.yaml")
THIS_MODEL = tiny_hf_config("qwen3_moe")
OTHER_MODEL = tiny_hf_config("qwen3_moe", hidden_size=96)
"""Another model of the family: its checkpoints record hidden_size 96, this run's model has 64."""
LAYOUT = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1, "expert_tensor_parallel": 1,
          "context_parallel": 1, "data_parallel": 1}
"""The parallel layout a one-process run records."""


def _save_runs(rank: int, world_size: int, root: str, runs: dict[str, list[tuple[int, dict]]]) -> None:
    """Each run's checkpoints, saved in order by the project's save: one tensor `weight` = [step] * 4 each."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_rl.checkpoint.state import save_checkpoint

    dist.init_process_group("gloo")
    try:
        for run, steps in runs.items():
            for step, architecture in steps:
                state = {"weight": ShardedTensor.from_rank_offsets("weight", torch.full((4,), float(step)))}
                trainer_state = {"weight_version": step, "optimizer_steps": step, "scheduler": {}, "data": None,
                                 "model_architecture": architecture, "optimizer_format": "dp_reshardable",
                                 "layout": LAYOUT}
                save_checkpoint(Path(root) / run, step, state, trainer_state, keep_last=0)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """one/: step 3. several/: steps 2 and 4, then a save of step 6 cut short. foreign/: step 2 of this model, then
    step 4 of another model (the newest). model/: this run's model directory (config.json)."""
    from tests.distributed.harness import run_distributed

    root = tmp_path_factory.mktemp("resume")
    ours, other = model_architecture(THIS_MODEL), model_architecture(OTHER_MODEL)
    runs = {"one": [(3, ours)], "several": [(2, ours), (4, ours)], "foreign": [(2, ours), (4, other)]}
    run_distributed(_save_runs, 1, str(root), runs, timeout=300)
    cut_short = root / "several" / ".step_00000006.partial"  # every rank wrote its shards; rank 0 never got to the rest
    shutil.copytree(root / "several" / "step_00000004", cut_short)
    (cut_short / "trainer_state.json").unlink()
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(THIS_MODEL))
    return root


@pytest.fixture
def runs(saved, tmp_path) -> Path:
    """A copy of the saved runs this test may change."""
    shutil.copytree(saved, tmp_path / "runs")
    return tmp_path / "runs"


def _torchrun(monkeypatch, root: Path, attempt: int, messages: dict[int, str] | None = None) -> None:
    """The torchrun variables of local rank 0 in `attempt` (of at most 3 restarts), as the elastic agent sets them, and
    the error files the ranks of the attempt before left (megatron_rl.errors.write_error_file's format)."""
    run_dir = root / "torchelastic" / "run-id"
    for local_rank, message in (messages or {}).items():
        error_file = run_dir / f"attempt_{attempt - 1}" / str(local_rank) / "error.json"
        error_file.parent.mkdir(parents=True)
        error_file.write_text(json.dumps({"message": message, "exitcode": 1, "timestamp": 0, "traceback": ""}))
    env = {"TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": "3",
           "TORCHELASTIC_ERROR_FILE": str(run_dir / f"attempt_{attempt}" / "0" / "error.json")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def _first_attempt(monkeypatch) -> None:
    for key in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(key, raising=False)


def _decide(resume: str, checkpoint_dir: Path) -> ResumeDecision:
    return decide_resume(CheckpointConfig(resume=resume, dir=str(checkpoint_dir)))


def _summary(decision: ResumeDecision) -> tuple:
    return decision.kind, decision.path, decision.step, decision.why


def test_none_and_auto(runs, tmp_path, monkeypatch):
    _first_attempt(monkeypatch)
    assert _summary(_decide("none", runs / "several")) == ("none", None, None, "")  # checkpoints there: not asked for
    assert _summary(_decide("auto", tmp_path / "nothing-yet")) == ("auto", None, None, "")
    assert _summary(_decide("auto", runs / "one")) == ("auto", runs / "one" / "step_00000003", 3, "")
    # the save of step 6 was cut short: `latest` still names step 4, complete
    assert (runs / "several" / "latest").read_text() == "step_00000004\n"
    decision = _decide("auto", runs / "several")
    assert _summary(decision) == ("auto", runs / "several" / "step_00000004", 4, "")
    assert decision.trainer_state["weight_version"] == 4 and decision.trainer_state["step"] == 4
    (runs / "several" / "step_00000004" / "trainer_state.json").unlink()  # damaged afterwards: named, not skipped
    with pytest.raises(CheckpointError, match=r"several/step_00000004' is incomplete \(no trainer_state.json\)"):
        _decide("auto", runs / "several")


def test_an_explicit_path(runs, tmp_path, monkeypatch):
    _first_attempt(monkeypatch)
    this_run = tmp_path / "this-run"
    step2 = runs / "several" / "step_00000002"
    assert _summary(_decide(str(step2), this_run)) == ("path", step2, 2, "")
    assert _summary(_decide(str(runs / "several"), this_run)) == ("path", runs / "several" / "step_00000004", 4, "")
    with pytest.raises(CheckpointError, match=r"several/step_00000009' does not exist"):
        _decide(str(runs / "several" / "step_00000009"), this_run)
    with pytest.raises(CheckpointError, match=r"several/.step_00000006.partial' is incomplete \(no trainer_state.json\)"):
        _decide(str(runs / "several" / ".step_00000006.partial"), this_run)


def test_a_torchrun_restart_resumes_the_newest_checkpoint_whatever_resume_says(runs, tmp_path, monkeypatch):
    _torchrun(monkeypatch, tmp_path, 1, {1: "megatron-rl train: error: rank 1: a collective of step 4, phase "
                                            "train, lost its connection"})
    why = (" (torchrun restart 1 of 3; the attempt before stopped: local rank 1: megatron-rl train: error: rank 1: a "
           "collective of step 4, phase train, lost its connection)")
    newest = runs / "several" / "step_00000004"
    assert _summary(_decide("none", runs / "several")) == ("restart", newest, 4, why)
    assert _summary(_decide(str(runs / "several" / "step_00000002"), runs / "several")) == ("restart", newest, 4, why)
    # nothing saved yet in checkpoint.dir: what checkpoint.resume says
    step2 = runs / "several" / "step_00000002"
    assert _summary(_decide(str(step2), tmp_path / "empty")) == ("restart", step2, 2, why)
    assert _summary(_decide("none", tmp_path / "empty")) == ("restart", None, None, why)


def test_a_restart_after_ranks_killed_without_a_message(runs, tmp_path, monkeypatch):
    _torchrun(monkeypatch, tmp_path, 2)
    decision = _decide("auto", runs / "one")
    assert decision.why == (" (torchrun restart 2 of 3; the attempt before stopped: a rank ended without a message "
                            "(killed by a signal: out of memory, a lost node, a kill; torchrun's log names its exit))")
    assert decision.why.endswith(f"stopped: {NO_MESSAGE})")


def _config(runs: Path, tmp_path: Path, resume: str, checkpoint_dir: Path) -> RLConfig:
    return load_config(RLConfig, PRESET, [f"model.path={runs / 'model'}", f"checkpoint.dir={checkpoint_dir}",
                                          f"checkpoint.resume={resume}", f"logging.dir={tmp_path / 'logs'}"])


@pytest.mark.parametrize("resume", ["none", "step_00000002"])
def test_on_a_restart_the_start_up_checks_see_the_checkpoint_that_is_loaded(runs, tmp_path, monkeypatch, resume):
    """foreign/'s newest checkpoint (step 4) was saved from another model; its step 2 from this one. A restart loads
    step 4 whatever checkpoint.resume says, so the architecture check must refuse step 4, before any work. (Before one
    decision was passed down, the check looked at what checkpoint.resume named: nothing for `none`, step 2 for the
    path; the trainer then loaded step 4.)"""
    foreign = runs / "foreign"
    resume = resume if resume == "none" else str(foreign / resume)
    cfg = _config(runs, tmp_path, resume, foreign)
    _first_attempt(monkeypatch)
    first = decide_resume(cfg.checkpoint)
    check_before_start(cfg, first)  # a first attempt: this model's step 2, or no checkpoint
    assert first.path == (None if resume == "none" else foreign / "step_00000002")

    _torchrun(monkeypatch, tmp_path, 1)
    restart = decide_resume(cfg.checkpoint)
    assert restart.path == foreign / "step_00000004"
    refused = (rf"checkpoint '{foreign / 'step_00000004'}' was saved from another model than model.path=.* "
               r"\(hidden_size: 96 in the checkpoint, 64 in the model\)")
    with pytest.raises(CheckpointError, match=refused):
        check_before_start(cfg, restart)
    from megatron_rl.trainer import run

    with pytest.raises(CheckpointError, match=refused):  # the run's own start: refused before its parallel context
        run(cfg)


def test_check_complete_runs_once_per_start_and_the_decided_checkpoint_is_loaded(saved, tmp_path):
    """From the decision to the load, in a process of its own (a gloo group of one), on a torchrun restart with
    checkpoint.resume naming step 2: one check_complete (of step 4), and the tensor loaded is step 4's."""
    from tests.distributed.harness import run_distributed

    runs = tmp_path / "runs"
    shutil.copytree(saved, runs)
    cfg_args = [f"model.path={runs / 'model'}", f"checkpoint.dir={runs / 'several'}",
                f"checkpoint.resume={runs / 'several' / 'step_00000002'}", f"logging.dir={tmp_path / 'logs'}"]
    env = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
           "TORCHELASTIC_ERROR_FILE": str(tmp_path / "torchelastic" / "run-id" / "attempt_1" / "0" / "error.json")}
    (checked, loaded, step) = run_distributed(_start_and_load, 1, cfg_args, env=env, timeout=300)[0]
    assert checked == [str(runs / "several" / "step_00000004")]
    assert loaded == [4.0] * 4 and step == 4


def _start_and_load(rank: int, world_size: int, cfg_args: list[str]) -> tuple[list[str], list[float], int]:
    """What `megatron-rl train` does from its start to the checkpoint's load, with check_complete counted."""
    import torch
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedTensor

    cfg = load_config(RLConfig, PRESET, cfg_args)
    checked: list[str] = []
    real_check = checkpoint_state.check_complete

    def counted(path):
        checked.append(str(path))
        return real_check(path)

    dist.init_process_group("gloo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint_state, "check_complete", counted)
        try:
            resume = decide_resume(cfg.checkpoint)  # trainer.run
            check_before_start(cfg, resume)
            state, trainer_state = resume.load(  # Trainer._resume, into a state dict of the saved tensor's shape
                lambda optimizer_format: {"weight": ShardedTensor.from_rank_offsets("weight", torch.zeros(4))}, LAYOUT)
        finally:
            dist.destroy_process_group()
    return checked, state["weight"].tolist(), trainer_state["step"]
