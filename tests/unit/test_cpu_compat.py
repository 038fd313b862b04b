"""The megatron-core CPU compatibility layer: every patched target still exists and looks as
expected (fails loudly, naming the site, when an upgrade moves one), and the patches behave."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from megatron_rl.parallel import cpu_compat
from megatron_rl.parallel.availability import CONDITIONS, Availability, condition_holds, detect
from megatron_rl.parallel.cpu_compat import SITES, PatchSite, PatchTargetError, apply_cpu_compat, check_patch_targets

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is applied only when CUDA is absent")


def test_every_patch_target_exists_and_looks_as_expected():
    checked = check_patch_targets()
    required = [s for s in SITES if not s.optional]
    assert len(checked) >= len(required)
    for site in required:
        assert site.describe() in checked


def test_sites_are_documented():
    names = [s.name for s in SITES]
    assert len(names) == len(set(names)), "patch names must be unique"
    for site in SITES:
        assert site.module.startswith("megatron.core."), site
        assert site.lines and all(n > 0 for n in site.lines), site
        assert site.why and site.kind in {"function", "method", "attribute", "cuda-shim", "tensor-cuda", "tensor-type"}, site
        assert "0.16.1 line" in site.describe()


def _site(**changes) -> PatchSite:
    base = next(s for s in SITES if s.name == "rng-tracker-fork")
    return dataclasses.replace(base, **changes)


def test_missing_target_fails_loudly_naming_the_site():
    fake = _site(name="fake-fork", target="CudaRNGStatesTracker.fork_renamed_upstream")
    with pytest.raises(PatchTargetError) as info:
        check_patch_targets([fake])
    msg = str(info.value)
    assert "fake-fork" in msg
    assert "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork_renamed_upstream" in msg
    assert "no longer exists" in msg and "line 242" in msg


def test_changed_source_fails_loudly_naming_the_site():
    fake = _site(name="fake-expr", expects=("torch.cuda.expression_that_was_rewritten()",))
    with pytest.raises(PatchTargetError, match=r"\[fake-expr\].*expected source .*expression_that_was_rewritten"):
        check_patch_targets([fake])


def test_shim_site_whose_expression_disappeared_fails():
    shim = next(s for s in SITES if s.name == "mappings-device")
    fake = dataclasses.replace(shim, name="fake-shim", expects=("torch.cuda.gone_in_next_release()",))
    with pytest.raises(PatchTargetError, match=r"fake-shim.*megatron.core.tensor_parallel.mappings"):
        check_patch_targets([fake])


def test_missing_module_fails_unless_optional():
    fake = _site(name="fake-module", module="megatron.core.module_removed_upstream", target="")
    with pytest.raises(PatchTargetError, match=r"fake-module.*cannot import megatron.core.module_removed_upstream"):
        check_patch_targets([fake])
    assert check_patch_targets([dataclasses.replace(fake, optional=True)]) == []


# ----------------------------------------------------------------------------------------------
# Conditions: each site is applied under the condition it is about, decided by one Availability.


def _avail(cuda: bool, te: bool, apex: bool = False, gg: bool = False) -> Availability:
    return Availability(cuda=cuda, transformer_engine=te, apex=apex, grouped_gemm=gg)


ALL = {s.name for s in SITES}
TE_ABSENT = {"te-general-gemm", "mla-te-stubs"}  # megatron-core 0.16.1 bugs without TE, on any device
TORCH_ADAM = {"distopt-torch-adam-step"}  # torch's Adam is the inner optimizer without TE and apex
TORCH_NORM = {"norm-sequence-parallel"}  # the torch norm is the local spec's norm without apex
GROUPED = {"grouped-gemm-fallback", "grouped-mlp-bf16"}  # the torch stand-in for the grouped_gemm kernels
TORCH_GMM = {"grouped-gemm-fallback"}  # torch's grouped matmul wherever the package is absent (bf16 on Hopper GPUs)


@pytest.mark.parametrize(
    ("avail", "expected"),
    [
        (_avail(cuda=False, te=False), ALL),  # a CPU build: everything
        (_avail(cuda=True, te=False), TE_ABSENT | TORCH_ADAM | TORCH_NORM | TORCH_GMM),  # a GPU without TE (an air-gapped node, a failed TE build)
        (_avail(cuda=True, te=True), TORCH_NORM | TORCH_GMM),  # TE without apex: megatron's torch norm class is still patched
        (_avail(cuda=True, te=True, apex=True, gg=True), set()),  # a full GPU stack: nothing
        (_avail(cuda=False, te=True), ALL - TE_ABSENT - TORCH_ADAM),  # not a real platform; the function still answers
        (_avail(cuda=True, te=False, apex=True), TE_ABSENT | TORCH_GMM),
        (_avail(cuda=False, te=False, gg=True), ALL - GROUPED),
    ],
    ids=["cpu", "cuda-no-te", "cuda-te", "cuda-te-apex-gg", "no-cuda-te", "cuda-apex-no-te", "cpu-with-gg"],
)
def test_sites_applied_under_their_condition(avail, expected):
    assert {s.name for s in cpu_compat.sites_for(avail)} == expected


def test_every_site_states_a_known_condition():
    for site in SITES:
        assert site.when and set(site.when) <= set(CONDITIONS), site
        if site.kind in {"cuda-shim", "tensor-cuda", "tensor-type"}:
            assert site.when == ("cuda-absent",), f"{site.name}: a CUDA redirect must be about CUDA being absent"
    with pytest.raises(ValueError, match="unknown compatibility condition 'gpu-absent'"):
        condition_holds("gpu-absent", _avail(cuda=False, te=False))


def test_detect_describes_this_platform():
    avail = detect()
    assert avail.cuda == torch.cuda.is_available()
    if not avail.cuda:  # TE, apex and grouped_gemm are CUDA builds
        assert not (avail.transformer_engine or avail.apex or avail.grouped_gemm)
    assert avail.describe().startswith(f"CUDA {'yes' if avail.cuda else 'no'}, Transformer Engine ")


@pytest.mark.parametrize(
    ("impl", "avail", "use_te", "words"),
    [
        ("auto", _avail(cuda=True, te=False), False, "layer spec: local (model.transformer_impl=auto, CUDA present but Transformer Engine does not import"),
        ("auto", _avail(cuda=False, te=False), False, "layer spec: local (model.transformer_impl=auto, no CUDA"),
        ("auto", _avail(cuda=True, te=True), True, "layer spec: transformer_engine (model.transformer_impl=auto, Transformer Engine imports"),
        ("local", _avail(cuda=True, te=True), False, "layer spec: local (model.transformer_impl=local;"),
        ("transformer_engine", _avail(cuda=True, te=True), True, "layer spec: transformer_engine"),
    ],
)
def test_spec_choice_says_which_and_why(impl, avail, use_te, words):
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.build import spec_choice

    chosen, line = spec_choice(ModelConfig(transformer_impl=impl), avail)
    assert chosen is use_te and line.startswith(words) and "\n" not in line


@pytest.mark.parametrize(("avail", "why"), [(_avail(cuda=False, te=False), "it needs CUDA"), (_avail(cuda=True, te=False), "does not import")])
def test_spec_choice_refuses_te_where_it_is_not_usable(avail, why):
    from megatron_rl.config.core import ConfigError
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.build import spec_choice

    with pytest.raises(ConfigError, match=rf"model.transformer_impl=transformer_engine.*{why}.*model.transformer_impl=auto or local"):
        spec_choice(ModelConfig(transformer_impl="transformer_engine"), avail)


_GPU_NO_TE = """
from megatron_rl.parallel.availability import Availability
from megatron_rl.parallel import cpu_compat
import megatron.core.tensor_parallel.mappings as mappings, torch
applied = cpu_compat.apply_compat(Availability(cuda=True, transformer_engine=False, apex=False, grouped_gemm=False))
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer import multi_latent_attention as mla
print(sorted(applied), moe_utils.te_general_gemm, mla.HAVE_TE, mappings.torch is torch, torch.Tensor.cuda is cpu_compat._ORIG_TENSOR_CUDA, cpu_compat.is_applied())
"""


def test_gpu_without_te_gets_the_te_absent_bindings_and_no_cpu_redirects():
    """What apply_compat does on a CUDA machine without TE, in a fresh process (the CUDA redirects must stay off)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _GPU_NO_TE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    expected = sorted(TE_ABSENT | TORCH_ADAM | TORCH_NORM | TORCH_GMM)
    assert out.stdout.strip().splitlines()[-1] == f"{expected} None False True True False"


# ----------------------------------------------------------------------------------------------
# Behaviour (CPU builds only).


@pytest.fixture(scope="module")
def applied():
    if torch.cuda.is_available():
        pytest.skip("the CPU layer is applied only when CUDA is absent")
    assert apply_cpu_compat() is True
    assert apply_cpu_compat() is True  # idempotent
    return True


def test_check_still_passes_after_apply(applied):
    check_patch_targets()
    assert cpu_compat.is_applied() and cpu_compat.patched_sites()


def test_shim_is_local_to_patched_modules(applied):
    from megatron.core.tensor_parallel import mappings

    assert mappings.torch.cuda.current_device() == torch.device("cpu")
    assert mappings.torch.zeros(2, device="cuda").device.type == "cpu"
    assert mappings.torch.Tensor is torch.Tensor and mappings.torch.distributed is torch.distributed
    # torch itself is untouched
    assert torch.cuda.current_device is not mappings.torch.cuda.current_device
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2, device="cuda")


def test_causal_mask_and_streams(applied):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher  # noqa: F401
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(3)
    assert mask.device.type == "cpu" and mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    from megatron.core.transformer.moe import token_dispatcher

    stream = token_dispatcher.torch.cuda.Stream()
    assert stream is token_dispatcher.torch.cuda.current_stream()
    with token_dispatcher.torch.cuda.stream(stream):
        pass
    stream.record_event().synchronize()
    split = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    assert split.tolist() == [1, 2] and not torch.is_tensor(split)


def test_rng_tracker_uses_the_cpu_generator(applied):
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.model_parallel_cuda_manual_seed(123, tp_rank=1, ep_rank=0, etp_rank=0, force_reset_rng=True)
    tracker = mrandom.get_cuda_rng_tracker()
    torch.manual_seed(7)
    outside_before = torch.get_rng_state()
    with tracker.fork():  # model-parallel-rng: seed + 2718 + tp_rank
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside_before), "fork must restore the default CPU state"
    with tracker.fork():
        b = torch.rand(3)  # continues the tracked stream
    ref = torch.Generator().manual_seed(123 + 2718 + 1)
    assert torch.equal(a, torch.rand(3, generator=ref)) and torch.equal(b, torch.rand(3, generator=ref))
    with tracker.fork(mrandom.get_expert_parallel_rng_tracker_name()):
        c = torch.rand(2)
    assert torch.equal(c, torch.rand(2, generator=torch.Generator().manual_seed(123 + 1024)))
    # checkpoint-recompute helpers read/write the same (CPU) generator
    state = mrandom._get_cuda_rng_state()
    x = torch.rand(2)
    mrandom._set_cuda_rng_state(state)
    assert torch.equal(x, torch.rand(2))


def test_norm_accepts_sequence_parallel_and_marks_params(applied):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = types.SimpleNamespace(
        layernorm_zero_centered_gamma=False,
        persist_layer_norm=False,
        sequence_parallel=True,
        memory_efficient_layer_norm=False,
        normalization="RMSNorm",
    )
    norm = WrappedTorchNorm(config=config, hidden_size=8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    assert config.sequence_parallel is True  # the caller's config is not modified
    config.sequence_parallel = False
    assert not any(getattr(p, "sequence_parallel", True) for p in WrappedTorchNorm(config=config, hidden_size=8).parameters())


def test_tensor_type_and_cuda_only_change_for_megatron_callers(applied):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)  # asserted torch.cuda.FloatTensor
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5)
    assert p.type() == "torch.FloatTensor"  # any other caller sees torch's answer
    assert p.type(torch.float64).dtype == torch.float64
    with pytest.raises((AssertionError, RuntimeError)):
        torch.ones(1).cuda()


def test_te_general_gemm_bound(applied):
    from megatron.core.transformer.moe import moe_utils

    assert hasattr(moe_utils, "te_general_gemm")


def test_rope_table_sliced_per_cp_rank(applied):
    """Unpacked context parallelism: rank r takes chunks r and 2CP-1-r of the RoPE table (pinned memory dropped)."""
    from megatron.core.models.common.embeddings import rope_utils

    class Group:  # only size() and rank() are read
        def __init__(self, size: int, rank: int):
            self._size, self._rank = size, rank

        def size(self) -> int:
            return self._size

        def rank(self) -> int:
            return self._rank

    table = torch.arange(8.0)[:, None, None, None]  # [s, 1, 1, d]: position p holds p
    assert rope_utils.get_pos_emb_on_this_cp_rank(table, 0, Group(2, 0)).flatten().tolist() == [0, 1, 6, 7]
    assert rope_utils.get_pos_emb_on_this_cp_rank(table, 0, Group(2, 1)).flatten().tolist() == [2, 3, 4, 5]


def test_grouped_gemm_fallback_is_the_per_expert_product(applied):
    """gg.ops.gmm: expert e's rows of a times b[e] (b[e]^T with trans_b), gradients through autograd, written out here."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    assert gg.grouped_gemm_is_available()
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor([2, 0, 3])  # an expert without tokens
    a = torch.randn(5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    out = gg.ops.gmm(a, b, sizes, trans_b=False)
    expected = torch.cat([a[:2] @ b[0], a[2:] @ b[2]])
    assert out.shape == (5, 6) and torch.allclose(out, expected, atol=1e-12)
    grad_out = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    out.backward(grad_out)
    assert torch.allclose(a.grad, torch.cat([grad_out[:2] @ b[0].T, grad_out[2:] @ b[2].T]), atol=1e-12)
    assert torch.allclose(b.grad[0], a[:2].T @ grad_out[:2], atol=1e-12) and torch.all(b.grad[1] == 0)
    assert torch.allclose(b.grad[2], a[2:].T @ grad_out[2:], atol=1e-12)
    transposed = gg.ops.gmm(a, b.transpose(-1, -2).contiguous(), sizes, trans_b=True)
    assert torch.allclose(transposed, expected, atol=1e-12)
    with pytest.raises(ValueError, match="sum to the rows of a"):
        gg.ops.gmm(a, b, torch.tensor([1, 1, 1]))
