"""launch/slurm.sbatch under a real Slurm: munged, slurmctld and slurmd on this machine (tests/e2e/slurm_cluster.py,
Debian's packages, installed with apt-get where missing), jobs of the two-process CPU preset over gloo.

The jobs run at once, each driven on a thread (tests/e2e/slurm_runs.py has what each does to its job):
- reference: `sbatch launch/slurm.sbatch <preset>` to the end, untouched;
- preempted: a rank killed with SIGKILL (torchrun restarts both, cluster.max_restarts=1), then
  `scancel --signal=USR1 --batch`: every rank saves at the next step boundary and the script requeues the job;
- time_limit: `--signal=B:USR1@60` and a time limit: Slurm's own warning, the save before the limit, the requeue;
- requeued: `scontrol requeue` (an administrator, a pre-emption by requeue): SIGTERM, the save, Slurm's requeue;
- bad input: a preset or layout the script's checks refuse, before any srun.
Every interrupted job resumes from its save with no override; its final weights and optimizer state are compared
with the reference's, tensor by tensor (read from the two megatron dist checkpoints with torch's own reader); the
reward gives every step a gradient (tests/e2e/train_runs.py), so a resume that restored the optimizer state wrongly
would show, and so would an engine that a stop signal ended (its restart draws other samples).
Without root or apt-get the module is skipped, saying why; under CI (CI=true) it fails instead.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import tests.e2e.requires_vllm  # noqa: F401  (skips the module, naming the extra, without vLLM; a broken install fails)
from megatron_rl.metrics import read_metrics
from tests.e2e import slurm_cluster, slurm_runs
from tests.e2e.slurm_runs import BAD_INPUTS, STEPS, WARNING_S, JobRun

IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
WAIT_S = 900
TOKEN = (0o600, 44)
"""The token file while a job runs: the owner's only, one 43-character token and a newline."""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_cluster.unavailable()
    if reason:
        message = f"no Slurm here: {reason}"
        pytest.fail(message) if IN_CI else pytest.skip(message)
    if slurm_cluster.missing_programs():
        slurm_cluster.install()
    with slurm_cluster.SlurmCluster.started(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def jobs(slurm, model_dir, tmp_path_factory) -> dict[str, Future]:
    """Every job of the module, submitted at once; name -> Future of its JobRun."""
    root = tmp_path_factory.mktemp("jobs")
    pool = ThreadPoolExecutor(max_workers=8)
    futures = {name: pool.submit(getattr(slurm_runs, name), slurm, root / name, model_dir)
               for name in ("reference", "preempted", "time_limit", "requeued")}
    futures |= {name: pool.submit(slurm_runs.bad_input, slurm, root / name, name) for name in BAD_INPUTS}
    yield futures
    slurm.closing.set()  # drivers of tests that failed early stop waiting; the cluster's stop cancels their jobs
    pool.shutdown(wait=True)


def _finished(jobs: dict[str, Future], name: str) -> JobRun:
    run = jobs[name].result(timeout=WAIT_S)
    assert run.end.get("JobState") == "COMPLETED" and run.end.get("ExitCode") == "0:0", f"{run.end}\n{run.output[-4000:]}"
    assert "Traceback" not in run.output, run.output[-4000:]
    return run


def _summary_line_of(run: JobRun) -> str:
    """The console's summary line of the last two steps, computed here from metrics.jsonl (mean reward)."""
    rows = read_metrics(run.run_dir / "metrics.jsonl")[-2:]
    return f"step {STEPS - 1}: reward {sum(r['reward/mean'] for r in rows) / 2:.3f}, "


def _saved_state(step_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a megatron dist checkpoint (model and optimizer), read in one process by torch's DCP reader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(scratch))
    return torch.load(scratch, weights_only=False)


def _assert_same_final_state(run: JobRun, reference: JobRun) -> None:
    final = f"checkpoints/step_{STEPS:08d}"
    want = _saved_state(reference.run_dir / final, reference.work / "want.pt")
    got = _saved_state(run.run_dir / final, run.work / "got.pt")
    tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    assert sorted(got) == sorted(want) and len(tensors) > 10
    assert any(k.startswith("decoder.") for k in tensors) and any("optimizer" in k for k in tensors), tensors[:20]
    for key in tensors:
        assert torch.equal(got[key], want[key]), f"{key} differs from the uninterrupted run's"


def _assert_resumed_from_its_save(run: JobRun, signal_name: str) -> int:
    """A launch stopped by the signal with a save at a step boundary, and the next launch resumed from that very
    checkpoint (the newest, by checkpoint.resume=auto: no override); every step logged once. The step resumed at."""
    stopped = re.search(rf"megatron-rl: stopped by {signal_name}: the ranks were asked to save", run.output)
    assert stopped, run.output[-4000:]
    resumed = re.search(r"resumed from (\S+)/step_(\d+) at step (\d+)\n", run.output[stopped.end():])
    assert resumed and resumed.group(2).lstrip("0") == resumed.group(3), run.output[-4000:]
    step = int(resumed.group(3))
    assert 0 < step < STEPS, resumed.group(0)
    checkpoints = run.run_dir / "checkpoints"
    assert {f"rank_{r:05d}.pt" for r in (0, 1)} <= {p.name for p in (checkpoints / f"step_{step:08d}").iterdir()}
    assert not list(checkpoints.glob(".*partial")), sorted(p.name for p in checkpoints.iterdir())
    assert [r["step"] for r in read_metrics(run.run_dir / "metrics.jsonl")] == list(range(STEPS))
    return step


def test_a_job_runs_to_the_end_with_its_files_where_the_docs_say(jobs):
    run = _finished(jobs, "reference")
    assert run.end["Restarts"] == "0"
    assert run.output.splitlines()[-1].startswith(_summary_line_of(run)), run.output[-2000:]
    # docs/cluster.md: metrics in logging.dir, checkpoints in checkpoint.dir (outputs, outputs/checkpoints by
    # default, under the directory the job was submitted from), torchrun's log per node under logs/
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    assert (run.run_dir / "logs" / "torchrun.node0.log").is_file()
    grad_norms = [r["grad_norm"] for r in read_metrics(run.run_dir / "metrics.jsonl")]
    assert len(grad_norms) == STEPS and all(g > 0 for g in grad_norms), grad_norms
    assert run.tokens == [TOKEN] and not run.token_left


def test_a_dead_rank_and_a_preemption_end_in_the_weights_of_an_uninterrupted_run(jobs):
    run = _finished(jobs, "preempted")
    assert run.end["Restarts"] == "1", run.output[-4000:]  # the script's own requeue, once
    # the dead rank: torchrun restarts both ranks from the newest checkpoint, and the resume line says why: the
    # step and phase whose collective lost the killed rank
    restart = re.search(r"resumed from \S+step_0*(\d+) at step \1 \(torchrun restart 1 of 1; the attempt before stopped: "
                        r".*rank 0: a collective of step (\d+), phase \w+, lost its connection", run.output)
    assert restart and 2 <= int(restart.group(1)) <= int(restart.group(2)), run.output[-4000:]
    assert re.search(r"rank 1 \(pid \d+ on \S+\) was killed by SIGKILL.*restart 1 of 1", run.output), run.output[-4000:]
    assert "slurm.sbatch: SIGUSR1" in run.output and f"requeueing job {run.job}" in run.output
    _assert_resumed_from_its_save(run, "SIGUSR1")
    assert run.output.splitlines()[-1].startswith(_summary_line_of(run)), run.output[-2000:]
    assert run.tokens == [TOKEN] * 3 and not run.token_left  # first launch, torchrun's restart, the requeued launch


def test_a_time_limit_saves_before_the_kill_and_the_requeued_job_finishes(jobs):
    run = _finished(jobs, "time_limit")
    assert run.end["Restarts"] == "1", run.output[-4000:]
    assert "DUE TO TIME LIMIT" not in run.output  # no launch reached the limit: each saved and stopped before it
    # the warning: 60 s before the limit, as slurmctld's 30-s timer has it (up to 30 s early)
    assert WARNING_S - 5 < run.times["warning_before_limit"] < WARNING_S + 35, run.times
    assert "slurm.sbatch: SIGUSR1" in run.output and f"requeueing job {run.job}" in run.output
    _assert_resumed_from_its_save(run, "SIGUSR1")
    assert run.tokens == [TOKEN] * 2 and not run.token_left


def test_a_requeue_by_slurm_saves_and_resumes(jobs):
    run = _finished(jobs, "requeued")
    assert run.end["Restarts"] == "1", run.output[-4000:]
    assert "slurm.sbatch: SIGTERM" in run.output and "requeueing job" not in run.output  # Slurm requeued it itself
    _assert_resumed_from_its_save(run, "(?:SIGTERM|SIGUSR1)")  # the script passes a TERM on to srun as USR1
    assert run.tokens == [TOKEN] * 2 and not run.token_left


# A stop signal reaches every process of the job's step: srun passes USR1 on to all of them, Slurm sends its TERM to
# all of them, torchrun passes both on to each rank's process group. The in-process engine's vLLM core process (a child
# of rank 0) starts with both blocked (rollout.engine_env.stop_signals_blocked) and outlives them: the step in progress
# and the save after it keep their engine, and the samples are the uninterrupted run's.
@pytest.mark.parametrize("name", ["preempted", "time_limit", "requeued"])
def test_a_stopped_job_ends_in_the_weights_of_an_uninterrupted_run(jobs, name):
    run = _finished(jobs, name)
    assert "engine failure" not in run.output, run.output[-4000:]
    _assert_same_final_state(run, _finished(jobs, "reference"))


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_ends_the_job_before_any_srun_in_one_line(jobs, name):
    run = jobs[name].result(timeout=WAIT_S)
    assert run.end.get("JobState") == "FAILED" and run.end.get("ExitCode") == "2:0", run.end
    assert run.end["Restarts"] == "0"
    lines = run.output.splitlines()
    assert len(lines) == 1 and BAD_INPUTS[name][2] in lines[0], run.output
    assert not run.run_dir.exists() and not run.token_left  # no trainer ever started


def test_a_controller_that_died_is_named_before_a_job_is_submitted(slurm, tmp_path):
    """A cluster of its own (the module's keeps running): its slurmctld killed, the next sbatch says so."""
    with slurm_cluster.SlurmCluster.started(tmp_path / "cluster") as cluster:
        cluster.kill_daemon("slurmctld")
        with pytest.raises(RuntimeError, match=r"Slurm's slurmctld is not running \(exit -9\)"):
            cluster.sbatch(["--wrap", "true"], cwd=tmp_path, env=dict(os.environ))
    assert not cluster.processes()  # its stop left nothing running

