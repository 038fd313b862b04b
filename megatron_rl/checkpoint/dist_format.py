"""megatron's dist checkpoint format, as megatron itself defines it, written and read a piece at a time.

A megatron dist checkpoint (torch_dist backend) is a PyTorch Distributed
Checkpoint (DCP) directory plus megatron's metadata.json and common.pt. Its
keys, global shapes and the pieces each parameter is stored as are whatever
`GPTModel.sharded_state_dict()` says; nothing here hard-codes them:

    1. build the single-rank (TP = PP = EP = 1) model of the HF config on the
       meta device (no memory, a fraction of a second);
    2. its sharded_state_dict gives, per parameter, a ShardedTensor or a
       ShardedTensorFactory (SwiGLU fc1 is stored as two pieces, gate and up, so
       any TP can load it); building the factory on the meta tensor gives the
       pieces' keys, offsets and shapes;
    3. writing: every checkpoint key becomes a DCP `_Checkpointable` whose pieces
       are computed only when DCP's writer asks for them: the parameter's value
       from the HF tensors (models/mapping.py, the one HF <-> megatron mapping),
       then megatron's own factory run on that value. DCP's single-threaded
       writer asks for one piece at a time in plan order and writes it out, so
       peak memory is one parameter, not the model;
    4. reading: the pieces of a few parameters at a time (a bucket), read with
       DCP into buffers and merged by megatron's factory merge (PieceReader);
       a whole model of any layout loads with `dist_checkpointing.load`
       (load_mcore_checkpoint). Both read every pickled part as plain data
       (checkpoint.plain_load, checkpoint.no_code).

One name differs between megatron's layer specs: an MoE layer's pre-MLP norm
(local spec: mlp.linear_fc1.layer_norm_weight, Transformer Engine spec:
pre_mlp_layernorm.weight). Readers accept either (`alias_of`), so a checkpoint
converted on a CPU machine loads into a TE model and a GPU run's checkpoint
converts back here.

Because megatron reshards at load, such a checkpoint loads into every TP / PP /
EP layout (checkpoints megatron saves from a model of any layout hold the same
keys and global shapes: that is what makes them reshardable). The embedding and
output layer are stored with megatron's single-rank vocabulary padding; megatron
marks them allow_shape_mismatch, so a layout with a larger padding loads them
zero-padded.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")
"""Checkpoint keys of model weights; anything else in a training checkpoint (optimizer state, ...) is ignored."""


class ConversionError(RuntimeError):
    """A checkpoint, an output path or a layout that conversion cannot use; the message names the tensor or file."""


@contextmanager
def single_process_megatron(hf_config: dict) -> Iterator:
    """megatron's parallel state for one process (TP = PP = EP = 1, gloo): what the meta model needs."""
    import torch.distributed as dist

    from megatron_rl.config import ParallelConfig
    from megatron_rl.models import model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise ConversionError(
            f"conversion runs in one process, but this one is part of a world of {world} (torchrun?): run "
            "`python tools/convert_...py` instead; the dist checkpoint it writes loads into any TP/PP/EP layout"
        )
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        raise ConversionError(
            "megatron's parallel state is already initialised in this process: convert before init_parallel or after destroy_parallel"
        )
    ctx = init_parallel(ParallelConfig(backend="gloo"), shape=model_shape(hf_config))
    try:
        yield ctx
    finally:
        destroy_parallel(ctx)


def build_meta_model(hf_config: dict, ctx):
    """The single-rank GPTModel of `hf_config` on the meta device, built exactly as training builds it (local spec)."""
    from megatron_rl.config import ModelConfig
    from megatron_rl.models.build import build_model

    cpu_ctx = dataclasses.replace(ctx, device=torch.device("cpu"))  # build_model would move a CUDA ctx's model to the GPU
    with torch.device("meta"):
        (model,) = build_model(
            ModelConfig(dtype="float32", transformer_impl="local"),
            cpu_ctx,
            hf_config=hf_config,
            load_weights=False,
            config_overrides=dict(use_cpu_initialization=True, perform_initialization=False),
        )
    return model


@dataclass(frozen=True)
class Piece:
    """One stored chunk: part `part` of what megatron builds from parameter `param`, under `key` at `offset`."""

    key: str
    offset: tuple[int, ...]
    """Global offset, including megatron's prepended axes (layer, expert)."""
    size: tuple[int, ...]
    """Chunk shape, with a 1 for each prepended axis."""
    global_shape: tuple[int, ...]
    param: str
    """Parameter name in the single-rank model (= its global name)."""
    part: int
    local_shape: tuple[int, ...]
    """Chunk shape as the parameter's factory builds it (without the prepended axes)."""

    @property
    def numel(self) -> int:
        return math.prod(self.size)


@dataclass
class CheckpointLayout:
    """What the single-rank model's sharded_state_dict says about the checkpoint of one model."""

    entries: dict = field(default_factory=dict)
    """Parameter name -> its ShardedTensor or ShardedTensorFactory (meta data)."""
    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    """Checkpoint key -> its pieces, keys and pieces in model order."""
    objects: list = field(default_factory=list)
    """ShardedObjects (megatron's `_extra_state` entries)."""
    common: dict = field(default_factory=dict)
    """The non-sharded rest of the state dict (common.pt; empty for GPT models)."""
    allow_shape_mismatch: set[str] = field(default_factory=set)
    """Keys megatron loads with another global shape (vocabulary-padded embedding / output layer)."""

    def key_of(self, param: str) -> str:
        return self.entries[param].key


def _built_tensors(entry) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return list(nested_values(entry.build())) if isinstance(entry, ShardedTensorFactory) else [entry]


def checkpoint_layout(model) -> CheckpointLayout:
    """Pieces of every parameter of the single-rank `model`, from megatron's sharded_state_dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from megatron_rl.models.mapping import named_weights

    params = dict(named_weights(model))
    layout = CheckpointLayout()
    pieces: dict[str, list[Piece]] = defaultdict(list)
    for name, entry in model.sharded_state_dict().items():
        if isinstance(entry, ShardedObject):
            layout.objects.append(entry)
            continue
        if not isinstance(entry, (ShardedTensor, ShardedTensorFactory)):
            layout.common[name] = entry
            continue
        if name not in params:
            raise ConversionError(f"megatron's sharded state dict holds {name!r}, which is not a parameter: the converter only fills parameters")
        layout.entries[name] = entry
        for part, built in enumerate(_built_tensors(entry)):
            if built.flattened_range is not None:
                raise ConversionError(f"{built.key}: flattened ShardedTensors (distributed-optimizer layout) are not model weights")
            size = (1,) * built.prepend_axis_num + tuple(built.local_shape)
            pieces[built.key].append(
                Piece(built.key, tuple(built.global_offset), size, tuple(built.global_shape), name, part, tuple(built.local_shape))
            )
            if built.allow_shape_mismatch:
                layout.allow_shape_mismatch.add(built.key)
    layout.pieces = dict(pieces)
    return layout


class _LazyPieces(torch.Tensor):
    """The pieces of one checkpoint key as a DCP `_Checkpointable`: data is computed when DCP writes it.

    Like megatron's CheckpointableShardedTensor (strategies/checkpointable.py),
    but `__get_tensor_shard__` calls `materialise(piece)` instead of returning
    a tensor already in memory.
    """

    @staticmethod
    def __new__(cls, key: str, pieces: list[Piece], dtype: torch.dtype, materialise: Callable):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(pieces[0].global_shape), dtype=dtype)

    def __init__(self, key: str, pieces: list[Piece], dtype: torch.dtype, materialise: Callable) -> None:
        self._key, self._pieces, self._dtype, self._materialise = key, pieces, dtype, materialise
        self._by_offset = {torch.Size(p.offset): p for p in pieces}

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(p.offset), i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(p.offset), sizes=torch.Size(p.size)),
                    properties=TensorProperties(dtype=self._dtype),
                    size=torch.Size(p.global_shape),
                ),
            )
            for i, p in enumerate(self._pieces)
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(p.offset), sizes=torch.Size(p.size)) for p in self._pieces]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self._materialise(self._by_offset[torch.Size(index.offset)])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} is a checkpoint placeholder: {func} cannot run on it")

    def __repr__(self) -> str:
        return f"_LazyPieces({self._key}, {len(self._pieces)} pieces)"


def piece_data(layout: CheckpointLayout, piece: Piece, value: torch.Tensor) -> torch.Tensor:
    """The stored chunk of `piece`, given the full single-rank value of its parameter (megatron's factory applied)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    entry = layout.entries[piece.param]
    data = _built_tensors(dataclasses.replace(entry, data=value))[piece.part].data if isinstance(entry, ShardedTensorFactory) else value
    chunk = data.reshape(piece.size)
    if chunk.untyped_storage().nbytes() != chunk.nbytes:
        chunk = chunk.clone()  # torch.save would otherwise write the whole parameter's storage
    return chunk


FILE_BYTES = 512 << 20
"""Data files of a written checkpoint hold about this much each (a larger piece gets a file of its own)."""


def _ordered_file_writer(path: Path, file_bytes: int):
    """torch DCP's FileSystemWriter, with the items cut in plan order into files of about `file_bytes`.

    Why not one file per rank: torch 2.13's writer keeps every tensor it wrote to a
    file referenced until that file is closed (filesystem.py, `tensor_dict`, kept for
    its safetensors output option), so one file would keep the last piece of every
    key alive: all attention weights of an MoE model. Files of bounded size bound
    that. If a torch version lacks the private hooks used here, one file per piece
    (a public option) bounds it too, with more files.
    """
    import queue

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import filesystem as dcp_fs
    from torch.distributed.checkpoint.planner import WriteItemType

    if not (hasattr(FileSystemWriter, "_write_data") and hasattr(dcp_fs, "DEFAULT_SUFFIX")):
        return FileSystemWriter(str(path), single_file_per_rank=False, thread_count=1, sync_files=True)

    def item_bytes(item) -> int:
        if item.type == WriteItemType.BYTE_IO:
            return 0
        numel = math.prod(item.tensor_data.chunk.sizes)
        return numel * item.tensor_data.properties.dtype.itemsize

    class OrderedFileWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            groups: list[list] = []
            size = 0
            for item in plan.items:
                if not groups or (groups[-1] and size + item_bytes(item) > file_bytes):
                    groups.append([])
                    size = 0
                groups[-1].append(item)
                size += item_bytes(item)
            file_queue: queue.Queue = queue.Queue()
            for i, group in enumerate(groups):
                name = f"{plan.storage_data.prefix}{i}{dcp_fs.DEFAULT_SUFFIX}"
                file_queue.put((self.fs.concat_path(self.path, name), name, group))
            return self._write_data(planner, file_queue)

    # One thread: DCP's serial loader then resolves (materialises) one piece at a time, in plan order.
    return OrderedFileWriter(str(path), single_file_per_rank=True, thread_count=1, sync_files=True)


def write_dist_checkpoint(
    out_dir: Path,
    layout: CheckpointLayout,
    dtypes: dict[str, torch.dtype],
    materialise: Callable[[Piece], torch.Tensor],
    *,
    file_bytes: int = FILE_BYTES,
) -> None:
    """Write a megatron dist checkpoint of `layout` into the existing directory `out_dir`.

    materialise(piece) is called once per piece, in model order, one at a time.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.serialization import get_default_save_common_strategy, get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint import save as dcp_save

    state: dict = {key: _LazyPieces(key, pieces, dtypes[key], materialise) for key, pieces in layout.pieces.items()}
    objects = defaultdict(list)
    for obj in layout.objects:
        objects[obj.unique_key].append(obj.data)
    for unique_key, data in objects.items():  # as megatron serialises ShardedObjects (strategies/torch.py)
        buffer = io.BytesIO()
        torch.save(data, buffer)
        state[unique_key] = buffer
    writer = _ordered_file_writer(out_dir, file_bytes)
    dcp_save(state, storage_writer=writer, planner=MCoreSavePlanner(flatten_state_dict=False))
    get_default_save_common_strategy().save_common(layout.common, str(out_dir))
    strategy = get_default_save_sharded_strategy()
    save_config(CheckpointingConfig(strategy.backend, strategy.version), str(out_dir))


_KEY_ALIASES = (("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),)
"""(local spec, Transformer Engine spec) keys of one tensor: megatron's local spec stores an MoE
layer's pre-MLP norm under the fused TE dense name, its TE spec under its own."""


def alias_of(key: str) -> str | None:
    """The other spec's key of the same tensor, if megatron names it differently there."""
    for local, te in _KEY_ALIASES:
        if key.endswith(local):
            return key[: -len(local)] + te
        if key.endswith(te):
            return key[: -len(te)] + local
    return None


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of a dist checkpoint, from its metadata."""

    key: str
    """Its key in the checkpoint (may be the other spec's alias of the layout's key)."""
    shape: tuple[int, ...]
    """Global shape."""
    dtype: torch.dtype


def stored_tensors(ckpt_dir: Path) -> dict[str, StoredTensor]:
    """Checkpoint key -> StoredTensor, for every tensor in a dist checkpoint (metadata only)."""
    from megatron_rl.checkpoint.no_code import CheckpointFileError
    from megatron_rl.checkpoint.plain_load import PlainTorchDistLoadStrategy, check_dist_checkpoint

    try:  # .metadata unpickled with torch's metadata classes only (checkpoint.no_code)
        metadata = PlainTorchDistLoadStrategy().load_tensors_metadata(ckpt_dir, check_dist_checkpoint(ckpt_dir))
    except CheckpointFileError as err:
        raise ConversionError(f"{err}; use another checkpoint (a step_XXXXXXXX directory this project wrote)") from None
    except Exception as err:  # noqa: BLE001 - name the checkpoint whatever megatron raised
        raise ConversionError(f"cannot read the tensor metadata of {str(ckpt_dir)!r} ({' '.join(str(err).split())[:300]}): it "
                              "is not a complete megatron dist checkpoint (.metadata damaged or missing); save or convert "
                              "it again, or pass an older step_XXXXXXXX directory") from None
    return {key: StoredTensor(key, tuple(st.global_shape), st.dtype) for key, st in metadata.items()}


def match_stored_tensors(layout: CheckpointLayout, stored: dict[str, StoredTensor], where: str, vocab_size: int) -> dict[str, StoredTensor]:
    """Layout key -> the stored tensor it reads; an error names the tensors a checkpoint lacks, holds in
    excess (model keys only: optimizer state is ignored), or holds with another shape than the config implies."""
    matched = {}
    for key in layout.pieces:
        alias = alias_of(key)
        found = stored.get(key) or (stored.get(alias) if alias else None)
        if found is not None:
            matched[key] = found
    used = {t.key for t in matched.values()}
    missing = sorted(set(layout.pieces) - set(matched))
    extra = sorted(k for k in stored if k.startswith(MODEL_KEY_PREFIXES) and k not in used)
    if missing or extra:
        from megatron_rl.models.loading import names_mismatch

        raise ConversionError(
            f"megatron checkpoint {where!r} does not match its config.json: " + names_mismatch(missing, extra)
            + ". Was it saved from another model? Pass the matching HF config directory (--hf-dir)"
        )
    for key, pieces in layout.pieces.items():
        want, have = pieces[0].global_shape, matched[key].shape
        if key in layout.allow_shape_mismatch:
            # Vocabulary rows may be padded for another TP size; they must cover the vocabulary.
            if have[1:] == want[1:] and have[0] >= vocab_size:
                continue
        elif have == want:
            continue
        raise ConversionError(f"megatron checkpoint {where!r}: tensor {matched[key].key!r} has global shape {have}, the config implies {want}")
    return matched


class _PieceBuffers(torch.Tensor):
    """DCP load target for some pieces of one checkpoint key: each requested chunk is read into its own buffer."""

    @staticmethod
    def __new__(cls, stored_shape: tuple[int, ...], dtype: torch.dtype, chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(stored_shape), dtype=dtype)

    def __init__(self, stored_shape, dtype, chunks) -> None:
        self._chunks = [(torch.Size(offset), torch.Size(size)) for offset, size in chunks]
        self.buffers = {offset: torch.empty(size, dtype=dtype) for offset, size in self._chunks}

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=offset, sizes=size) for offset, size in self._chunks]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self.buffers[torch.Size(index.offset)]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__} is a checkpoint read target: {func} cannot run on it")


class PieceReader:
    """Reads the single-rank values of a few parameters at a time from a dist checkpoint of any layout.

    megatron's own `dist_checkpointing.load` cannot load part of an expert-stacked
    key in one process (its legacy ShardedTensor path wants every piece of the
    key on the rank), so pieces are read with torch DCP directly: each requested
    piece is a chunk DCP copies the overlapping stored chunks into (whatever
    layout saved them), then megatron's factory merge (SwiGLU: cat) rebuilds the
    parameter.
    """

    def __init__(self, ckpt_dir: Path, layout: CheckpointLayout, stored: dict[str, StoredTensor]) -> None:
        """stored: layout key -> stored tensor (match_stored_tensors)."""
        from megatron_rl.checkpoint.plain_load import PlainMetadataReader

        self.layout, self.stored, self.ckpt_dir = layout, stored, ckpt_dir
        self._reader = PlainMetadataReader(ckpt_dir)  # .metadata read once, with torch's metadata classes only
        self._by_param: dict[str, list[Piece]] = defaultdict(list)
        for pieces in layout.pieces.values():
            for piece in pieces:
                self._by_param[piece.param].append(piece)

    def _chunk(self, piece: Piece) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The stored region of `piece`: vocabulary rows beyond what is stored are left to zero padding."""
        rows = min(piece.offset[0] + piece.size[0], self.stored[piece.key].shape[0]) - piece.offset[0]
        return piece.offset, (rows,) + piece.size[1:]

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
        from torch.distributed.checkpoint import load as dcp_load

        from megatron_rl.checkpoint.no_code import CheckpointFileError
        from megatron_rl.checkpoint.plain_load import PlainBytesLoadPlanner

        wanted: dict[str, list[Piece]] = defaultdict(list)
        for name in names:
            for piece in self._by_param[name]:
                wanted[piece.key].append(piece)
        state = {}
        for key, pieces in wanted.items():
            stored = self.stored[key]
            state[stored.key] = _PieceBuffers(stored.shape, stored.dtype, [self._chunk(p) for p in pieces])
        try:
            dcp_load(state, storage_reader=self._reader, planner=PlainBytesLoadPlanner(self.ckpt_dir))
        except BaseException as err:  # torch DCP's CheckpointException derives from BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            cause = dcp_cause(err)
            if isinstance(cause, CheckpointFileError):  # a refused or unreadable item, named
                raise ConversionError(f"{cause}; use another checkpoint (a step_XXXXXXXX directory this project "
                                      "wrote)") from None
            detail = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
            raise ConversionError(
                f"cannot read tensors {sorted(wanted)[:3]} from the checkpoint {str(self.ckpt_dir)!r} ({detail}): "
                "a data file is truncated or damaged: save or convert it again, or use an older step_XXXXXXXX directory"
            ) from err
        values = {}
        for name in names:
            parts = []
            for piece in sorted(self._by_param[name], key=lambda p: p.part):
                data = state[self.stored[piece.key].key].buffers.pop(torch.Size(piece.offset))  # freed once merged
                if data.shape[0] < piece.size[0]:  # vocabulary padding the checkpoint does not store
                    data = torch.cat([data, data.new_zeros((piece.size[0] - data.shape[0],) + tuple(data.shape[1:]))])
                parts.append(data.reshape(piece.local_shape))
            entry = self.layout.entries[name]
            values[name] = entry.merge_fn(parts) if isinstance(entry, ShardedTensorFactory) else parts[0]
        return values


@torch.no_grad()
def load_mcore_checkpoint(model_chunks: list, ckpt_dir: str | os.PathLike) -> None:
    """Load a megatron dist checkpoint (converted, or saved by training) into model chunks of any layout.

    Call on every rank with the chunks build_model returned (load_weights=False).
    Tensors the model needs but the checkpoint lacks are an error naming them;
    `_extra_state` objects a Transformer Engine model has and a local-spec
    checkpoint lacks are left at their defaults.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from megatron_rl.checkpoint.no_code import CheckpointFileError
    from megatron_rl.checkpoint.plain_load import check_dist_checkpoint, load_dist_checkpoint
    from megatron_rl.models.mapping import unwrap_model

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "metadata.json").is_file():
        raise ConversionError(f"{str(ckpt_dir)!r} has no metadata.json: it is not a (complete) megatron dist checkpoint; pass "
                              "a step_XXXXXXXX directory of a run's checkpoint.dir or the output of tools/convert_hf_to_mcore.py")
    try:  # what it stores, from its .metadata unpickled with torch's metadata classes only (checkpoint.no_code)
        stored = set(check_dist_checkpoint(ckpt_dir).state_dict_metadata)
    except CheckpointFileError as err:
        raise ConversionError(f"{err}; use another checkpoint (a step_XXXXXXXX directory this project wrote)") from None
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        request = model.sharded_state_dict()
        missing = []
        for name, entry in list(request.items()):
            key = entry.unique_key if isinstance(entry, ShardedObject) else getattr(entry, "key", None)
            if key is None or key in stored:
                continue
            if isinstance(entry, ShardedObject) and name.endswith("_extra_state"):
                del request[name]  # TE's FP8 metadata: a local-spec checkpoint has none
            elif isinstance(entry, ShardedTensor) and alias_of(key) in stored:
                request[name] = dataclasses.replace(entry, key=alias_of(key))  # saved with the other layer spec
            else:
                missing.append(key)
        if missing:
            raise ConversionError(f"megatron checkpoint {str(ckpt_dir)!r} lacks {len(missing)} tensors this model needs (e.g. {sorted(missing)[:4]})")
        try:  # every bytes item and common.pt read as plain data (checkpoint.plain_load)
            loaded = load_dist_checkpoint(request, ckpt_dir)
        except BaseException as err:  # torch DCP's CheckpointException derives from BaseException
            cause = dcp_cause(err)
            if isinstance(cause, CheckpointFileError):
                raise ConversionError(f"{cause}; use another checkpoint (a step_XXXXXXXX directory this project "
                                      "wrote)") from None
            raise
        result = model.load_state_dict(loaded, strict=False)
        not_loaded = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if not_loaded:
            raise ConversionError(f"loading {str(ckpt_dir)!r} left parameters unset: {not_loaded[:4]}")


def dcp_cause(err: BaseException) -> BaseException:
    """The exception inside torch DCP's CheckpointException (it wraps each rank's failure)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            return dcp_cause(inner)
    return err
