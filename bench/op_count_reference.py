"""transformers' own Qwen3-MoE layer counted beside the actor's (bench/op_count.py): the same model and sequences.

The tiny model directory the actor loads, loaded by transformers (SDPA attention, its default grouped_mm
experts), the same sequences as one right-padded batch with their attention mask; one forward and backward
(its logits' mean log-sum-exp: the layers do not depend on the loss), counted by the same OpCounter with
transformers' modules as the phases: attention = Qwen3MoeAttention (projections, q/k norms, RoPE, SDPA),
router = Qwen3MoeTopKRouter, experts = Qwen3MoeExperts (its sort, gathers and grouped GEMMs: transformers
permutes inside its experts), permutation = the sparse MoE block around them, layer_other = the decoder
layer's norms and residual adds. Per layer = layer phases / layers (one batch: one "microbatch").
"""

from __future__ import annotations

import warnings

import torch

REFERENCE_PHASES = {"Qwen3MoeAttention": "attention", "Qwen3MoeTopKRouter": "router", "Qwen3MoeExperts": "experts",
                    "Qwen3MoeSparseMoeBlock": "permutation", "Qwen3MoeDecoderLayer": "layer_other"}


def padded_batch(lengths, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, W], attention mask [B, W]) of sequences of `lengths`, right-padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(list(lengths))
    tokens = torch.randint(0, vocab, (len(lengths), int(lengths.max())), generator=g)
    return tokens, (torch.arange(tokens.shape[1])[None] < lengths[:, None]).long()


def count_transformers(model_dir: str, lengths, counter_factory, per_layer) -> dict:
    """{"train_step": per-layer counts of a forward + backward, "forward": of a no-grad forward, "model": how it ran};
    counter_factory() -> OpCounter over the bench's phases; per_layer(counts, layers, microbatches) -> per-layer figures."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                     experts_implementation="grouped_mm")
    model.train()
    tokens, mask = padded_batch(lengths, model.config.vocab_size)
    counter = counter_factory()
    handles = []
    for module in model.modules():
        phase = REFERENCE_PHASES.get(type(module).__name__)
        if phase is not None:
            handles.append(module.register_forward_pre_hook(lambda m, a, p=phase: counter.enter(p)))
            handles.append(module.register_forward_hook(lambda m, a, o: counter.exit()))

    def step():
        model(input_ids=tokens, attention_mask=mask).logits.logsumexp(-1).mean().backward()

    def forward():
        with torch.no_grad():
            model(input_ids=tokens, attention_mask=mask)

    try:
        step()  # warm-up: lazy initialisation is not counted
        layers = model.config.num_hidden_layers
        out = {"model": {"transformers_attention": model.config._attn_implementation,
                         "transformers_experts": model.config._experts_implementation, "batch": list(tokens.shape)}}
        for name, run in (("train_step", step), ("forward", forward)):
            with counter:
                run()
            counts, names = counter.take()
            out[name] = per_layer(counts, layers, 1) | {"top_ops": names}
    finally:
        for handle in handles:
            handle.remove()
    return out
