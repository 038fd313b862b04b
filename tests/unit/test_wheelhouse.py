"""`make wheelhouse`: the wheels install with --no-index into a fresh venv that has only torch, and the package runs.

The wheelhouse is built for this Python (so that it can be installed here); the
venv sees the local torch, and only torch and what torch needs, through a .pth
file pointing at a directory of links into this environment -- as a GPU node
with its torch installed and no registry would be. Needs PyPI to build the
wheelhouse (marked `network`).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def _closure(name: str) -> set[str]:
    """torch and every distribution its requirements (markers evaluated here) pull in, installed here, with the
    extras a requirement asks for (PyPI's CUDA torch: `cuda-toolkit[cublas,cudart,...]`, whose extras are the
    nvidia-* libraries pip checks on a node that has that torch)."""
    seen, done, todo = set(), set(), [(name, frozenset())]
    while todo:
        wanted, extras = todo.pop()
        dist = importlib.metadata.distribution(wanted)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if (key, extras) in done:
            continue
        done.add((key, extras))
        seen.add(key)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": extra}) for extra in ("", *extras)):
                todo.append((req.name, frozenset(req.extras)))
    return seen


def _link_torch_only(target: Path) -> None:
    """Links, in `target`, to the files of torch and its requirements (nothing else of this environment)."""
    target.mkdir()
    for name in _closure("torch"):
        dist = importlib.metadata.distribution(name)
        site = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            link = target / top
            if not link.exists() and (site / top).exists():
                link.symlink_to(site / top)


@pytest.mark.network
def test_wheelhouse_installs_without_an_index_beside_the_local_torch(tmp_path):
    wheels = tmp_path / "wheelhouse"
    built = subprocess.run([sys.executable, "tools/wheelhouse.py", "--out", str(wheels)], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    assert f"pip install --no-index --find-links {wheels} megatron_rl" in built.stdout
    names = sorted(p.name for p in wheels.glob("*.whl"))
    assert any(n.startswith("megatron_rl-") for n in names) and any(n.startswith("megatron_core-0.16.1-") for n in names)
    assert not [n for n in names if re.match(r"(torch|triton|nvidia_)", n)], names  # the node has torch: none of it

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    _link_torch_only(tmp_path / "torch-only")
    (site / "local_torch.pth").write_text(str(tmp_path / "torch-only") + "\n")
    # no index, no configured find-links or constraints: only the wheelhouse (pip reads no config file)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile", "--no-index",
                              "--find-links", str(wheels), "megatron_rl"], env=env, capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]

    probe = ("import torch, megatron.core, megatron_rl, transformers\n"
             "from megatron.core.models.gpt import GPTModel\n"
             "print(torch.__version__, megatron.core.__version__, megatron_rl.__file__)\n")
    ran = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    torch_version, mcore_version, package_file = ran.stdout.split()
    import torch

    assert torch_version == torch.__version__ and mcore_version == "0.16.1"
    assert Path(package_file).is_relative_to(venv), package_file  # installed from the wheel, not this checkout
    plan = subprocess.run([str(venv / "bin" / "megatron-rl"), "plan", "--config", str(REPO / "configs" / "tiny-gspo.yaml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0 and "fits:" in plan.stdout, plan.stdout[-2000:] + plan.stderr[-2000:]
