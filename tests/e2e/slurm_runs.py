"""The jobs of tests/e2e/test_slurm.py (and bench/slurm_timing.py): `sbatch launch/slurm.sbatch` of the two-process
CPU preset on the tiny model under the one-node Slurm of slurm_cluster.py, each driven on a thread of its own so that
the jobs share the node's wall time. A driver submits its job, acts on it as the scenario says (kills a rank, sends
a signal) when the run reaches a given point, and returns what it saw (a JobRun); the tests assert on that.

- reference: runs to the end untouched;
- preempted: with cluster.max_restarts=1, rank 1 is killed with SIGKILL once step_00000002 is saved (torchrun starts
  both ranks again); after the restarted run's first step, `scancel --signal=USR1 --batch` (what Slurm's
  --signal=B:USR1 sends): the ranks save at the next step boundary, the script requeues the job, which resumes;
- time_limit: `--signal=B:USR1@60` and, once the first step is done, a time limit (`scontrol update`) that ends
  90 to 150 s later: Slurm's own warning, 60 s before it (slurmctld looks every 30 s). The ranks are held (SIGSTOP)
  after their first step until it comes, so that it falls in the run wherever slurmctld's timer puts it, then let
  go: they save and the job is requeued; the requeued job (given 10 minutes, so that no second warning comes)
  resumes and finishes;
- requeued: `scontrol requeue` (what an administrator or a pre-emption does): SIGTERM, the ranks save within
  KillWait, Slurm requeues the job itself and it finishes;
- bad input: the script's own checks end the job before any srun.
The token file (.megatron-rl/server-token.JOBID) is looked at after the first step of every launch and at the end.
"""

from __future__ import annotations

import math
import os
import signal
import stat
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil

from tests.e2e.slurm_cluster import SlurmCluster
from tests.e2e.train_runs import PARITY, REPO, train_env

PRESET = REPO / "configs" / "tiny-gspo-cpu2.yaml"
SCRIPT = REPO / "launch" / "slurm.sbatch"
STEPS = 12
"""Steps of every run: room for a signal to arrive a few 0.3-s steps late and still stop the run before its end."""
RUN_TIMEOUT_S = 400
"""Seconds any one wait of a driver may take (a whole job on 2 busy cores takes about a minute per launch)."""
WARNING_LINE = "slurm.sbatch: SIGUSR1"
WARNING_S = 60
"""The time_limit job's --signal=B:USR1@WARNING_S."""


def overrides(model_dir: Path) -> list[str]:
    """What every job of the module trains: the tiny model, 2 prompts x 4 samples, STEPS steps, a save every 2, a
    summary line every 2 steps, a reward whose groups differ (gradients in every step: tests/e2e/train_runs.py)."""
    return [f"model.path={model_dir}", "logging.progress_bar=false", "train.prompts_per_step=2", "rollout.n_samples=4",
            f"train.steps={STEPS}", "checkpoint.save_every=2", "checkpoint.keep_last=20", "logging.summary_every=2", PARITY]


@dataclass
class JobRun:
    """What a driver saw of one job (its files are under `work`, the directory it was submitted from)."""

    job: int
    work: Path
    end: dict[str, str] = field(default_factory=dict)
    """`scontrol show job` once it ended (JobState, ExitCode, Restarts, RunTime, ...)."""
    output: str = ""
    tokens: list[tuple[int, int]] = field(default_factory=list)
    """(mode, bytes) of the token file after the first step of each launch."""
    token_left: bool = False
    """The token file exists after the job ended."""
    times: dict[str, float] = field(default_factory=dict)
    """Seconds from sbatch to each event (first_step, warning, requeued_first_step, ...)."""

    @property
    def output_file(self) -> Path:
        return self.work / f"megatron-rl-{self.job}.out"

    @property
    def token_file(self) -> Path:
        return self.work / ".megatron-rl" / f"server-token.{self.job}"

    @property
    def run_dir(self) -> Path:
        """logging.dir as the preset leaves it (outputs, relative to the job's working directory)."""
        return self.work / "outputs"

    def read_output(self) -> str:
        return self.output_file.read_text(errors="replace") if self.output_file.is_file() else "(no output file yet)"

    def rows(self) -> int:
        """Rows of metrics.jsonl (one per step; a resumed launch appends its own)."""
        path = self.run_dir / "metrics.jsonl"
        return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0

    def latest(self) -> str:
        path = self.run_dir / "checkpoints" / "latest"
        return path.read_text().strip() if path.is_file() else ""


MASTER_PORTS = range(16384, 24576)
"""Where the jobs' rendezvous ports are drawn: below megatron_rl.ports.free_port's draws (the 8192 ports under the
kernel's ephemeral range), which the running jobs make for their own groups and engines; a port drawn here at
submission is bound only when the job starts, and a job's draw there could otherwise take it in between."""
_drawn: set[int] = set()


def master_port() -> int:
    """A port of MASTER_PORTS free now and given to no other job of this module (each job's torchrun binds it)."""
    import random
    import socket

    for port in random.SystemRandom().sample(MASTER_PORTS, 64):
        if port in _drawn:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
        _drawn.add(port)
        return port
    raise OSError(f"no free port in {MASTER_PORTS}")


class Driver:
    """Submits one job and waits for points in it, timing each from the sbatch."""

    def __init__(self, cluster: SlurmCluster, work: Path):
        self.cluster = cluster
        work.mkdir(parents=True, exist_ok=True)
        self.run = JobRun(job=0, work=work)
        self._start = 0.0

    def submit(self, sbatch_args: list[str], args: list[str], python: str = sys.executable) -> JobRun:
        env = {**train_env(), "PYTHON": python, "MASTER_PORT": str(master_port()), "VLLM_LOGGING_LEVEL": "WARNING"}
        self._start = time.monotonic()
        self.run.job = self.cluster.sbatch([*sbatch_args, str(SCRIPT), *args], cwd=self.run.work, env=env)
        return self.run

    def start(self, sbatch_args: list[str], args: list[str]) -> JobRun:
        """Submit a training job and wait until it runs (launch_1) and has logged its first step (first_step)."""
        self.submit(sbatch_args, args)
        self.wait_for_launch(0)
        self.wait_for_step("first_step")
        return self.run

    def mark(self, event: str) -> None:
        self.run.times[event] = round(time.monotonic() - self._start, 2)

    def wait(self, what: str, ready) -> None:
        self.cluster.wait_for(f"{what} in job {self.run.job}", ready, RUN_TIMEOUT_S, self.run.read_output)

    def wait_for_step(self, event: str, after_rows: int = 0) -> int:
        """Wait until the run has logged a step beyond `after_rows` rows; note the token file then. The row count."""
        self.wait(event, lambda: self.run.rows() > after_rows)
        self.mark(event)
        self.note_token()
        return self.run.rows()

    def wait_for_launch(self, restarts: int) -> None:
        """Wait until the job was requeued `restarts` times and runs again."""
        def running_again() -> bool:
            info = self.cluster.job(self.run.job)
            return int(info.get("Restarts", 0)) >= restarts and info.get("JobState") == "RUNNING"

        self.wait(f"launch {restarts + 1}", running_again)
        self.mark(f"launch_{restarts + 1}")

    def note_token(self) -> None:
        try:
            st = self.run.token_file.stat()
        except FileNotFoundError:
            self.run.tokens.append((0, 0))
            return
        self.run.tokens.append((stat.S_IMODE(st.st_mode), st.st_size))

    def finish(self) -> JobRun:
        self.run.end = self.cluster.wait_for_end(self.run.job, RUN_TIMEOUT_S, self.run.read_output)
        self.mark("end")
        self.run.output = self.run.read_output()
        self.run.token_left = self.run.token_file.exists()
        return self.run

    def ranks(self) -> dict[int, psutil.Process]:
        """The job's trainer processes by rank: children of the node's launcher (megatron_rl.elastic) that carry RANK."""
        found = {}
        for proc in self.cluster.processes():
            try:
                env = proc.environ()
                parent = proc.parent()
                if (env.get("SLURM_JOB_ID") == str(self.run.job) and "RANK" in env and parent is not None
                        and "megatron_rl.elastic" in " ".join(parent.cmdline())):
                    found[int(env["RANK"])] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found


def reference(cluster: SlurmCluster, work: Path, model_dir: Path) -> JobRun:
    driver = Driver(cluster, work)
    driver.start([], [str(PRESET), *overrides(model_dir)])
    return driver.finish()


def preempted(cluster: SlurmCluster, work: Path, model_dir: Path) -> JobRun:
    driver = Driver(cluster, work)
    run = driver.start([], [str(PRESET), *overrides(model_dir), "cluster.max_restarts=1"])
    driver.wait("checkpoint step_00000002", lambda: run.latest() >= "step_00000002")
    os.kill(driver.ranks()[1].pid, signal.SIGKILL)  # in a step after the save
    driver.mark("rank_killed")
    driver.wait("torchrun's restart", lambda: "torchrun restart 1 of 1" in run.read_output())
    driver.wait_for_step("restarted_first_step", run.rows())
    cluster.signal(run.job, "USR1")
    driver.mark("warning")
    driver.wait_for_launch(1)
    driver.wait_for_step("requeued_first_step", run.rows())
    return driver.finish()


def time_limit(cluster: SlurmCluster, work: Path, model_dir: Path) -> JobRun:
    driver = Driver(cluster, work)
    run = driver.start(["--time=10", f"--signal=B:USR1@{WARNING_S}"], [str(PRESET), *overrides(model_dir)])
    held = list(driver.ranks().values())
    for proc in held:
        proc.suspend()  # SIGSTOP: the run waits for the warning where it is
    try:
        # the limit, now that the run has started (however long a busy machine took): whole minutes that end 90 to
        # 150 s from now, so that the warning comes 0 to 90 s from now and 60 s or more before the kill
        running_s = _seconds(cluster.job(run.job)["RunTime"])
        cluster.update(run.job, f"TimeLimit={math.ceil((running_s + 90) / 60)}")
        end = datetime.fromisoformat(cluster.job(run.job)["EndTime"]).timestamp()
        driver.wait("Slurm's warning", lambda: WARNING_LINE in run.read_output())
        driver.mark("warning")
        run.times["warning_before_limit"] = round(end - time.time(), 1)
    finally:
        for proc in held:
            proc.resume()
    driver.wait("the requeue", lambda: int(cluster.job(run.job).get("Restarts", 0)) >= 1)
    # the requeued job runs under a longer limit: a second warning would fall anywhere in it (slurmctld's 30-s timer,
    # a busy machine's start-up), at worst in the second the finished trainer exits, where nothing takes it
    cluster.update(run.job, "TimeLimit=10")
    driver.wait_for_launch(1)
    driver.wait_for_step("requeued_first_step", run.rows())
    return driver.finish()


def _seconds(duration: str) -> int:
    """Seconds of a Slurm duration ([days-]hours:minutes:seconds)."""
    days, _, clock = duration.rpartition("-")
    hours, minutes, seconds = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


def requeued(cluster: SlurmCluster, work: Path, model_dir: Path) -> JobRun:
    driver = Driver(cluster, work)
    run = driver.start([], [str(PRESET), *overrides(model_dir)])
    cluster.requeue(run.job)
    driver.mark("requeue")
    driver.wait_for_launch(1)
    driver.wait_for_step("requeued_first_step", run.rows())
    return driver.finish()


BAD_INPUTS = {
    # name: (arguments after the script, python, the words its one line must hold)
    "missing_preset": (["configs/nope.yaml"], sys.executable, "config file 'configs/nope.yaml' does not exist"),
    "unknown_key": ([str(PRESET), "train.stepz=3"], sys.executable, "unknown config key 'train.stepz'"),
    "impossible_layout": ([str(PRESET), "parallel.tensor_parallel=4"], sys.executable, "world size 2 is not divisible"),
    "python_without_package": ([str(PRESET)], "/nonexistent/python3", "/nonexistent/python3 cannot import megatron_rl"),
}


def bad_input(cluster: SlurmCluster, work: Path, name: str) -> JobRun:
    args, python, _ = BAD_INPUTS[name]
    driver = Driver(cluster, work)
    driver.submit([], args, python=python)
    return driver.finish()
