"""Checkpoints carry no code: what a resume or a conversion reads from a directory a user names.

Unpickling runs whatever a pickle asks for (`__reduce__` may name os.system),
so a checkpoint directory from elsewhere must not be unpickled freely:

1. rank files (`rank_XXXXX.pt`: RNG states) hold tensors, numbers, strings,
   lists, tuples and dicts only, and are read with `torch.load(...,
   weights_only=True)`, which refuses anything else but the data types
   megatron-core adds to its allow-list (numpy arrays and dtypes, its enums
   and configs: older files held numpy's generator state as an array, and
   load). The numpy generator's state now goes in as a tensor
   (`numpy_state_to_tensors`). A file holding anything else is refused,
   naming the one-time conversion (tools/convert_rank_state.py: numpy values
   to tensors and numbers, for checkpoints you wrote yourself);
2. torch's distributed checkpoint stores its `.metadata` as a plain pickle and
   reads it with `pickle.load`; `check_dcp_metadata` unpickles it first with
   only the classes a metadata file is made of, so a file naming anything
   else is refused before megatron reads it. (megatron's common.pt is read by
   torch.load, weights_only by default.)
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

CONVERT_COMMAND = "python tools/convert_rank_state.py {dir}"
"""The one-time conversion of rank files written before they held tensors only."""

_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType",
    },
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", "device", *(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}
"""What a torch distributed checkpoint's .metadata pickle is made of (torch 2.x): its dataclasses (megatron's saves
keep the save plans there too), torch's sizes and dtypes, paths."""


class PickledCodeError(RuntimeError):
    """A checkpoint file would load something other than data; the message names the file and the global."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise PickledCodeError(f"{module}.{name}")


def check_dcp_metadata(ckpt_dir: str | os.PathLike) -> None:
    """Refuse a dist checkpoint whose .metadata pickle names anything but metadata classes (nothing runs)."""
    for path in sorted(Path(ckpt_dir).glob("*.metadata")):
        try:
            _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except PickledCodeError as error:
            raise PickledCodeError(
                f"{path} asks to load {error} when unpickled: not metadata torch writes, and unpickling it could run "
                "code; refusing it (resume from a checkpoint this project wrote)"
            ) from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
            raise PickledCodeError(f"{path} is not a readable checkpoint metadata file ({error}): the checkpoint is "
                                   "damaged; resume from an older one") from None


def numpy_state_to_tensors(state: tuple) -> dict[str, Any]:
    """np.random.get_state() as weights_only-loadable values (the key array as an int64 tensor)."""
    kind, keys, pos, has_gauss, cached_gaussian = state
    return {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}


def numpy_state_from_tensors(state: dict[str, Any] | tuple) -> tuple:
    """The inverse of numpy_state_to_tensors, for np.random.set_state (an older file's tuple as it is)."""
    if isinstance(state, dict):
        state = (state["kind"], state["keys"], state["pos"], state["has_gauss"], state["cached_gaussian"])
    kind, keys, pos, has_gauss, cached_gaussian = state
    return str(kind), np.asarray(keys).astype(np.uint32), int(pos), int(has_gauss), float(cached_gaussian)


def load_rank_file(path: Path) -> dict[str, Any]:
    """A rank file's state, loaded with weights_only=True. RankFileError naming the file: one that needs more than
    tensors and plain values (with the conversion command), or a damaged one."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        raise RankFileError(
            f"{path} holds pickled Python objects, not only tensors and plain values ({_first_line(error)}): refused, "
            "since unpickling can run code. A checkpoint saved by an older megatron_rl is converted once with "
            f"`{CONVERT_COMMAND.format(dir=path.parent)}` (run it only on checkpoints you wrote yourself)"
        ) from None
    except Exception as error:  # noqa: BLE001 - name the file whatever torch raised
        raise RankFileError(f"cannot read {path}: {error}; the checkpoint is damaged, resume from an older one") from error


class RankFileError(RuntimeError):
    """A rank file is refused or unreadable."""


def _first_line(error: BaseException) -> str:
    """torch's weights_only message names the offending global in its first lines."""
    for line in str(error).splitlines():
        if "GLOBAL" in line or "Unsupported" in line:
            return line.strip()
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def convert_rank_files(ckpt_dir: str | os.PathLike) -> list[Path]:
    """The one-time conversion: rewrite every rank file of a checkpoint this project wrote so it loads with
    weights_only=True (the numpy state as tensors). Unpickles the old files in full: trusted checkpoints only.
    Returns the files rewritten (those already loadable are left alone)."""
    converted = []
    for path in sorted(Path(ckpt_dir).glob("rank_*.pt")):
        try:
            torch.load(path, weights_only=True, map_location="cpu")
            continue
        except pickle.UnpicklingError:
            pass
        state = _plain(torch.load(path, weights_only=False, map_location="cpu"))
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(state, tmp)
            torch.load(tmp, weights_only=True, map_location="cpu")  # what resume will do; raises if still not plain
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        converted.append(path)
    return converted


def _plain(value: Any) -> Any:
    """`value` with numpy arrays as tensors and numpy scalars as Python numbers, containers walked."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value
