"""Time launch/slurm.sbatch under a real one-node Slurm: from sbatch to the first step, and from the USR1 warning to
the requeued job's first step.

    python bench/slurm_timing.py          # writes bench/results/slurm_timing.json (needs root; apt-get installs Slurm)

The one-node cluster of the tests (tests/e2e/slurm_cluster.py: munged, slurmctld and slurmd from Debian's packages,
its scheduler looking every second, a requeued job eligible again 5 s after its requeue). Each repeat submits one job
of the two-process CPU preset on the tiny model (the tests' overrides: 2 prompts x 4 samples a step) and, once its
first step is logged, sends `scancel --signal=USR1 --batch` (what `#SBATCH --signal=B:USR1@900` sends before the time
limit): the ranks save at the next step boundary, the script requeues the job, and the requeued job resumes. One job
at a time. Reported per repeat, in seconds from sbatch or from the scancel: the job running, its first step (the row
of step 0 in metrics.jsonl), the script's line saying it received the warning, the job requeued and running again,
the requeued launch's first step; and the CPU seconds of the job's processes (sampled every 0.5 s). The medians too.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_rl.models.tiny import make_tiny_model_dir  # noqa: E402
from tests.e2e import slurm_cluster  # noqa: E402
from tests.e2e.slurm_runs import PRESET, WARNING_LINE, Driver, overrides  # noqa: E402

REPEATS = 3
OUT = ROOT / "bench" / "results" / "slurm_timing.json"


class CpuSampler:
    """CPU seconds (user + system) of every process of the cluster's jobs, sampled every 0.5 s until stopped."""

    def __init__(self, cluster: slurm_cluster.SlurmCluster):
        self.cluster, self.seen = cluster, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.5):
            for proc in self.cluster.processes():
                try:
                    times = proc.cpu_times()
                    self.seen[(proc.pid, proc.create_time())] = times.user + times.system
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(sum(self.seen.values()), 1)


def preempt_once(cluster: slurm_cluster.SlurmCluster, work: Path, model_dir: Path) -> dict[str, float]:
    driver = Driver(cluster, work)
    sampler = CpuSampler(cluster)
    run = driver.start([], [str(PRESET), *overrides(model_dir)])
    cluster.signal(run.job, "USR1")
    sent = time.monotonic()
    driver.wait("the script's warning line", lambda: WARNING_LINE in run.read_output())
    received = time.monotonic() - sent
    driver.wait("the requeue", lambda: int(cluster.job(run.job).get("Restarts", 0)) >= 1)
    requeued = time.monotonic() - sent
    driver.wait_for_launch(1)
    running_again = time.monotonic() - sent
    driver.wait_for_step("requeued_first_step", run.rows())
    first_step_again = time.monotonic() - sent
    driver.finish()
    assert run.end["JobState"] == "COMPLETED", f"{run.end}\n{run.output[-3000:]}"
    return {
        "sbatch_to_running_s": run.times["launch_1"],
        "sbatch_to_first_step_s": run.times["first_step"],
        "warning_to_script_s": round(received, 2),
        "warning_to_requeued_s": round(requeued, 2),
        "warning_to_running_again_s": round(running_again, 2),
        "warning_to_requeued_first_step_s": round(first_step_again, 2),
        "job_cpu_s": sampler.stop(),
    }


def main() -> int:
    reason = slurm_cluster.unavailable()
    if reason:
        print(f"bench/slurm_timing.py: no Slurm here: {reason}; nothing measured")
        return 0
    if slurm_cluster.missing_programs():
        slurm_cluster.install()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun gives each rank
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="slurm-bench-") as tmp:
        model_dir = make_tiny_model_dir(Path(tmp) / "tiny-moe", "qwen3_moe", seed=0)
        with slurm_cluster.SlurmCluster.started(Path(tmp) / "cluster") as cluster:
            version = cluster.version()
            runs = []
            for repeat in range(REPEATS):
                runs.append(preempt_once(cluster, Path(tmp) / f"job{repeat}", model_dir))
                print(json.dumps(runs[-1]), flush=True)
    result = {
        "what": " ".join(__doc__.strip().split("\n\n")[0].split()) + " (bench/slurm_timing.py docstring)",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_start": round(load_start, 2),
                    "load_end": round(os.getloadavg()[0], 2), "slurm": version},
        "runs": runs,
        "median": {key: statistics.median(r[key] for r in runs) for key in runs[0]},
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
