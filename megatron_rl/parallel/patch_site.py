"""PatchSite: one megatron-core location the compatibility layer patches, and the version they were read from.

The sites themselves are listed in megatron_rl.parallel.compat_sites (by area,
in the compat_sites_* modules); the conditions a site names in ``when`` are
those of megatron_rl.parallel.availability.
"""

from __future__ import annotations

from dataclasses import dataclass

TESTED_MEGATRON_VERSION = "0.16.1"
"""The megatron-core release the sites' line numbers and source fragments are read from (`megatron-rl doctor`
warns on another; tools/wheelhouse.py pins it)."""

MEGATRON_CORE = "megatron.core."
"""Prefix of every site's module."""
CUDA_ABSENT = ("cuda-absent",)
"""``when`` of a site about CUDA being absent."""
TE_ABSENT = ("te-absent",)
"""``when`` of a site about Transformer Engine being absent."""
CURRENT_DEVICE = "torch.cuda.current_device()"
"""The source fragment most cuda-shim sites rely on."""


@dataclass(frozen=True, kw_only=True)
class PatchSite:
    """One megatron-core location the CPU layer patches."""

    name: str
    """Short identifier of the patch."""
    module: str
    """Dotted megatron-core module."""
    target: str
    """Attribute path inside the module ('' = the module itself, for cuda-shim patches)."""
    lines: tuple[int, ...]
    """Line numbers of the failing code in megatron-core 0.16.1 (documentation)."""
    expects: tuple[str, ...]
    """Source fragments the patch relies on; the check fails when one is gone."""
    kind: str
    """function | method | attribute (replaced/bound in place) | cuda-shim (module-local torch.cuda
    stand-in) | tensor-cuda / tensor-type (Tensor.cuda()/Tensor.type() as seen by this module)."""
    when: tuple[str, ...]
    """Conditions (availability.CONDITIONS) that must all hold for the patch to apply: the situation it is about."""
    why: str
    """What fails and what the patch does."""
    optional: bool = False
    """The module may be absent or fail to import (inference/resharding extras): skip, don't fail."""

    def describe(self) -> str:
        where = f"{self.module}:{self.target}" if self.target else self.module
        lines = ",".join(map(str, self.lines))
        return f"[{self.name}] {where} (megatron-core {TESTED_MEGATRON_VERSION} line {lines})"
