"""Dist checkpoints in megatron-core's GroupedMLP layout (routed experts as fused weight1 / weight2).

Through the real module (megatron-core's GroupedMLP runs on the CPU, its grouped GEMM by torch): a converted
checkpoint loaded into a GroupedMLP model gives transformers' logits on the same HF directory, and a GroupedMLP
model's own sharded_state_dict saved by megatron's dist_checkpointing converts back to the source safetensors bit
for bit; at EP1 x TP1 the ShardedTensors the module builds are those of the layout below.

Other EP x TP ranks need a world of that size, so there the pieces are built by hand as transformer/moe/experts.py
documents them (GroupedMLP.sharded_state_dict, non-singleton shards): per EP rank and TP rank,
weight1.view(E_local, H, 2F/TP).transpose(-1, -2) split in its gate (w) and up (v) halves at TP offsets r and TP + r
of 2 TP, and weight2.view(E_local, F/TP, H).transpose(-1, -2) at TP offset r; then merged back as GroupedMLP's
sh_ten_merge_fn does. The tensors megatron's own loader reads from the converter's checkpoint must equal what the
mapping's GroupedExperts builds from the HF tensors, on every EP x TP rank; and pieces saved in that layout by
megatron's saver must convert back to the HF tensors.
"""

from __future__ import annotations

import queue
import warnings
from contextlib import contextmanager

import pytest
import torch

from megatron_rl.models import load_hf_config, parse_hf_config
from megatron_rl.models.mapping import Shard, grouped_expert_mapping
from megatron_rl.models.tiny import make_tiny_model_dir
from tests.unit.test_models_logits import grouped_experts_refused_here
from tests.unit.test_models_mapping import DictReader


def _grouped_state_dict(prefix, hidden, ffn_tp, local, ep_rank, ep, tp_rank, tp):
    """Empty tensors of one EP x TP rank in GroupedMLP's layout, for megatron's loader to fill."""
    weight1, weight2 = torch.empty(hidden, local * 2 * ffn_tp), torch.empty(local * ffn_tp, hidden)
    return _grouped_pieces(prefix, weight1, weight2, hidden, local, ep_rank, ep, tp_rank, tp)




@pytest.mark.parametrize("ep,tp", [(1, 1), (2, 2), (4, 1)])
def test_converted_checkpoint_reads_as_grouped_mlp_weights(tmp_path, ep, tp):
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    from megatron_rl.checkpoint.convert import convert_hf_to_mcore, resolve_mcore_dir
    from megatron_rl.checkpoint.dist_format import single_process_megatron

    model_dir = make_tiny_model_dir(tmp_path / "hf", "qwen3_moe", with_tokenizer=False)
    hf_config = load_hf_config(model_dir)
    arch = parse_hf_config(hf_config)
    hf = load_file(str(model_dir / "model.safetensors"))
    ckpt = resolve_mcore_dir(convert_hf_to_mcore(model_dir, tmp_path / "mcore"))

    hidden, ffn, local = arch.hidden_size, hf_config["moe_intermediate_size"], arch.num_experts // ep
    matrices = ("gate_proj", "up_proj", "down_proj")
    with single_process_megatron(hf_config):
        for layer in range(arch.num_layers):
            prefix = f"decoder.layers.{layer}.mlp.experts."
            ranks = [(ep_rank, tp_rank) for ep_rank in range(ep) for tp_rank in range(tp)]
            # megatron validates that one load covers every stored tensor whole: all ranks' pieces at once
            request = {f"ep{e}_tp{t}": _grouped_state_dict(prefix, hidden, ffn // tp, local, e, ep, t, tp) for e, t in ranks}
            loaded = dist_checkpointing.load(request, str(ckpt))
            for ep_rank, tp_rank in ranks:
                fc1 = grouped_expert_mapping(f"model.layers.{layer}.mlp.experts", "weight1", ep_rank * local, local, matrices)
                fc2 = grouped_expert_mapping(f"model.layers.{layer}.mlp.experts", "weight2", ep_rank * local, local, matrices)
                pieces = loaded[f"ep{ep_rank}_tp{tp_rank}"]
                weight1 = torch.cat([pieces["fc1_w"], pieces["fc1_v"]], -2).transpose(-1, -2).reshape(hidden, -1)
                weight2 = pieces["fc2"].transpose(-1, -2).reshape(-1, hidden)
                assert torch.equal(weight1, fc1.load(DictReader(hf), Shard(1, tp_rank, tp)))
                assert torch.equal(weight2, fc2.load(DictReader(hf), Shard(0, tp_rank, tp)))


def _grouped_pieces(prefix, weight1, weight2, hidden, local, ep_rank, ep, tp_rank, tp):
    """GroupedMLP.sharded_state_dict's ShardedTensors of one EP x TP rank holding `weight1`, `weight2` (documented layout)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    replica = (0, 0, 0)
    gate_up = weight1.view(local, hidden, -1).transpose(-1, -2)
    w, v = torch.chunk(gate_up, 2, -2)
    down = weight2.view(local, -1, hidden).transpose(-1, -2)
    fc1, fc2 = f"{prefix}experts.linear_fc1.weight", f"{prefix}experts.linear_fc2.weight"
    return {
        "fc1_w": ShardedTensor.from_rank_offsets(fc1, w.contiguous(), (0, ep_rank, ep), (1, tp_rank, 2 * tp), replica_id=replica),
        "fc1_v": ShardedTensor.from_rank_offsets(fc1, v.contiguous(), (0, ep_rank, ep), (1, tp + tp_rank, 2 * tp), replica_id=replica),
        "fc2": ShardedTensor.from_rank_offsets(fc2, down.contiguous(), (0, ep_rank, ep), (2, tp_rank, tp), replica_id=replica),
    }


def test_checkpoint_written_in_grouped_mlp_layout_converts_back_bit_exact(tmp_path):
    """EP2 x TP2 GroupedMLP pieces (from the mapping) + the other tensors whole -> megatron's saver -> the converter -> HF."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from safetensors.torch import load_file

    from megatron_rl.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf, resolve_mcore_dir
    from megatron_rl.checkpoint.dist_format import single_process_megatron

    ep, tp = 2, 2
    model_dir = make_tiny_model_dir(tmp_path / "hf", "qwen3_moe", with_tokenizer=False)
    hf_config = load_hf_config(model_dir)
    arch = parse_hf_config(hf_config)
    hf = load_file(str(model_dir / "model.safetensors"))
    sequential = resolve_mcore_dir(convert_hf_to_mcore(model_dir, tmp_path / "mcore"))

    hidden, local = arch.hidden_size, arch.num_experts // ep
    matrices = ("gate_proj", "up_proj", "down_proj")
    grouped_dir = tmp_path / "grouped"
    grouped_dir.mkdir()
    with single_process_megatron(hf_config):
        plain = dist_checkpointing.load_plain_tensors(str(sequential))
        state = {key: ShardedTensor.from_rank_offsets(key, value) for key, value in plain.items() if ".mlp.experts." not in key}
        for layer in range(arch.num_layers):
            prefix = f"decoder.layers.{layer}.mlp.experts."
            for ep_rank in range(ep):
                fc1 = grouped_expert_mapping(f"model.layers.{layer}.mlp.experts", "weight1", ep_rank * local, local, matrices)
                fc2 = grouped_expert_mapping(f"model.layers.{layer}.mlp.experts", "weight2", ep_rank * local, local, matrices)
                for tp_rank in range(tp):
                    weight1, weight2 = fc1.load(DictReader(hf), Shard(1, tp_rank, tp)), fc2.load(DictReader(hf), Shard(0, tp_rank, tp))
                    state[f"{prefix}ep{ep_rank}_tp{tp_rank}"] = _grouped_pieces(prefix, weight1, weight2, hidden, local, ep_rank, ep, tp_rank, tp)
        dist_checkpointing.save(state, str(grouped_dir))
    back = convert_mcore_to_hf(grouped_dir, tmp_path / "back", hf_dir=model_dir)
    out = load_file(str(back / "model.safetensors"))
    assert out.keys() == hf.keys()
    assert all(torch.equal(out[name], hf[name]) for name in hf)


# ----------------------------------------------------------------------------- through megatron-core's GroupedMLP


@pytest.fixture
def in_process_results(monkeypatch):
    """megatron's torch_dist writer hands its results through a queue made at its first save, a multiprocessing
    Manager's (a spawned process); a synchronous save reads them back in this process: a plain queue does."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", queue.Queue())


@contextmanager
def grouped_mlp_model(model_dir, *, load_weights):
    """megatron's single-rank GPTModel of `model_dir` in fp32 with its routed experts as GroupedMLP."""
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models import build_model, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    if grouped_experts_refused_here():
        pytest.skip("fp32 GroupedMLP on a GPU without Transformer Engine: models.build refuses it (test_models_logits)")
    ctx = init_parallel(ParallelConfig(), shape=model_shape(load_hf_config(model_dir)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (model,) = build_model(ModelConfig(path=str(model_dir), dtype="float32", moe_grouped_gemm=True), ctx,
                                   load_weights=load_weights)
        experts = [layer.mlp.experts for layer in model.decoder.layers]
        assert experts and all(type(e).__name__ == "GroupedMLP" for e in experts), [type(e).__name__ for e in experts]
        yield model, ctx
    finally:
        destroy_parallel(ctx)


def _logits(model, ctx, vocab: int) -> torch.Tensor:
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        return model(tokens.to(ctx.device), positions.to(ctx.device), attention_mask=None).cpu()[..., :vocab]


def _transformers_logits(model_dir, vocab: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return reference(tokens).logits


def _tiny_moe(tmp_path):
    # init std 0.1: routing far from uniform, so experts swapped or halves exchanged move the logits
    return make_tiny_model_dir(tmp_path / "hf", "qwen3_moe", seed=5, init_std=0.1, with_tokenizer=False)


def test_a_converted_checkpoint_loaded_into_grouped_mlp_gives_transformers_logits(tmp_path):
    from megatron_rl.checkpoint.convert import convert_hf_to_mcore, load_mcore_checkpoint

    model_dir = _tiny_moe(tmp_path)
    vocab = parse_hf_config(load_hf_config(model_dir)).vocab_size
    ckpt = convert_hf_to_mcore(model_dir, tmp_path / "mcore")
    with grouped_mlp_model(model_dir, load_weights=False) as (model, ctx):
        for layer in model.decoder.layers:  # what the checkpoint must overwrite
            layer.mlp.experts.weight1.data.zero_()
            layer.mlp.experts.weight2.data.zero_()
        load_mcore_checkpoint([model], ckpt)
        got = _logits(model, ctx, vocab)
    expected = _transformers_logits(model_dir, vocab)
    err = (got - expected).abs().max().item()
    assert err < 1e-4, f"max |GroupedMLP from the converted checkpoint - transformers| = {err:.3g}"
    assert expected.abs().max() > 0.1  # logits that a wrong expert would move


def test_a_grouped_mlp_models_own_save_converts_back_bit_exact(tmp_path, in_process_results):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from safetensors.torch import load_file

    from megatron_rl.checkpoint.convert import convert_mcore_to_hf

    model_dir = _tiny_moe(tmp_path)
    hf_config = load_hf_config(model_dir)
    arch = parse_hf_config(hf_config)
    saved = tmp_path / "grouped"
    saved.mkdir()
    with grouped_mlp_model(model_dir, load_weights=True) as (model, ctx):
        # the model holds the HF weights (transformers' logits), so the source safetensors are what must come back
        err = (_logits(model, ctx, arch.vocab_size) - _transformers_logits(model_dir, arch.vocab_size)).abs().max().item()
        assert err < 1e-4, err  # as every logits-vs-transformers check (fp32 on any CPU: 1.4e-6 here)
        state = model.sharded_state_dict()
        hidden, local = arch.hidden_size, arch.num_experts
        for i, layer in enumerate(model.decoder.layers):
            # at EP1 x TP1 the module's own ShardedTensors are the hand-built layout of the tests above
            prefix = f"decoder.layers.{i}.mlp.experts."
            experts = layer.mlp.experts
            fc1, fc2 = state[f"{prefix}weight1"], state[f"{prefix}weight2"]
            assert isinstance(fc1, ShardedTensorFactory) and isinstance(fc2, ShardedTensorFactory)
            built = [*fc1.build(), fc2.build()]
            by_hand = _grouped_pieces(prefix, experts.weight1.detach(), experts.weight2.detach(), hidden, local, 0, 1, 0, 1)
            for real, hand in zip(built, (by_hand["fc1_w"], by_hand["fc1_v"], by_hand["fc2"]), strict=True):
                assert (real.key, real.global_shape, real.global_offset) == (hand.key, hand.global_shape, hand.global_offset)
                assert torch.equal(real.data, hand.data), real.key
        dist_checkpointing.save(model.sharded_state_dict(), str(saved))
    back = convert_mcore_to_hf(saved, tmp_path / "back", hf_dir=model_dir)
    out, source = load_file(str(back / "model.safetensors")), load_file(str(model_dir / "model.safetensors"))
    assert out.keys() == source.keys()
    for name, tensor in source.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
