"""What an engine's model accepts in a weight push: HF tensor names and shapes.

The manifest is read from the safetensors headers of the checkpoint the engine
loaded (no tensor data is read), so names are Hugging Face state-dict keys,
exactly what `export_hf_weights` yields. A push is checked against it before
any engine weight is touched:

1. every name is in the manifest (a typo or a wrong mapping names the tensor);
2. every shape equals the checkpoint's; the dtype may differ (the engine
   casts between floating-point dtypes) but not its kind: a floating-point
   weight comes as floating point, an integer one as integers;
3. no name comes twice;
4. the push is complete: every manifest tensor is in it. vLLM reloads a
   layer only once all of its fused parameters (qkv_proj, gate_up_proj,
   w13_weight, ...) have arrived; a layer pushed in part would be rebuilt
   from uninitialised memory, so a partial push is refused.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable


SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}
"""safetensors' dtype codes -> torch's dtype names."""
_FLOAT_CODES = frozenset(code for code, name in SAFETENSORS_DTYPES.items() if "float" in name)


class WeightPushError(ValueError):
    """A weight push was refused; the engine still holds its previous weights."""


@dataclass
class WeightManifest:
    """HF tensor name -> shape (and checkpoint dtype) of the engine's model."""

    shapes: dict[str, tuple[int, ...]]
    """Required tensors: name -> shape."""
    dtypes: dict[str, str] = field(default_factory=dict)
    """Checkpoint dtype of each tensor (informational: pushes may use another dtype)."""
    optional: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Tensors accepted but not required (lm_head.weight of a tied-embedding model: the engine's output layer gets the
    embedding's tensor when a push leaves it out, weight_sync.engine_reload)."""

    def to_json(self) -> dict:
        return {
            "shapes": {k: list(v) for k, v in self.shapes.items()},
            "dtypes": dict(self.dtypes),
            "optional": {k: list(v) for k, v in self.optional.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> "WeightManifest":
        return cls(
            shapes={k: tuple(v) for k, v in data["shapes"].items()},
            dtypes=dict(data.get("dtypes", {})),
            optional={k: tuple(v) for k, v in data.get("optional", {}).items()},
        )

    def shape_of(self, name: str) -> tuple[int, ...] | None:
        return self.shapes.get(name, self.optional.get(name))

    def check_tensor(self, name: str, shape: Iterable[int]) -> None:
        """Raise WeightPushError unless `name` is known and `shape` matches."""
        expected = self.shape_of(name)
        if expected is None:
            close = difflib.get_close_matches(name, list(self.shapes) + list(self.optional), n=3, cutoff=0.6)
            hint = f"; closest known names: {close}" if close else ""
            raise WeightPushError(
                f"weight push refused: tensor {name!r} is not a weight of the engine's model "
                f"({len(self.shapes)} known HF names){hint}. Nothing was loaded."
            )
        shape = tuple(int(d) for d in shape)
        if shape != tuple(expected):
            raise WeightPushError(
                f"weight push refused: tensor {name!r} has shape {list(shape)} but the engine's model "
                f"expects {list(expected)}. Nothing was loaded."
            )


    def check_dtype(self, name: str, dtype: object) -> None:
        """Raise WeightPushError when a torch dtype is not of the kind (floating point or not) of the checkpoint's."""
        code = self.dtypes.get(name)
        is_float = getattr(dtype, "is_floating_point", None)
        if code not in SAFETENSORS_DTYPES or is_float is None or (code in _FLOAT_CODES) == bool(is_float):
            return  # (a code this table does not know is not judged)
        raise WeightPushError(
            f"weight push refused: tensor {name!r} comes as {str(dtype).removeprefix('torch.')} but the engine's "
            f"checkpoint holds {code} ({SAFETENSORS_DTYPES[code]}): the kind of dtype must match (the engine casts between float dtypes only). "
            "Nothing was loaded."
        )


class PushValidator:
    """Checks a push bucket by bucket, then its completeness (see the module docstring)."""

    def __init__(self, manifest: WeightManifest):
        self.manifest = manifest
        self.seen: set[str] = set()
        self.num_bytes = 0

    def check_bucket(self, bucket: Iterable[tuple[str, object]]) -> None:
        for name, tensor in bucket:
            shape = tuple(tensor.shape)
            self.manifest.check_tensor(name, shape)
            self.manifest.check_dtype(name, getattr(tensor, "dtype", None))
            if name in self.seen:
                raise WeightPushError(f"weight push refused: tensor {name!r} appears twice in one push. Nothing was loaded.")
            self.seen.add(name)
            self.num_bytes += int(tensor.numel()) * int(tensor.element_size())  # type: ignore[attr-defined]

    def check_complete(self) -> None:
        missing = [n for n in self.manifest.shapes if n not in self.seen]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise WeightPushError(
                f"weight push refused: {len(missing)} of the model's {len(self.manifest.shapes)} tensors are missing "
                f"({shown}{more}). A push must carry every weight (vLLM rebuilds a layer only from all of its "
                "fused parts). Nothing was loaded."
            )


def manifest_from_checkpoint(model_dir: str | os.PathLike) -> WeightManifest:
    """Read tensor names, shapes and dtypes from a model directory's safetensors headers."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightPushError(
            f"{model_dir}: no *.safetensors files; weight sync needs the engine's model in safetensors format"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                shapes[name] = tuple(int(d) for d in piece.get_shape())
                dtypes[name] = str(piece.get_dtype())
    optional: dict[str, tuple[int, ...]] = {}
    config_path = model_dir / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        text_config = config.get("text_config", config)
        embed = "model.embed_tokens.weight"
        if text_config.get("tie_word_embeddings") and "lm_head.weight" not in shapes and embed in shapes:
            optional["lm_head.weight"] = shapes[embed]
    return WeightManifest(shapes=shapes, dtypes=dtypes, optional=optional)
