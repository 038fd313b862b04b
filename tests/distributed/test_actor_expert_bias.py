"""The aux-loss-free expert-bias update counts real tokens only, not the padding of padded rows.

DeepSeek-V3's balancing (arXiv 2412.19437, Sec. 2.1.2), as megatron-core applies
it after each step (finalize_model_grads -> get_updated_expert_bias):

    load_i = tokens routed to expert i in the step (all ranks)
    b_i   += rate x sign(mean_j load_j - load_i),   rate = moe_router_bias_update_rate = 1e-3

A batch of 4 rows padded to 24 tokens (38 of the 96 positions are padding) is
trained for one step on two ranks, twice: DP2 with padded rows (each rank counts
its rows, megatron sums the counts), and TP2 (sequence parallel: each rank
counts its half of the tokens) with packed sequences, each padded to an even
length, in 3 microbatches, with the MoE layers recomputed (model.recompute=moe: megatron counts in the
recomputed forward of backward). The expected update is worked out here from
transformers' model: each row run alone at its own length (no padding), its
routers' top-k experts counted per MoE layer. The same count over the padded
rows (what megatron counted before the actor passed its padding mask) gives
another update, so the test can tell them apart.
"""

from __future__ import annotations

import warnings

import torch

from tests.distributed.harness import run_distributed

B, T = 4, 24
LENGTHS = (24, 7, 11, 16)
RATE = 1e-3


def make_batch():
    from megatron_rl.actor import TrainBatch

    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor(LENGTHS)
    tokens = torch.randint(1, 200, (B, T), generator=g)
    tokens = torch.where(torch.arange(T)[None] < lengths[:, None], tokens, 0)  # the actor feeds 0 on padding too
    mask = (torch.arange(T)[None] >= 3) & (torch.arange(T)[None] < lengths[:, None])
    return TrainBatch(tokens=tokens, response_mask=mask, advantages=torch.randn(B, generator=g), sequence_lengths=lengths,
                      old_logprobs=torch.zeros(B, T))


CASES = {  # name -> (layout, train settings, model settings)
    "DP2/padded rows": ({}, {"micro_batch_size": 2}, {}),
    "TP2/packed/recompute": (
        {"tensor_parallel": 2, "expert_tensor_parallel": 2},
        {"pack_sequences": True, "max_tokens_per_microbatch": 26},
        {"recompute": "moe"},
    ),
}


def _worker(rank: int, world_size: int, model_dir: str) -> dict:
    from megatron_rl.actor import Actor
    from megatron_rl.config import AlgorithmConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig
    from megatron_rl.models import export_hf_state_dict
    from megatron_rl.parallel import destroy_parallel, init_parallel

    out = {}
    for name, (layout, train, model) in CASES.items():
        ctx = init_parallel(ParallelConfig(timeout_s=120, **layout))
        try:
            actor = Actor(ctx, model=ModelConfig(path=model_dir, **model), train=TrainConfig(routing_drift_metrics=False, **train),
                          optimizer=OptimizerConfig(name="sgd", lr=0.0, clip_grad=0.0, use_distributed_optimizer=False),
                          algorithm=AlgorithmConfig(loss="gspo"))
            try:
                metrics = actor.train_step(actor.distribute(make_batch() if rank == 0 else None))  # as the trainer
                state = export_hf_state_dict(actor.model, ctx)
            finally:
                actor.close()
        finally:
            destroy_parallel(ctx, keep_world=True)
        biases = {k: v for k, v in state.items() if k.endswith("e_score_correction_bias")}
        out[name] = (metrics["microbatches_per_rank"], biases)
    return out


def _loads(model, rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tokens routed to each expert, per MoE layer's gate, over the given rows (transformers' routers)."""
    loads: dict[str, torch.Tensor] = {}

    def count(name):
        def hook(module, args, output):
            indices = output[-1]  # DeepseekV3TopkRouter -> (logits, weights, indices [tokens, K])
            loads[name] = loads.get(name, 0) + torch.bincount(indices.flatten(), minlength=model.config.n_routed_experts)

        return hook

    handles = [m.register_forward_hook(count(n)) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        for row in rows:
            model(row[None])
    for handle in handles:
        handle.remove()
    return loads


def _updated(initial: dict, loads: dict) -> dict[str, torch.Tensor]:
    out = {}
    for gate, load in loads.items():
        name = f"{gate}.e_score_correction_bias"
        out[name] = initial[name] + RATE * torch.sign(load.double().mean() - load.double()).float()
    return out


def test_expert_bias_update_counts_real_tokens_only(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.tiny import make_tiny_model_dir

    model_dir = str(make_tiny_model_dir(tmp_path / "mla", "deepseek_v3", seed=11, with_tokenizer=False, vocab_size=200,
                                        init_std=0.1, num_hidden_layers=3))
    results = run_distributed(_worker, 2, model_dir, timeout=240)[0]
    initial = load_file(f"{model_dir}/model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = make_batch().tokens
    real = _updated(initial, _loads(reference, [tokens[b, :n] for b, n in enumerate(LENGTHS)]))
    padded = _updated(initial, _loads(reference, list(tokens)))
    assert len(real) == 2  # layers 1 and 2 are MoE
    assert any(not torch.equal(real[k], padded[k]) for k in real), "padding must change the expected update for this test to tell"
    assert results["TP2/packed/recompute"][0] == 3
    for case, (_, got) in results.items():
        assert set(got) == set(real), case
        for name in real:
            assert torch.allclose(got[name], real[name], atol=1e-7), f"{case} {name}: {got[name] - initial[name]} vs {real[name] - initial[name]}"
