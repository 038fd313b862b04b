"""The kernel choices (models.kernels) against faked machines: each choice keyed on the piece that is present."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.config import ConfigError, ModelConfig
from megatron_rl.models.kernels import Kernels, choose_attention, choose_dispatcher, choose_experts, choose_fusions, choose_kernels

CPU = Kernels(cuda=False, torch_grouped_mm=True)
H200_NO_TE = Kernels(cuda=True, capability=(9, 0), torch_grouped_mm=True, varlen_attention=True, jit_compiler=True)
A100_NO_TE = Kernels(cuda=True, capability=(8, 0), torch_grouped_mm=True, varlen_attention=True, jit_compiler=True)
H200_TE = Kernels(cuda=True, capability=(9, 0), te=True, apex=True, torch_grouped_mm=True, varlen_attention=True, jit_compiler=True)
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("kernels,requested,use_te,dtype,expected", [
    (CPU, None, False, FP32, "sequential"),                 # CPU keeps one GEMM per expert by default
    (CPU, True, False, FP32, "torch_grouped_mm"),
    (Kernels(cuda=False), True, False, FP32, "per_expert_loop"),
    (H200_NO_TE, None, False, BF16, "torch_grouped_mm"),    # the lent H200: grouped by default, on torch's kernel
    (H200_NO_TE, False, False, BF16, "sequential"),
    (H200_NO_TE, None, False, FP32, "sequential"),          # no fp32 grouped kernel on the GPU
    (A100_NO_TE, None, False, BF16, "sequential"),
    (Kernels(cuda=True, capability=(8, 0), grouped_gemm_package=True), None, False, BF16, "grouped_gemm"),
    (H200_TE, None, True, BF16, "te_grouped"),
])
def test_expert_kernel(kernels, requested, use_te, dtype, expected):
    assert choose_experts(kernels, requested, use_te=use_te, dtype=dtype)[0] == expected


def test_grouped_experts_asked_for_where_none_runs_name_the_key():
    with pytest.raises(ConfigError, match="model.moe_grouped_gemm=true"):
        choose_experts(A100_NO_TE, True, use_te=False, dtype=BF16)
    with pytest.raises(ConfigError, match="model.dtype"):
        choose_experts(H200_NO_TE, True, use_te=False, dtype=FP32)


@pytest.mark.parametrize("kernels,use_te,dtype,cp,expected", [
    (CPU, False, FP32, 1, "per_sequence"),
    (H200_NO_TE, False, BF16, 1, "varlen"),
    (H200_NO_TE, False, BF16, 2, "per_sequence"),   # CP chunks need the position mask
    (H200_NO_TE, False, FP32, 1, "per_sequence"),   # flash is half precision only
    (Kernels(cuda=True, capability=(9, 0)), False, BF16, 1, "per_sequence"),  # a torch without varlen_attn
    (H200_TE, True, BF16, 1, "te"),
])
def test_packed_attention_kernel(kernels, use_te, dtype, cp, expected):
    assert choose_attention(kernels, use_te=use_te, dtype=dtype, context_parallel=cp)[0] == expected


def test_fusions_follow_their_kernels():
    on, off = choose_fusions(CPU, use_te=False)
    assert not any(on.values()) and set(off) == set(on)  # CPU: every fusion off, each with its reason
    on, off = choose_fusions(H200_NO_TE, use_te=False)
    assert {k for k, v in on.items() if v} == {"bias_activation_fusion", "bias_dropout_fusion"}
    assert "Transformer Engine" in off["apply_rope_fusion"]
    on, _ = choose_fusions(H200_TE, use_te=True)
    assert {k for k, v in on.items() if not v} == {"persist_layer_norm"}  # apex's layer norm is the local spec's


def test_the_start_up_line_says_what_and_why():
    choice = choose_kernels(H200_NO_TE, ModelConfig(), use_te=False, dtype=BF16, data_parallel=8)
    line = choice.describe()
    assert choice.moe_grouped_gemm and choice.overlap_grad_reduce
    assert "experts torch_grouped_mm" in line and "attention varlen" in line
    assert "fusions on: bias_activation_fusion, bias_dropout_fusion;" in line
    assert "apply_rope_fusion off: needs Transformer Engine's fused RoPE" in line
    cpu = choose_kernels(CPU, ModelConfig(), use_te=False, dtype=FP32, data_parallel=2)
    assert not cpu.moe_grouped_gemm and not cpu.overlap_grad_reduce and "overlap_grad_reduce off (CPU)" in cpu.describe()
    assert "fusions on: none; all fusions off: no CUDA" in cpu.describe()
    # megatron's own @jit_fuser functions compile where its fusions do, and run eagerly elsewhere
    assert choice.jit_fusions and "megatron's jit functions compiled;" in line
    assert not cpu.jit_fusions and "megatron's jit functions eager;" in cpu.describe()
    # the MoE dispatch and the compiled regions, each with its reason
    assert "MoE dispatch sorted (one gather each way, no host sync)" in line
    assert line.endswith("compiled regions: none (model.compile_regions=false)")
    compiled = choose_kernels(H200_NO_TE, ModelConfig(compile_regions=True), use_te=False, dtype=BF16)
    assert compiled.compiled_regions == ("packed_rope",) and compiled.describe().endswith("compiled regions: packed_rope")
    no_triton = Kernels(cuda=True, capability=(9, 0), torch_grouped_mm=True, varlen_attention=True)
    assert not choose_kernels(no_triton, ModelConfig(), use_te=False, dtype=BF16).jit_fusions
    assert not choose_kernels(H200_NO_TE, ModelConfig(fusions=False), use_te=False, dtype=BF16).jit_fusions


def test_the_cpu_build_uses_the_cpu_choices():
    """What the detected machine gives here (no CUDA): the settings megatron-core on CPU needs."""
    from megatron_rl.models.kernels import detect_kernels

    kernels = detect_kernels()
    if kernels.cuda:
        pytest.skip("a GPU is present: this checks the CPU platform's choices")
    choice = choose_kernels(kernels, ModelConfig(), use_te=False, dtype=FP32)
    assert (choice.experts, choice.attention, any(choice.fusions.values())) == ("sequential", "per_sequence", False)


def test_the_model_config_can_turn_each_kernel_off_for_comparisons():
    choice = choose_kernels(H200_NO_TE, ModelConfig(fusions=False, packed_attention="per_sequence", moe_grouped_gemm=False),
                            use_te=False, dtype=BF16)
    assert (choice.experts, choice.attention, any(choice.fusions.values())) == ("sequential", "per_sequence", False)
    assert choice.fusions_off_why["bias_activation_fusion"] == "model.fusions=false"
    with pytest.raises(ConfigError, match="model.packed_attention=varlen cannot run here.*CPU"):
        choose_kernels(CPU, ModelConfig(packed_attention="varlen"), use_te=False, dtype=FP32)


@pytest.mark.parametrize("requested,use_te,split,fusion,expected", [
    ("auto", False, 1, False, "sorted"),        # every expert on this rank: one gather each way
    ("auto", False, 2, False, "alltoall"),      # experts over EP x expert-TP ranks: megatron's all-to-all
    ("auto", True, 1, False, "alltoall"),       # the Transformer Engine spec keeps megatron's dispatcher
    ("auto", False, 1, True, "alltoall"),       # TE's fused permute is megatron's dispatcher's
    ("sorted", False, 1, False, "sorted"),
    ("allgather", False, 1, False, "allgather"),
    ("alltoall", False, 1, False, "alltoall"),
])
def test_moe_dispatch(requested, use_te, split, fusion, expected):
    assert choose_dispatcher(requested, use_te=use_te, experts_per_rank_split=split, permute_fusion=fusion)[0] == expected


def test_the_sorted_dispatch_asked_for_where_it_cannot_run_names_the_key():
    with pytest.raises(ConfigError, match=r"model.token_dispatcher=sorted cannot run here \(experts split over 4 ranks"):
        choose_dispatcher("sorted", use_te=False, experts_per_rank_split=4)
