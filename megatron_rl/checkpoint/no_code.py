"""Checkpoints carry no code: what a resume, an evaluation or a conversion reads from a directory a user names.

Unpickling runs whatever a pickle asks for (`__reduce__` may name os.system),
so nothing in a checkpoint directory is unpickled freely, whatever torch's
default or its environment (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1) say:

1. what torch.save wrote (rank files, megatron's common.pt, each bytes item
   inside a .distcp data file) is read by `load_plain`: `torch.load(...,
   weights_only=True)`, passed explicitly, which builds tensors, numbers,
   strings, lists, tuples and dicts and the data types megatron-core adds to
   its allow-list (numpy arrays and dtypes, its enums and configs), and stops
   at the first other global, before anything of it is built;
2. torch's distributed checkpoint stores its `.metadata` as a plain pickle;
   `read_dcp_metadata` unpickles it with only the classes a metadata file is
   made of (checkpoint.plain_load's readers use it, and `check_dist_checkpoint`
   runs it before megatron's own reader reads the file);
3. JSON and text files (metadata.json, trainer_state.json, `latest`) are
   parsed as such (checkpoint.state).

A refusal is one line naming the file, the item inside it and the global it
asked for (PickledCodeError); a file that cannot be read is one line too
(CheckpointFileError). Rank files written before they held tensors only
(numpy's generator state as an array loads; other numpy values do not) are
refused naming the one-time conversion, tools/convert_rank_state.py.
"""

from __future__ import annotations

import io
import os
import pickle
import re
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


class CheckpointFileError(RuntimeError):
    """A file of a checkpoint directory cannot be read as plain data; the message (one line) names the file, and the
    item inside it where there is one."""


class PickledCodeError(CheckpointFileError):
    """A checkpoint file would load something other than data; the message names the file, the item and the global."""

    def __init__(self, message: str, asked: str = "") -> None:
        super().__init__(message)
        self.asked = asked
        """The global the pickle asked for (module.name)."""


class RankFileError(CheckpointFileError):
    """A rank file is refused or unreadable."""


REFUSED = "not plain data, and unpickling it could run code: refused before anything of it was built"
_ASKED_FOR = (
    re.compile(r"GLOBAL (\S+)"),  # an import of anything not allow-listed (torch's weights_only unpickler)
    re.compile(r"call reduce for unrecognized function (.+?)(?: which belongs to|$)", re.M),
    re.compile(r"allowlisted via `add_safe_globals`,? but got (.+?)$", re.M),
)


def asked_for(error: BaseException) -> str | None:
    """The global a refused pickle asked for, from torch's weights_only message; None when the refusal names none
    (a damaged file)."""
    for pattern in _ASKED_FOR:
        found = pattern.search(str(error))
        if found:
            name = found.group(1).strip().rstrip(".")
            return name if "." in name or " " in name else f"builtins.{name}"  # torch drops the module of builtins
    return None


def one_line(error: BaseException, limit: int = 200) -> str:
    """An exception as one short line: its type and its message's first line (torch's hints dropped)."""
    text = str(error).split("WeightsUnpickler error:")[-1].strip()
    first = text.splitlines()[0].strip() if text else ""
    first = first if len(first) <= limit else first[:limit] + " ..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def where(file: str | os.PathLike, item: str | None = None) -> str:
    return f"{file}, item {item!r}," if item else str(file)


def load_plain(source: str | os.PathLike | io.BytesIO, *, file: str | os.PathLike, item: str | None = None) -> Any:
    """What torch.save wrote, loaded as plain data only: `torch.load(weights_only=True)` passed explicitly (torch's
    default and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD do not change it). `file` and `item` (a key inside a data file)
    name the source in the errors: PickledCodeError for anything else (naming the global it asked for, nothing of
    it built), CheckpointFileError for bytes torch cannot read (truncated, damaged)."""
    try:
        return torch.load(source, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        asked = asked_for(error)
        if asked is not None:
            raise PickledCodeError(f"{where(file, item)} asks to load {asked} when unpickled: {REFUSED}", asked) from None
        raise CheckpointFileError(f"{where(file, item)} is not a plain-data pickle ({one_line(error)}): it is damaged, "
                                  "or was not written by torch.save; refused") from None
    except Exception as error:  # noqa: BLE001 - name the file whatever torch raised (a damaged zip, a short read)
        inside = f"item {item!r}: " if item else ""
        raise CheckpointFileError(f"cannot read {file} ({inside}{one_line(error)}): it is truncated or damaged") from None


_CODE_OPCODES = frozenset({"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD", "EXT1",
                           "EXT2", "EXT4", "PERSID", "BINPERSID"})
"""Pickle opcodes that import or call something: a pickle without them builds plain values only."""


def pickle_asks_for(data: bytes) -> str | None:
    """The first global (or calling opcode) a pickle holds, read from its opcodes without running any; None for a
    pickle of plain values only (None, numbers, strings, bytes, lists, tuples, dicts, sets), and for bytes that stop
    being a pickle before any such opcode (unpickling them fails there, having built nothing else)."""
    import pickletools

    strings: list[str] = []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name == "GLOBAL":
                return str(arg).replace(" ", ".")
            if opcode.name == "STACK_GLOBAL":
                return ".".join(strings[-2:])
            if opcode.name in _CODE_OPCODES:
                return f"the pickle opcode {opcode.name}"
            if isinstance(arg, str):
                strings.append(arg)
    except Exception:  # noqa: BLE001 - not (or no longer) a pickle: nothing of it runs
        return None
    return None


def check_extra_state(value: Any, *, file: str | os.PathLike, item: str) -> None:
    """PickledCodeError unless a layer's `_extra_state` (as load_plain read it) holds plain data all the way down.

    Transformer Engine keeps its FP8 metadata there as a pickle inside the value: a uint8 tensor it unpickles with
    pickle.loads, or (older versions) a BytesIO it torch.loads, in full, when the model loads it. This project saves
    none (no FP8 training): what a TE layer writes without it (None, an empty tensor, the pickle of None) passes."""
    values = value if isinstance(value, (list, tuple)) else [value]
    for each in values:
        if isinstance(each, torch.Tensor) and each.dtype == torch.uint8 and each.numel():
            asked = pickle_asks_for(each.detach().cpu().numpy().tobytes())
            if asked is not None:
                raise PickledCodeError(f"{where(file, item)} holds a pickle that asks to load {asked} (Transformer "
                                       f"Engine would unpickle it in full when the model loads it): {REFUSED}", asked)
        elif isinstance(each, io.BytesIO):
            load_plain(io.BytesIO(each.getvalue()), file=file, item=item)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise PickledCodeError(f"{module}.{name}", f"{module}.{name}")


def read_dcp_metadata(ckpt_dir: str | os.PathLike):
    """torch's distributed-checkpoint Metadata of `ckpt_dir`, unpickled with only the classes such a file is made of.

    PickledCodeError naming the file and the global when it asks for anything else (nothing of it is built);
    CheckpointFileError when it is missing, damaged, not a Metadata, or names a data file outside the directory."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(ckpt_dir) / ".metadata"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except PickledCodeError as error:
        raise PickledCodeError(f"{path} asks to load {error.asked} when unpickled: not metadata torch writes, and "
                               "unpickling it could run code: refused before anything of it was built", error.asked) from None
    except Exception as error:  # noqa: BLE001 - unreadable, truncated (EOFError), a damaged pickle
        raise CheckpointFileError(f"{path} is not a readable checkpoint metadata file ({one_line(error)})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointFileError(f"{path} holds a {type(metadata).__name__}, not torch's checkpoint Metadata: it is "
                                  "damaged")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise CheckpointFileError(f"{path} names the data file {name!r}: not a file of this directory; refused")
    return metadata


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
    """A rank file's state (load_plain). RankFileError naming the file: one that needs more than tensors and plain
    values (with the conversion command), a damaged one, or one without the random states a save writes."""
    try:
        state = load_plain(path, file=path)
    except PickledCodeError as error:
        raise RankFileError(
            f"{path} holds pickled Python objects, not only tensors and plain values (it asks to load {error.asked}): "
            "refused, since unpickling can run code. A checkpoint saved by an older megatron_rl is converted once with "
            f"`{CONVERT_COMMAND.format(dir=path.parent)}` (run it only on checkpoints you wrote yourself)"
        ) from None
    except CheckpointFileError as error:
        raise RankFileError(str(error)) from None
    if not isinstance(state, dict) or not isinstance(state.get("rng"), dict):
        raise RankFileError(f"{path} holds a {type(state).__name__} without the random states (\"rng\") a save writes: "
                            "it is damaged")
    return state


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
