"""Load an HF safetensors checkpoint into megatron model chunks of any TP/PP/EP layout.

Each rank reads only its own slices: safetensors files are memory-mapped and
`get_slice` reads the rows (or columns) of this rank's TP shard, the experts of
its EP rank and the layers of its pipeline stage. Peak extra memory is one
parameter shard, not the checkpoint.

Checkpoints may be one `model.safetensors`, shards listed by
`model.safetensors.index.json`, or shards without an index. Before anything is
copied, the tensor names are checked against the ones the config implies:
missing or unexpected tensors are an error that names them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatron_rl.models.hf_config import UnsupportedModelError, load_hf_config, parse_hf_config, refuse_quantized
from megatron_rl.models.families import get_family
from megatron_rl.models.info import model_info
from megatron_rl.models.mapping import GlobalNamer, named_weights, Shard, check_split_dim, expected_hf_names, is_expert_param, mapping_for, unwrap_model

# Buffers transformers sometimes saves that megatron recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsCheckpoint:
    """Name -> file of an HF safetensors checkpoint, with sliced reads (implements mapping.HFReader)."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UnsupportedModelError(f"{index} is malformed ({err!r}): it needs a 'weight_map' of tensor -> file") from None
            self.files = {name: self.dir / fname for name, fname in weight_map.items()}
            missing = sorted({str(p) for p in self.files.values() if not p.is_file()})
            if missing:
                raise UnsupportedModelError(f"{index} lists shard files that do not exist: {missing[:5]}")
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise UnsupportedModelError(
                    f"{str(self.dir)!r} holds no *.safetensors weights (only safetensors are read; convert .bin "
                    "checkpoints with transformers' save_pretrained(safe_serialization=True)), or set model.load_weights=false"
                )
            self.files = {}
            for shard in shards:
                try:
                    with safe_open(str(shard), framework="pt") as fh:
                        for name in fh.keys():
                            self.files[name] = shard
                except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                    raise UnsupportedModelError(
                        f"cannot read {str(shard)!r}: {err}; the file is truncated or damaged: download or convert it again"
                    ) from None
        self._open: dict[Path, object] = {}
        self._safe_open = safe_open

    def names(self) -> list[str]:
        return list(self.files)

    def _handle(self, name: str):
        if name not in self.files:
            raise UnsupportedModelError(f"tensor {name!r} is missing from the checkpoint in {str(self.dir)!r}")
        path = self.files[name]
        if path not in self._open:
            try:
                self._open[path] = self._safe_open(str(path), framework="pt")
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise UnsupportedModelError(
                    f"cannot read {str(path)!r}: {err}; the file is truncated or damaged: download or convert it again"
                ) from None
        return self._open[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        handle = self._handle(name)
        if dim is None:
            return handle.get_tensor(name)
        view = handle.get_slice(name)
        index = [slice(None)] * len(view.get_shape())
        index[dim] = slice(start, stop)
        return view[tuple(index)]

    def close(self) -> None:
        self._open.clear()


def check_checkpoint_names(arch, names: list[str], where: str) -> None:
    """Error naming missing or unexpected tensors (a tied model may still carry lm_head.weight)."""
    expected = set(expected_hf_names(arch))
    family = get_family(arch.family)
    present = {n for n in names if not n.endswith(_IGNORED_SUFFIXES) and not family.hf_name_ignored(arch, n)}
    if arch.tie_word_embeddings:
        present.discard("lm_head.weight")
    missing, extra = sorted(expected - present), sorted(present - expected)
    if missing or extra:
        raise UnsupportedModelError(
            f"checkpoint in {where!r} does not match its config.json ({arch.family}, {arch.num_layers} layers, "
            f"{arch.num_experts} experts): " + names_mismatch(missing, extra)
        )


def names_mismatch(missing: list[str], extra: list[str]) -> str:
    """'N missing (e.g. [...]); M unexpected (e.g. [...])': a checkpoint's tensor names against the expected ones."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {missing[:4]})")
    if extra:
        parts.append(f"{len(extra)} unexpected (e.g. {extra[:4]})")
    return "; ".join(parts)


WRONG_SHAPE_FIX = ("the safetensors do not match config.json (a damaged or edited file, or weights of another model): "
                   "download or convert the model again, or point model.path at the directory they came from")


def _stored_shapes(checkpoint: SafetensorsCheckpoint, names: list[str]) -> str:
    """'tensor NAME of shape (..)' for each stored tensor a parameter is made from."""
    shapes = []
    for name in names:
        try:
            shapes.append(f"tensor {name!r} of shape {checkpoint.shape(name)}")
        except Exception:  # noqa: BLE001 - missing or unreadable: still name it
            shapes.append(f"tensor {name!r}")
    return " and ".join(shapes)


def _shard(ctx, global_name: str, tp_dim: int | None) -> Shard:
    if tp_dim is None:
        return Shard(None)
    if is_expert_param(global_name):
        return Shard(tp_dim, ctx.expert_tp_rank, ctx.expert_tp_size)
    return Shard(tp_dim, ctx.tp_rank, ctx.tp_size)


@torch.no_grad()
def load_hf_weights(model_chunks: list, hf_dir: str | os.PathLike, ctx) -> None:
    """Copy the HF checkpoint in `hf_dir` into this rank's parameters (every parameter is written)."""
    hf_config = load_hf_config(hf_dir)
    refuse_quantized(hf_config, f"{hf_dir}/config.json")
    arch = parse_hf_config(hf_config, source=f"{hf_dir}/config.json")
    info = model_info(model_chunks)
    if arch != info.arch:
        raise UnsupportedModelError(f"{hf_dir}/config.json describes another model than the one built ({arch} vs {info.arch})")
    checkpoint = SafetensorsCheckpoint(hf_dir)
    try:
        check_checkpoint_names(arch, checkpoint.names(), str(hf_dir))
        num_local_experts = arch.num_experts // ctx.ep_size if arch.num_experts else 0
        for chunk in model_chunks:
            model = unwrap_model(chunk)
            to_global = GlobalNamer(model, ctx.ep_rank, num_local_experts)
            for local_name, param in named_weights(model):
                global_name = to_global(local_name)
                mapping = mapping_for(arch, global_name, info.padded_vocab_size)
                check_split_dim(global_name, mapping, param, strict=not info.use_te)
                try:
                    value = mapping.load(checkpoint, _shard(ctx, global_name, mapping.tp_dim))
                except (RuntimeError, ValueError, IndexError) as err:  # a stored tensor of the wrong size: name it
                    raise UnsupportedModelError(
                        f"{hf_dir}: {_stored_shapes(checkpoint, mapping.hf_names)} cannot make {global_name} of shape "
                        f"{tuple(param.shape)} on this rank ({' '.join(str(err).split())}): {WRONG_SHAPE_FIX}"
                    ) from None
                if tuple(value.shape) != tuple(param.shape):
                    raise UnsupportedModelError(
                        f"{mapping.hf_names} -> {global_name}: shape {tuple(value.shape)} does not fit the parameter's "
                        f"{tuple(param.shape)} on this rank (TP {ctx.tp_size}, EP {ctx.ep_size}): {WRONG_SHAPE_FIX}"
                    )
                param.data.copy_(value.to(dtype=param.dtype))
    finally:
        checkpoint.close()
