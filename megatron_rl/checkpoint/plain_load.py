"""megatron's dist-checkpoint load, with every pickled part of a checkpoint read as plain data.

What megatron-core 0.16.1 (torch_dist backend) reads from a checkpoint directory, and how it is read here:

1. metadata.json: JSON (megatron's `maybe_load_config`); `check_dist_checkpoint`
   checks it is the torch_dist / torch layout this module reads;
2. common.pt (the state dict's non-sharded part: the optimizer's param groups):
   megatron's TorchCommonLoadStrategy calls torch.load with torch's default,
   which TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 turns into a full unpickling.
   `PlainCommonLoadStrategy` reads it with no_code.load_plain (weights_only=True);
3. `.metadata` (torch DCP's index of the data files): a plain pickle that torch's
   FileSystemReader reads with pickle.load. `check_dist_checkpoint` unpickles it
   first with only torch's metadata classes (no_code.read_dcp_metadata), and the
   readers made here (`PlainMetadataReader`) read it that way themselves;
   megatron's own tensor read reads it again after that check;
4. the bytes items of the `__*_*.distcp` data files (megatron's ShardedObjects:
   each layer's `_extra_state`, the distributed optimizer's param groups and
   bucket sizes): torch's DefaultLoadPlanner.load_bytes, which megatron's
   MCoreLoadPlanner inherits, runs torch.load(weights_only=False) on each.
   `PlainTorchDistLoadStrategy` takes every ShardedObject out of what megatron
   loads and reads them itself with `PlainBytesLoadPlanner` (load_plain), so
   megatron's planner is only ever handed tensors. A layer's `_extra_state` may
   hold a pickle of its own, which Transformer Engine unpickles in full when the
   model loads it: it must hold plain values only (no_code.check_extra_state);
5. the tensor items of the data files: torch's FileSystemReader already loads
   each with torch.load(weights_only=True).

`load_dist_checkpoint` is `dist_checkpointing.load` with both strategies, after
`check_dist_checkpoint`. Both strategies are megatron's own classes with one
method each replaced, passed to megatron's load as its API allows (nothing of
megatron or torch is patched).
"""

from __future__ import annotations

import io
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron_rl.checkpoint.no_code import (
    CheckpointFileError, check_extra_state, load_plain, one_line, read_dcp_metadata,
)

CONFIG_FILE = "metadata.json"
"""megatron's description of a dist checkpoint: which backends wrote it."""
BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}
"""What this module reads: megatron's torch_dist data files beside a torch common.pt."""


def check_dist_checkpoint(ckpt_dir: str | os.PathLike):
    """CheckpointFileError (PickledCodeError) naming the file unless `ckpt_dir`'s metadata.json is megatron's
    torch_dist description and its .metadata holds torch's metadata classes only; returns that metadata."""
    path = Path(ckpt_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise CheckpointFileError(f"cannot read {path} ({error.strerror or error}): the checkpoint is incomplete") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointFileError(f"{path} is not JSON text ({one_line(error)}): it is damaged") from None
    if not isinstance(config, dict):
        raise CheckpointFileError(f"{path} holds a JSON {type(config).__name__}, not megatron's checkpoint description")
    for key, backend in BACKENDS.items():
        if config.get(key) != backend:
            raise CheckpointFileError(f"{path} says {key}={config.get(key)!r}: this reads megatron's {key}={backend!r} "
                                      "checkpoints only (what dist_checkpointing.save writes by default)")
    return read_dcp_metadata(ckpt_dir)


class PlainMetadataReader(FileSystemReader):
    """torch DCP's file reader whose `.metadata` is unpickled with torch's metadata classes only (read once)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._checked_metadata = None

    def read_metadata(self):
        if self._checked_metadata is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata = read_dcp_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:  # as torch's own reader leaves it
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._checked_metadata = metadata
        return self._checked_metadata


class PlainBytesLoadPlanner(DefaultLoadPlanner):
    """torch DCP's load planner with each bytes item read by no_code.load_plain (torch's runs torch.load with
    weights_only=False), naming its data file and key when refused. The state dict is neither flattened nor copied
    (its keys are the checkpoint's): each value read lands in the dict given to the load."""

    def __init__(self, ckpt_dir: str | os.PathLike) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._dir = Path(ckpt_dir)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        storage = (self.metadata.storage_data or {}).get(read_item.storage_index)
        data_file = self._dir / storage.relative_path if storage is not None else self._dir
        key = read_item.dest_index.fqn
        loaded = load_plain(value, file=data_file, item=key)
        if "._extra_state" in key:  # a pickle inside, which Transformer Engine unpickles when the model loads it
            check_extra_state(loaded, file=data_file, item=key)
        self.state_dict[key] = loaded


class PlainTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron's torch_dist load strategy with its ShardedObjects (the bytes items) read as plain data.

    1. the ShardedObjects are taken out of the request and read first, with torch DCP, PlainMetadataReader and
       PlainBytesLoadPlanner (a collective: every rank calls it, with or without objects of its own), so a refused
       item stops the load before any tensor is read;
    2. each object gets the value stored under its unique key: megatron stores, per key, the list of the values of
       the ShardedObjects that share it, in their order in the state dict (strategies/torch.py);
    3. megatron's own load reads the tensors (its planner never sees a bytes item).
    """

    def load(self, sharded_state_dict: dict, checkpoint_dir: str | os.PathLike) -> dict:
        from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, merge
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        objects, tensors = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedObject))
        objects = self._load_objects(objects, Path(checkpoint_dir))
        return merge(super().load(tensors, checkpoint_dir), objects)

    @staticmethod
    def _load_objects(objects: dict, ckpt_dir: Path) -> dict:
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
        from torch.distributed.checkpoint import load as dcp_load

        sharing: dict[str, int] = defaultdict(int)
        for obj in nested_values(objects):
            sharing[obj.unique_key] += 1
        state: dict[str, Any] = {key: io.BytesIO() for key in sharing}
        dcp_load(state, storage_reader=PlainMetadataReader(ckpt_dir), planner=PlainBytesLoadPlanner(ckpt_dir))
        values = {}
        for key, count in sharing.items():
            stored = state[key]
            if not isinstance(stored, list) or len(stored) != count:
                raise CheckpointFileError(
                    f"{ckpt_dir}: item {key!r} holds {type(stored).__name__} of {len(stored) if isinstance(stored, list) else 1}"
                    f" value(s), where megatron stores a list of {count}: the checkpoint is damaged or from another model")
            values[key] = iter(stored)
        return dict_list_map_inplace(lambda obj: next(values[obj.unique_key]), objects)

    def load_tensors_metadata(self, checkpoint_dir, metadata=None):
        return super().load_tensors_metadata(checkpoint_dir, metadata or read_dcp_metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir) -> dict:
        """Every stored tensor and object, as megatron's own method gives them, from the restricted .metadata."""
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        metadata = read_dcp_metadata(checkpoint_dir)
        found = {key: ShardedObject.empty_from_unique_key(key) for key, stored in metadata.state_dict_metadata.items()
                 if isinstance(stored, BytesStorageMetadata)}
        return {**found, **self.load_tensors_metadata(checkpoint_dir, metadata)}


class PlainCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron's common.pt strategy with the file read by no_code.load_plain, and a dict required of it."""

    def load_common(self, checkpoint_dir: str | os.PathLike) -> dict:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.is_file():
            raise CheckpointFileError(f"{path} is missing: the checkpoint is incomplete")
        state = load_plain(path, file=path)
        if not isinstance(state, dict):
            raise CheckpointFileError(f"{path} holds a {type(state).__name__}, not the dict megatron writes: it is damaged")
        return state


def load_dist_checkpoint(sharded_state_dict: dict, ckpt_dir: str | os.PathLike, **kwargs) -> dict:
    """`dist_checkpointing.load` (every rank) with the plain-data strategies, after check_dist_checkpoint."""
    from megatron.core import dist_checkpointing

    check_dist_checkpoint(ckpt_dir)
    return dist_checkpointing.load(sharded_state_dict, str(ckpt_dir), sharded_strategy=PlainTorchDistLoadStrategy(),
                                   common_strategy=PlainCommonLoadStrategy(), **kwargs)
