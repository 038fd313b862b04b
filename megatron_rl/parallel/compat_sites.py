"""The megatron-core 0.16.1 sites the compatibility layer patches, one PatchSite each.

Data only: what each site is, where it lives, the source it relies on, why it
fails and under which condition (``when``: CUDA absent, Transformer Engine
absent, apex absent, the grouped_gemm kernels absent; see
megatron_rl.parallel.availability). megatron_rl.parallel.cpu_compat applies the
sites whose conditions hold on this platform and checks that every target still
looks like this. Most sites are about CUDA being absent; the te-absent ones
(te-general-gemm, mla-te-stubs) are needed on a GPU without Transformer Engine
too, where every model build otherwise fails.

The sites are written down by area, one module each:

* compat_sites_cuda: calls into the CUDA runtime (the RNG generator, streams,
  the current device, ``device="cuda"``);
* compat_sites_libraries: the code paths for Transformer Engine, apex or the
  grouped_gemm kernels being absent;
* compat_sites_gloo: the uneven list collectives gloo lacks;
* compat_sites_tensor: ``Tensor.cuda()`` calls and ``Tensor.type()`` checks.

PatchSite and TESTED_MEGATRON_VERSION are megatron_rl.parallel.patch_site's,
importable from here too.
"""

from __future__ import annotations

from megatron_rl.parallel.compat_sites_cuda import CUDA_RUNTIME_SITES
from megatron_rl.parallel.compat_sites_gloo import GLOO_COLLECTIVE_SITES
from megatron_rl.parallel.compat_sites_libraries import MISSING_LIBRARY_SITES
from megatron_rl.parallel.compat_sites_tensor import TENSOR_METHOD_SITES
from megatron_rl.parallel.patch_site import TESTED_MEGATRON_VERSION, PatchSite

SITES: tuple[PatchSite, ...] = (*CUDA_RUNTIME_SITES, *MISSING_LIBRARY_SITES, *GLOO_COLLECTIVE_SITES, *TENSOR_METHOD_SITES)
"""Every site, in the order cpu_compat applies and lists them."""

__all__ = ["SITES", "TESTED_MEGATRON_VERSION", "PatchSite"]
