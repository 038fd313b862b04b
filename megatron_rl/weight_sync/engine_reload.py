"""A push loaded into a vLLM worker's model in place: every layer that holds a pushed tensor gets it, or the push fails.

vLLM 0.32's in-place reload (vllm.model_executor.model_loader.reload, what
`model_runner.reload_weights` runs), in three steps:
1. `initialize_layerwise_reload(model)`: each layer's tensors go back to the
   meta device in checkpoint format and its weight loaders are wrapped;
2. `model.load_weights(weights)`: a layer is rebuilt (materialised, loaded,
   processed: fused, re-packed) once all of its parts have arrived;
3. `finalize_layerwise_reload(model, model_config)`: a layer that got nothing
   is given its old tensors back, with nothing but a warning in vLLM's log
   ("ParallelLMHead: Failed to load weights").
`reload_in_place` runs the same three steps and, between 2 and 3, names every
parameter of a layer that got nothing: the push then fails with
WeightNotLoadedError (after step 3, so the model is whole again).

Tied output layers (tie_word_embeddings: SmolLM2 and the other small Llama
models, the small Qwen2 / Qwen3 dense ones): vLLM's ParallelLMHead shares the
input embedding's parameter, so a checkpoint (and every push, which carries
the checkpoint's names) holds only `model.embed_tokens.weight`. On the CPU the
output layer multiplies by its own copy of that weight, packed when the layer
is processed (vLLM's UnquantizedEmbeddingMethod -> dispatch_cpu_unquantized_gemm,
oneDNN), and step 1 puts each layer on a meta tensor of its own, so the
embedding's update never reached the packed copy: the engine kept the old
output layer (vLLM's reload docstring: "Tied parameters will only reflect
processing from one of the parent layers"). With the aliases apart during the
reload, vLLM's loader takes `lm_head.weight` like any weight; so each pushed
tensor is also given under every other name the model's parameter has
(`tied_names`, read from the model as vLLM built it), and each layer that
holds it is rebuilt from it.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from megatron_rl.weight_sync.manifest import WeightPushError


class WeightNotLoadedError(WeightPushError):
    """A layer of the engine's model got none of a push's tensors (its parameters are named)."""


def tied_names(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the other names of the same parameter in `model` (tied weights; empty when none)."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    return {name: tuple(other for other in names if other != name) for names in names_of.values() if len(names) > 1 for name in names}


def with_tied(weights: Iterable[tuple[str, torch.Tensor]], tied: dict[str, tuple[str, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`weights`, each tensor followed by its tied names (each name once: a push that carries a tied name too keeps
    its own tensor for it, which the manifest checked)."""
    given: set[str] = set()
    for name, tensor in weights:
        if name not in given:
            given.add(name)
            yield name, tensor
        for alias in tied.get(name, ()):
            if alias not in given:
                given.add(alias)
                yield alias, tensor


def layers_not_loaded(model: torch.nn.Module) -> list[str]:
    """Parameters of the layers that the reload under way (between steps 2 and 3) gave nothing.

    A layer counts when it has loadable parameters: rotary embeddings hold buffers only (computed, never in a
    checkpoint) and attention layers' scales are processed at step 3 (vLLM's deferred attention layers)."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    missing = []
    for prefix, layer in model.named_modules():
        params = [name for name, param in layer._parameters.items() if param is not None and name not in SKIP_LOAD_TENSORS]
        if not params or is_deferred_attention_layer(layer):
            continue
        info = get_layerwise_info(layer)
        if info.can_load() and info.load_numel <= 0:
            missing += [f"{prefix}.{name}" if prefix else name for name in params]
    return missing


def reload_in_place(runner: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load `weights` (HF names, checkpoint format) into the runner's model, tied names included (module docstring);
    raises WeightNotLoadedError, once the model is whole again, when a layer got none of them."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = runner.get_model()
    tied = tied_names(model)  # before step 1, which gives each layer a tensor of its own
    initialize_layerwise_reload(model)
    try:
        model.load_weights(with_tied(weights, tied))
        missing = layers_not_loaded(model)
    finally:
        finalize_layerwise_reload(model, runner.model_config)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as model_runner.reload_weights does
        getattr(runner, reset, lambda: None)()
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise WeightNotLoadedError(
            f"the engine's model loaded none of the push's tensors into {shown}: vLLM's loader took no tensor for "
            f"{'it' if len(missing) == 1 else 'them'}, so the engine would serve the old values"
        )


def reload_model_directory(runner: Any) -> None:
    """Load the model directory's weights (the engine's version 0) back into the runner's model (see reload_in_place)."""
    from vllm.model_executor.model_loader import get_model_loader

    loader = get_model_loader(runner.vllm_config.load_config)
    reload_in_place(runner, loader.get_all_weights(runner.model_config, runner.get_model()))
