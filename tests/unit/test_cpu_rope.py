"""rollout.cpu_rope against the installed vLLM: its CPU rotary kernel misreads multi-latent attention's
[tokens, heads, dim] layouts, and the fix rotates them as vLLM's own torch implementation does.

The reference is `RotaryEmbedding.forward_native` (vLLM's torch code, the path every CPU takes for a yarn-scaled
RoPE); the kernel is the real `_C.rotary_embedding`. The engine-level check (a DeepSeek-V3 engine's logprobs
against transformers') is tests/e2e/test_vllm_families.py's MLA test, where the processor runs vLLM's MLA.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from tests.extras import VLLM_EXTRA

pytestmark = pytest.mark.extra(VLLM_EXTRA, "vllm")


@pytest.fixture(scope="module")
def vllm_config():
    pytest.importorskip("vllm")  # the extra marker says which extra; a broken install fails below
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _kernel_forward():
    """vLLM's own RotaryEmbedding.forward_cpu (the kernel call), whether or not this process installed the fix."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return getattr(RotaryEmbedding.forward_cpu, "__wrapped__", RotaryEmbedding.forward_cpu)


def _rope(rotary_dim: int, head_size: int, neox: bool):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    return RotaryEmbedding(head_size, rotary_dim, 64, 10000.0, neox, torch.float32)


def test_the_installed_kernel_still_misreads_multi_latent_layouts(vllm_config):
    """If this fails, vLLM fixed its kernel: rollout.cpu_rope.install then changes nothing, and can go."""
    from megatron_rl.rollout.cpu_rope import kernel_misreads_heads

    assert kernel_misreads_heads()


def _mla_layout(tokens=7, heads=4, nope=32, rope=32, latent=288, seed=0):
    """A [T, H, nope + rope] query and a [T, latent + rope] latent, as vLLM's MLA wrapper holds them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, nope + rope, generator=g), torch.randn(tokens, latent + rope, generator=g)


@pytest.mark.parametrize("neox", [False, True])
def test_the_fix_rotates_multi_latent_layouts_as_vllms_torch_code_does(vllm_config, neox):
    from megatron_rl.rollout.cpu_rope import forward_cpu_flat

    rope = _rope(32, 32, neox)
    query, latent = _mla_layout()
    positions = torch.tensor([0, 1, 2, 5, 9, 3, 40])
    want_q, want_k = rope.forward_native(positions, query[..., 32:].clone(), latent[:, 288:].unsqueeze(1).clone())

    # the kernel itself gets the layout wrong (what the fix is for)
    q, k = query.clone(), latent.clone()
    _kernel_forward()(rope, positions, q[..., 32:], k[:, 288:].unsqueeze(1))
    assert not torch.allclose(q[..., 32:], want_q, atol=1e-5)

    # fixed: as the MLA wrapper calls it, in place and returned; nothing outside the rotary parts touched
    q, k = query.clone(), latent.clone()
    q_view, k_view = q[..., 32:], k[:, 288:].unsqueeze(1)
    got_q, got_k = forward_cpu_flat(_kernel_forward())(rope, positions, q_view, k_view)
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(q[..., 32:], want_q, rtol=0, atol=1e-5)  # the caller's tensors, in place
    torch.testing.assert_close(k[:, 288:], want_k[:, 0], rtol=0, atol=1e-5)
    assert torch.equal(q[..., :32], query[..., :32]) and torch.equal(k[:, :288], latent[:, :288])


def test_the_fix_leaves_flat_and_contiguous_layouts_right(vllm_config):
    """[tokens, heads x dim] views (every other attention layer's) go to the kernel as they are; a contiguous
    [tokens, heads, dim] query, a partial rotary dimension and no key are rotated as the torch code does."""
    from megatron_rl.rollout.cpu_rope import forward_cpu_flat

    fixed = forward_cpu_flat(_kernel_forward())
    g = torch.Generator().manual_seed(1)
    positions = torch.arange(6)
    rope = _rope(16, 32, True)  # partial rotary: 16 of 32
    qkv = torch.randn(6, 3 * 4 * 32, generator=g)
    want_q, want_k = rope.forward_native(positions, qkv[:, :128].clone(), qkv[:, 128:256].clone())
    got = qkv.clone()
    fixed(rope, positions, got[:, :128], got[:, 128:256])
    torch.testing.assert_close(got[:, :256], torch.cat([want_q, want_k], 1), rtol=0, atol=1e-5)
    assert torch.equal(got[:, 256:], qkv[:, 256:])

    query = torch.randn(6, 4, 32, generator=g)
    want_q, _ = rope.forward_native(positions, query.clone(), None)
    got_q, got_k = fixed(rope, positions, query.clone(), None)
    assert got_k is None
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=1e-5)


def _worker_ext_fixes(queue) -> None:
    import vllm.model_executor.layers.rotary_embedding.base as base

    import megatron_rl.rollout.worker_ext  # noqa: F401

    queue.put(getattr(base.RotaryEmbedding.forward_cpu, "__wrapped__", None) is not None)


@pytest.mark.parametrize("name,fixed", [("EngineCore_DP0", True), ("VllmWorker-0", True), ("SpawnProcess-1", False)])
def test_vllms_own_processes_install_the_fix_when_they_import_the_worker_extension(name, fixed):
    """vLLM names its engine-core process EngineCore_DP<i> and its workers VllmWorker-<rank>; either imports the worker
    extension before it builds its model, and that import installs the fix. Any other process (the test harness's
    forkserver imports the module too) starts no OpenMP threads for the probe: forked children would hang in theirs."""
    pytest.importorskip("vllm")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=_worker_ext_fixes, args=(queue,), name=name)
    process.start()
    try:
        assert queue.get(timeout=300) is fixed
    finally:
        process.join(timeout=60)
