"""Collect the wheels an air-gapped node with torch already installed lacks: megatron_rl, megatron-core, their deps.

    make wheelhouse PYTHON_VERSION=3.12                     # -> wheelhouse/ (the node's Python)
    python tools/wheelhouse.py --python-version 3.12 --out wheelhouse
    # on the node, beside its torch:
    pip install --no-index --find-links wheelhouse megatron_rl

What goes in: this package as a wheel (`pip wheel --no-deps .`), and setup.py's
core requirements (megatron-core at the version the compatibility layer is
written for, transformers, ...) with everything they need,
downloaded by `pip download --only-binary=:all:` for the target Python and
manylinux x86_64 -- except torch and what only torch needs, which the node has
(a CUDA torch is gigabytes and must match its driver). To resolve without
downloading torch, pip is handed a metadata-only stand-in wheel
``torch==<--torch-version>+wheelhouse`` (no files, no requirements) from a
local directory and constrained to it; the stand-in is deleted afterwards.
Extras (vLLM, Transformer Engine, ...) are not collected: their CUDA builds are
tied to the node's torch and CUDA.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDIN_LOCAL = "wheelhouse"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from floors import core_requirements as setup_core_requirements  # noqa: E402  (tools/, beside this script)


def core_requirements() -> list[str]:
    """setup.py's CORE list, as written there, without torch."""
    return [r for r in setup_core_requirements() if not re.match(r"torch\b", r)]


def tested_megatron_version() -> str:
    """megatron-core's version the compatibility layer is written against (parallel/patch_site.py)."""
    text = (ROOT / "megatron_rl" / "parallel" / "patch_site.py").read_text()
    return re.search(r'^TESTED_MEGATRON_VERSION = "([^"]+)"', text, flags=re.MULTILINE).group(1)


def write_torch_standin(directory: Path, version: str) -> Path:
    """A wheel named torch-<version>+wheelhouse that holds only its metadata and requires nothing."""
    full = f"{version}+{STANDIN_LOCAL}"
    path = directory / f"torch-{full}-py3-none-any.whl"
    info = f"torch-{full}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {full}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: megatron_rl-wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        zf.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return path


def platform_tags(glibc: str) -> list[str]:
    """manylinux x86_64 tags a node with glibc `glibc` (e.g. 2.28) runs, newest first."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def setuptools_builds_wheels() -> bool:
    """Whether this Python's setuptools can build this package's wheel without an isolated build environment.

    setuptools has its own bdist_wheel from 70.1; an older one needs the `wheel` package beside it. Where neither
    is here (setuptools 65 in a fresh Python 3.11 venv), pip builds in isolation with setuptools from the index.
    """
    import importlib.util

    def present(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except ImportError:
            return False

    return present("setuptools") and (present("setuptools.command.bdist_wheel") or present("wheel"))


def build(out: Path, python_version: str, torch_version: str, glibc: str, pip: list[str]) -> list[str]:
    """Fill `out` with the wheels; return their file names."""
    out.mkdir(parents=True, exist_ok=True)
    isolation = ["--no-build-isolation"] if setuptools_builds_wheels() else []
    subprocess.run([*pip, "wheel", "--no-deps", *isolation, "-q", "-w", str(out), str(ROOT)], check=True)
    with tempfile.TemporaryDirectory(prefix="torch-standin-") as tmp:
        standin = write_torch_standin(Path(tmp), torch_version)
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={torch_version}+{STANDIN_LOCAL}\nmegatron-core=={tested_megatron_version()}\n")
        cmd = [*pip, "download", "-q", "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
               *[arg for tag in platform_tags(glibc) for arg in ("--platform", tag)],
               "--find-links", tmp, "-c", str(constraints), "-d", str(out), *core_requirements()]
        subprocess.run(cmd, check=True)
        (out / standin.name).unlink(missing_ok=True)
    return sorted(p.name for p in out.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    current = f"{sys.version_info.major}.{sys.version_info.minor}"
    parser.add_argument("--python-version", default=current, help=f"the node's Python, e.g. 3.12 (default: this one, {current})")
    parser.add_argument("--torch-version", default="2.11.0", help="the node's torch, to resolve requirements against (default 2.11.0)")
    parser.add_argument("--glibc", default="2.28", help="the node's glibc: newest manylinux tag taken (default 2.28)")
    parser.add_argument("--out", default=str(ROOT / "wheelhouse"), help="directory for the wheels (default ./wheelhouse)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version {args.python_version!r}: give major.minor, e.g. 3.12")
    names = build(Path(args.out), args.python_version, args.torch_version, args.glibc, [sys.executable, "-m", "pip"])
    print(f"{len(names)} wheels in {args.out} for CPython {args.python_version}; on the node, beside its torch:")
    print(f"  pip install --no-index --find-links {args.out} megatron_rl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
