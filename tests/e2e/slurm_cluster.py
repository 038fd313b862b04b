"""A real one-node Slurm on this machine for the tests of launch/slurm.sbatch: munged, slurmctld and slurmd (Debian's
packages, installed with apt-get where missing), each run as root from a private directory with its own key, socket,
ports, state and spool, and stopped at the end leaving nothing running.

    with SlurmCluster.started(tmp_dir) as slurm:
        job = slurm.sbatch(["--time=1", "launch/slurm.sbatch", preset], cwd=REPO, env=env)
        slurm.wait_for_state(job, "COMPLETED")

Clients (sbatch, squeue, scontrol, scancel) find the cluster through SLURM_CONF, which `env()` adds. Where Slurm is
absent and cannot be installed (no apt-get, not root) `unavailable()` says why; a test skips with it, or fails under
CI (CI=true), where the Slurm tests must run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil

from megatron_rl.ports import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
START_TIMEOUT_S = 60
PR_SET_PDEATHSIG = 1
POLL_S = 0.1
"""Seconds between two looks at what a wait waits for (a file, or `scontrol show job`: a process each time)."""
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "PREEMPTED"}
REQUEUE_DELAY_S = 5
"""Seconds a requeued job waits before it may start again (AuthInfo's cred_expire; Slurm's default is 120)."""
KILL_WAIT_S = 60
"""Seconds Slurm gives a job between its SIGTERM and its SIGKILL (a time limit, a requeue, a scancel): a step and a
save of a tiny run fit in them on 2 busy cores."""


def missing_programs() -> list[str]:
    return [name for name in DAEMONS + CLIENTS if _which(name) is None]


def _which(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def unavailable() -> str | None:
    """Why no Slurm can run here (None when it can): programs missing that cannot be installed, or not root."""
    if os.geteuid() != 0:
        return "needs root to run slurmd and munged as the job's user (this process is not root)"
    missing = missing_programs()
    if missing and _which("apt-get") is None:
        return f"needs Slurm ({', '.join(missing)} not installed) and apt-get to install {' '.join(PACKAGES)}: none here"
    return None


def install() -> None:
    """apt-get install the packages (an `apt-get update` first when the package lists do not know them)."""
    apt = [_which("apt-get"), "-y", "-q", "-o", "DPkg::Lock::Timeout=300", "--no-install-recommends"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    result = subprocess.run([*apt, "install", *PACKAGES], env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        subprocess.run([*apt[:-1], "update"], env=env, capture_output=True, text=True, timeout=900)
        result = subprocess.run([*apt, "install", *PACKAGES], env=env, capture_output=True, text=True, timeout=900)
    if result.returncode != 0 or missing_programs():
        raise RuntimeError(f"apt-get install {' '.join(PACKAGES)} failed (exit {result.returncode}; still missing: "
                           f"{', '.join(missing_programs()) or 'nothing'}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")


def node_resources() -> tuple[str, int, int]:
    """(node name, CPUs, memory in MiB) of this machine as slurmd itself counts them (`slurmd -C`)."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True, timeout=60).stdout
    fields = dict(word.split("=", 1) for word in out.split() if "=" in word)
    return fields["NodeName"], int(fields["CPUs"]), int(fields["RealMemory"])


def slurm_conf(root: Path, node: str, cpus: int, memory_mib: int, ctld_port: int, slurmd_port: int) -> str:
    """slurm.conf of a one-node cluster whose daemons keep every file under `root`.

    Jobs may share the node's cores (OverSubscribe=FORCE: one job's `--exclusive` is overridden), tasks are not bound
    to cores (task/none), a finished job is forgotten after 10 s (MinJobAge), batch jobs may be requeued (JobRequeue),
    a requeued one may start again REQUEUE_DELAY_S later (cred_expire) and the scheduler looks at pending jobs every
    second (sched_interval; 60 s by default)."""
    host = socket.gethostname()
    return "\n".join([
        "ClusterName=local",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'munge.socket'},cred_expire={REQUEUE_DELAY_S}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=1",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "MinJobAge=10",
        "JobRequeue=1",
        f"KillWait={KILL_WAIT_S}",
        "ReturnToService=2",
        "SlurmdTimeout=300",
        "InactiveLimit=0",
        f"PlugStackConfig={root / 'plugstack.conf'}",
        f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mib} State=UNKNOWN",
        f"PartitionName=local Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
        "",
    ])


def _end_with_parent() -> None:
    """In a daemon's process before it execs: SIGTERM when the process that started it dies (a test run killed
    before its fixtures could stop the cluster leaves no daemon behind). Linux's prctl(PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class SlurmCluster:
    """munged, slurmctld and slurmd of one cluster under `root` (see the module's docstring)."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.node = ""
        self.cpus = 0
        self._procs: dict[str, subprocess.Popen] = {}
        self.closing = threading.Event()
        """Set when the tests end early: every wait_for stops at once."""

    @classmethod
    @contextlib.contextmanager
    def started(cls, root: Path) -> Iterator["SlurmCluster"]:
        cluster = cls(root)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this environment) with SLURM_CONF naming this cluster and no SLURM_ variable of another."""
        env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(("SLURM_", "SBATCH_"))}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = f"{env.get('PATH', '')}:/usr/sbin:/sbin"
        return env

    def start(self) -> None:
        for sub in ("munge", "state", "spool"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        (self.root / "plugstack.conf").write_text("")
        self.node, self.cpus, memory = node_resources()
        self.conf.write_text(slurm_conf(self.root, self.node, self.cpus, memory, free_port(), free_port()))
        munge = self.root / "munge"
        self._spawn("munged", [_which("munged"), "--foreground", "--force", f"--key-file={key}",
                               f"--socket={munge / 'munge.socket'}", f"--pid-file={munge / 'munged.pid'}",
                               f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"])
        self._wait("munged's socket", lambda: (munge / "munge.socket").exists())
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait("slurmctld", lambda: self._run("scontrol", "ping").returncode == 0 and "UP" in self._run("scontrol", "ping").stdout)
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(f"node {self.node} idle in sinfo", lambda: self._run("sinfo", "-h", "-n", self.node, "-o", "%t").stdout.strip() == "idle")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        with open(self.root / f"{name}.console", "w") as console:
            self._procs[name] = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, env=self.env(),
                                                 start_new_session=True, preexec_fn=_end_with_parent)

    def _wait(self, what: str, ready) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n{self.logs(name)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {START_TIMEOUT_S} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, *names: str) -> str:
        """The last lines of the daemons' logs (all of them by default), for a failure's message."""
        files = {"munged": self.root / "munge" / "munged.log", "slurmctld": self.root / "slurmctld.log",
                 "slurmd": self.root / "slurmd.log"}
        parts = []
        for name in names or files:
            for path in (files[name], self.root / f"{name}.console"):
                if path.is_file() and path.stat().st_size:
                    parts.append(f"--- {path.name}:\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)

    def _run(self, client: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([_which(client), *args], env=self.env(), capture_output=True, text=True, timeout=timeout)

    def kill_daemon(self, name: str) -> None:
        """SIGKILL one of the daemons (munged, slurmctld, slurmd) and wait for its end."""
        self._procs[name].kill()
        self._procs[name].wait()

    def version(self) -> str:
        """The controller's Slurm version ("slurm-wlm 22.05.8" on Debian 12)."""
        return self._run("sinfo", "--version").stdout.strip()

    def check_up(self) -> None:
        """Raise, saying which, when a daemon has exited or the controller does not answer (before each job)."""
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"Slurm's {name} is not running (exit {proc.returncode}); its log:\n{self.logs(name)}")
        ping = self._run("scontrol", "ping")
        if ping.returncode != 0 or "UP" not in ping.stdout:
            raise RuntimeError(f"slurmctld does not answer `scontrol ping`: {ping.stdout.strip()} {ping.stderr.strip()}")

    def sbatch(self, args: list[str], cwd: Path, env: dict[str, str]) -> int:
        """Submit a job (sbatch --parsable ARGS, from `cwd` with `env` plus SLURM_CONF); its id."""
        self.check_up()
        result = subprocess.run([_which("sbatch"), "--parsable", *args], cwd=cwd, env=self.env(env), capture_output=True,
                                text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` of a job as a dict (JobState, RunTime, Restarts, ...); empty once Slurm forgot it."""
        result = self._run("scontrol", "show", "job", "-o", str(job_id))
        if result.returncode != 0:
            return {}
        return dict(word.split("=", 1) for word in result.stdout.split() if "=" in word)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float, context: Callable[[], str] = str) -> None:
        """Poll `ready` (every POLL_S) until it holds; every 2 s check that the daemons are up (check_up). AssertionError naming
        `what` and showing `context()` (e.g. the job's output) after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        next_check = 0.0
        while not ready():
            now = time.monotonic()
            if self.closing.is_set():
                raise RuntimeError(f"the Slurm cluster is closing: no longer waiting for {what}")
            if now > deadline:
                raise AssertionError(f"no {what} after {timeout:.0f} s:\n{context()}")
            if now > next_check:
                self.check_up()
                next_check = now + 2
            time.sleep(POLL_S)

    def wait_for_end(self, job_id: int, timeout: float, context: Callable[[], str] = str) -> dict[str, str]:
        """The job's record once it has ended (COMPLETED, FAILED, TIMEOUT, ...: not pending, running or requeued)."""
        seen: dict[str, str] = {}

        def ended() -> bool:
            seen.clear()
            seen.update(self.job(job_id))
            return seen.get("JobState") in FINAL_STATES

        self.wait_for(f"end of job {job_id}", ended, timeout, lambda: f"{self.job(job_id)}\n{context()}")
        return dict(seen)

    def signal(self, job_id: int, name: str) -> None:
        """scancel --signal=NAME --batch: the signal to the job's batch shell only (what --signal=B: sends)."""
        result = self._run("scancel", f"--signal={name}", "--batch", str(job_id))
        assert result.returncode == 0, result.stderr

    def requeue(self, job_id: int) -> None:
        result = self._run("scontrol", "requeue", str(job_id))
        assert result.returncode == 0, result.stderr

    def update(self, job_id: int, *settings: str) -> None:
        """scontrol update JobId=ID SETTING...: e.g. TimeLimit=10 (minutes)."""
        result = self._run("scontrol", "update", f"JobId={job_id}", *settings)
        assert result.returncode == 0, result.stderr

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster's jobs and of its slurmstepd (they carry its SLURM_CONF in their environment)."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get("SLURM_CONF") == str(self.conf):
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def stop(self) -> None:
        """Cancel every job, stop slurmd, slurmctld and munged (SIGTERM, SIGKILL after 30 s), then kill what is left of
        the jobs: nothing of this cluster keeps running."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self._run("scancel", "--full", "--user=root", timeout=10)
        for name in reversed(DAEMONS):
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        leftover = [p for p in self.processes() if p.pid not in {d.pid for d in self._procs.values()}]
        for proc in leftover:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(leftover, timeout=10)
