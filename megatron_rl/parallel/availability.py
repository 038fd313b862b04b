"""What this process can use: CUDA, Transformer Engine, NVIDIA apex, the grouped_gemm kernels.

One :class:`Availability` describes the platform; every compatibility binding
(compat_sites.PatchSite.when) and the layer-spec choice (models.build) are
decided from it, never from scattered ``torch.cuda.is_available()`` checks, so
a test can fake any combination (CUDA without TE, a CPU build, ...):

    avail = detect()                                   # this process
    avail = Availability(cuda=True, transformer_engine=False, apex=False, grouped_gemm=False)
    condition_holds("te-absent", avail)                # True

Conditions (a PatchSite is applied when all of its conditions hold):

* ``cuda-absent``: a CPU-only torch build or no visible GPU; megatron-core's
  hard-coded CUDA calls must be redirected to the CPU.
* ``te-absent``: Transformer Engine does not import (no wheel, a wheel built
  for another torch/CUDA, or no CUDA); megatron-core's TE-absent code paths
  have bugs of their own that need bindings, on a GPU as much as on a CPU.
* ``apex-absent``: NVIDIA apex does not import (megatron-core then uses torch
  norms and torch's Adam). PyPI's ``apex`` is an unrelated package: the check
  imports the module megatron-core uses (apex.optimizers.FusedAdam).
* ``grouped-gemm-absent``: the grouped_gemm CUDA kernel package does not import.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from megatron_rl.config.transport import package_imports


@dataclasses.dataclass(frozen=True, kw_only=True)
class Availability:
    """The optional pieces of the platform this process can use."""

    cuda: bool
    """torch sees at least one CUDA device."""
    transformer_engine: bool
    """transformer_engine.pytorch imports (it needs CUDA)."""
    apex: bool
    """NVIDIA apex's apex.optimizers imports."""
    grouped_gemm: bool
    """The grouped_gemm CUDA kernel package imports."""

    def describe(self) -> str:
        """One phrase, e.g. 'CUDA yes, Transformer Engine no, apex no, grouped_gemm no'."""
        yes = {True: "yes", False: "no"}
        return (
            f"CUDA {yes[self.cuda]}, Transformer Engine {yes[self.transformer_engine]}, "
            f"apex {yes[self.apex]}, grouped_gemm {yes[self.grouped_gemm]}"
        )


CONDITIONS: dict[str, Callable[[Availability], bool]] = {
    "cuda-absent": lambda a: not a.cuda,
    "te-absent": lambda a: not a.transformer_engine,
    "apex-absent": lambda a: not a.apex,
    "grouped-gemm-absent": lambda a: not a.grouped_gemm,
}


TORCH_FLOOR = (2, 11)
"""The oldest torch the project runs on (setup.py's floor): 2.11's varlen_attn is the oldest with a causal window
and a scale (models.varlen), and the GPU clusters it was measured on run 2.11."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.11.0+cu130' or '2.13.0a0'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def require_supported_torch(version: str | None = None) -> None:
    """RuntimeError in one line when the installed torch is older than TORCH_FLOOR."""
    version = torch.__version__ if version is None else version
    if torch_release(version) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise RuntimeError(f"torch {version} is older than megatron_rl supports (torch>={floor}): "
                           f"install torch>={floor} (pip install 'torch>={floor}')")


def condition_holds(condition: str, avail: Availability) -> bool:
    """Whether one named condition (see the module docstring) holds on `avail`."""
    try:
        return CONDITIONS[condition](avail)
    except KeyError:
        raise ValueError(f"unknown compatibility condition {condition!r}; known: {sorted(CONDITIONS)}") from None


def all_hold(conditions: tuple[str, ...], avail: Availability) -> bool:
    """Whether every condition in `conditions` holds (a site's `when`)."""
    return all(condition_holds(c, avail) for c in conditions)


def detect() -> Availability:
    """This process's Availability (package import results are cached; CUDA is asked each time)."""
    cuda = torch.cuda.is_available()
    return Availability(
        cuda=cuda,
        transformer_engine=cuda and package_imports("transformer_engine.pytorch"),
        apex=cuda and package_imports("apex.optimizers"),
        grouped_gemm=cuda and package_imports("grouped_gemm"),
    )
