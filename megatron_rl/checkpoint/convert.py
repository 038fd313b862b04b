"""Hugging Face safetensors <-> megatron dist checkpoint, streaming (the library behind tools/convert_*.py).

    convert_hf_to_mcore("Qwen3-30B-A3B", "ckpt/qwen3-30b-mcore")          # any HF family in models/
    convert_mcore_to_hf("ckpt/qwen3-30b-mcore", "out/qwen3-30b-hf", max_shard_size="5GB")
    load_mcore_checkpoint(build_model(cfg.model, ctx, load_weights=False), "ckpt/qwen3-30b-mcore")

The megatron side is megatron-core's dist checkpoint (torch_dist), the format
`dist_checkpointing.save(model.sharded_state_dict())` writes; see dist_format.py
for how it is derived from megatron itself and written piece by piece. The HF
<-> megatron names and layouts come from models/mapping.py, the same table
weight sync uses.

Target layout. A dist checkpoint stores global tensors; megatron reshards at
load, so one converted checkpoint loads into every TP / PP / EP / ETP layout
(tested: 1, TP2, EP2, PP2 give transformers' logits). Conversion therefore runs
in one process with no layout at all; `target_layouts` only checks that a
layout fits the model (experts divisible by EP, heads by TP, ...) before
anything is written.

Memory. One process, one parameter in flight: HF -> megatron reads the HF
tensors of one megatron parameter (copied off the memory map; maps of shards
it no longer reads are closed), writes its pieces and drops it; torch's writer
keeps the last piece of each key referenced until the current data file is
closed, hence files of max_file_size (512 MiB). megatron -> HF reads one
bucket of parameters (bucket_size) and streams each HF tensor into its planned
safetensors file. bench/convert_memory.py: on a 410 MiB model, +113 MiB
(HF -> megatron), +78 MiB (megatron -> HF, 64 MiB buckets), against +968 MiB
for building the model and calling dist_checkpointing.save.

Layout of a converted checkpoint:

    <out>/                 megatron dist checkpoint: .metadata, __0_*.distcp, common.pt, metadata.json
    <out>/hf/              config.json, generation_config.json, tokenizer files (every non-weight file of the source)
    <out>/megatron_rl_conversion.json   what was converted, from where, in which dtype

Every output is written to a temporary sibling (.<name>.partial-XXXX) and
renamed when complete: a failure (a full disk included) leaves nothing under
the final name.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch

from megatron_rl.checkpoint.dist_format import (
    ConversionError,
    Piece,
    PieceReader,
    build_meta_model,
    checkpoint_layout,
    dcp_cause,
    load_mcore_checkpoint,
    match_stored_tensors,
    piece_data,
    single_process_megatron,
    stored_tensors,
    write_dist_checkpoint,
)
from megatron_rl.checkpoint.safetensors_writer import CODE_DTYPES, ShardedSafetensorsWriter, TensorSpec, parse_size, plan_shards
from megatron_rl.checkpoint.state import _fsync_dir  # reused: one fsync-a-directory helper
from megatron_rl.config.core import ConfigError
from megatron_rl.config.layout import check_layout
from megatron_rl.config.schema import ParallelConfig
from megatron_rl.models.hf_config import UnsupportedModelError, load_hf_config, model_shape, parse_hf_config, refuse_quantized
from megatron_rl.models.loading import SafetensorsCheckpoint, check_checkpoint_names
from megatron_rl.models.families import get_family
from megatron_rl.models.mapping import Shard, mapping_for, named_weights

__all__ = [
    "ConversionError",
    "HF_SUBDIR",
    "MANIFEST",
    "atomic_output_dir",
    "check_target_layout",
    "convert_hf_to_mcore",
    "convert_mcore_to_hf",
    "copy_hf_side_files",
    "find_hf_side_dir",
    "load_mcore_checkpoint",
    "resolve_mcore_dir",
]

HF_SUBDIR = "hf"
MANIFEST = "megatron_rl_conversion.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz", ".distcp")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- output directories

HF_MISMATCH_FIX = ("the safetensors do not match config.json (a damaged or edited file, or weights of another model): "
                   "download or convert the model again, or pass the directory its config.json came from")


def _check_output(final: Path, overwrite: bool, *sources: Path) -> None:
    for source in sources:
        if final.resolve() == source.resolve() or source.resolve() in final.resolve().parents:
            raise ConversionError(f"output {str(final)!r} is (inside) the input {str(source)!r}: choose another output directory")
    if final.exists() and not final.is_dir():
        raise ConversionError(f"output {str(final)!r} exists and is not a directory")
    if final.exists() and not overwrite:
        raise ConversionError(f"output {str(final)!r} already exists: pass --overwrite (overwrite=True) to replace it")


@contextmanager
def atomic_output_dir(final: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `final` to fill; rename it to `final` only if the block completes.

    On any failure the temporary directory is removed and nothing appears (or
    changes) under `final`. An OSError (e.g. ENOSPC, a full disk) becomes a
    ConversionError naming the output.
    """
    final = Path(final)
    _check_output(final, overwrite)
    existed = final.exists()
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    except OSError as err:
        raise ConversionError(
            f"cannot write the output {str(final)!r}: {err.strerror or err} ({err.filename}): choose a directory you can write"
        ) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would make the output private
    try:
        yield tmp
        _fsync_dir(tmp)
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = dcp_cause(err)
        if isinstance(cause, OSError):
            what = "no space left on device" if cause.errno == errno.ENOSPC else (os.strerror(cause.errno) if cause.errno else str(cause))
            kept = "the existing output there is unchanged" if existed else "nothing was written under that name"
            raise ConversionError(f"writing {str(final)!r} failed: {what} ({cause}); {kept} (the partial output was removed)") from err
        if cause is not err and isinstance(cause, (ConversionError, ConfigError)):
            raise cause from err
        raise


def _is_weight_file(path: Path) -> bool:
    return path.name.endswith(_WEIGHT_SUFFIXES) or path.name.endswith(".index.json")


def copy_hf_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy every regular, non-weight, non-hidden file of `src` (config, generation config, tokenizer, ...) into `dst`."""
    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise ConversionError(f"{str(src)!r} has no config.json: it is not a Hugging Face model directory; pass the "
                              "directory holding the model's config.json and *.safetensors")
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for entry in sorted(src.iterdir()):
        if entry.is_file() and not entry.name.startswith(".") and not _is_weight_file(entry):
            shutil.copyfile(entry, dst / entry.name)  # follows symlinks (HF cache snapshots)
            copied.append(entry.name)
    return copied


# ----------------------------------------------------------------------------- checks


def check_target_layout(hf_config: dict, layout: ParallelConfig) -> None:
    """ConfigError when `layout` cannot hold the model (layers % PP, heads % TP, experts % EP, MLP widths % TP)."""
    arch = parse_hf_config(hf_config)
    tp, pp, ep, cp, etp = (
        layout.tensor_parallel,
        layout.pipeline_parallel,
        layout.expert_parallel,
        layout.context_parallel,
        layout.expert_tensor_parallel,
    )
    layout.validate()
    world = math.lcm(tp * pp * cp, etp * ep * pp)  # the smallest world this layout can run on
    check_layout(layout, world, model_shape(hf_config))
    has_dense = not arch.moe_layers or not all(arch.moe_layers)
    widths = [
        ("intermediate_size", arch.ffn_hidden_size if has_dense else 0, tp, "tensor_parallel"),
        (get_family(arch.family).expert_width_key, arch.moe_ffn_hidden_size, etp, "expert_tensor_parallel"),
        ("shared_expert_intermediate_size", arch.shared_expert_size, tp, "tensor_parallel"),
    ]
    for key, width, size, knob in widths:
        if width and width % size:
            raise ConfigError(f"{key}={width} is not divisible by parallel.{knob}={size}: the MLP cannot be split that way")


def _dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or name == "auto" or isinstance(name, torch.dtype):
        return None if name == "auto" else name
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported: choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


class _StreamingReader(SafetensorsCheckpoint):
    """SafetensorsCheckpoint that closes the memory maps the current parameter does not read.

    Touched pages of an open memory map count as this process's resident
    memory; closing the maps of shards already done keeps that near one shard.
    """

    def dtype(self, name: str) -> torch.dtype:
        code = self._handle(name).get_slice(name).get_dtype()
        if code not in CODE_DTYPES:
            raise ConversionError(f"tensor {name!r} in {str(self.dir)!r} has safetensors dtype {code}, which megatron_rl does not convert")
        return CODE_DTYPES[code]

    def release_except(self, names: Sequence[str] = ()) -> None:
        keep = {self.files[n] for n in names if n in self.files}
        for path in [p for p in self._open if p not in keep]:
            del self._open[path]


class _MetaReader:
    """The HFReader protocol over a checkpoint's headers only: meta tensors of the stored shapes and dtypes."""

    def __init__(self, reader: _StreamingReader) -> None:
        self.reader = reader

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(name)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        full = torch.empty(self.reader.shape(name), dtype=self.reader.dtype(name), device="meta")
        if dim is None:
            return full
        stop = full.shape[dim] if stop is None else stop
        return full.narrow(dim, start, stop - start)


def _planned_dtypes(arch, reader: _StreamingReader, layout, params: dict, padded: int, out_dtype) -> dict[str, torch.dtype]:
    """Check every parameter's HF tensors against its megatron shape (headers only); checkpoint key -> dtype."""
    meta = _MetaReader(reader)
    dtypes: dict[str, torch.dtype] = {}
    for name, entry in layout.entries.items():
        mapping = mapping_for(arch, name, padded)
        try:
            value = mapping.load(meta, Shard(None))
        except (RuntimeError, ValueError, UnsupportedModelError) as err:
            shapes = {n: reader.shape(n) for n in mapping.hf_names}
            raise ConversionError(f"HF tensors {shapes} in {str(reader.dir)!r} cannot form megatron's {name} "
                                  f"({' '.join(str(err).split())}): {HF_MISMATCH_FIX}") from None
        if tuple(value.shape) != params[name]:
            shapes = {n: reader.shape(n) for n in mapping.hf_names}
            raise ConversionError(
                f"HF tensors {shapes} in {str(reader.dir)!r} give megatron's {name} the shape {tuple(value.shape)}, "
                f"config.json implies {params[name]}: {HF_MISMATCH_FIX}"
            )
        dtypes.setdefault(entry.key, out_dtype or value.dtype)
    reader.release_except()
    return dtypes


class _Materialiser:
    """Piece -> its stored chunk, computed from the HF tensors when DCP writes it (one parameter kept at a time)."""

    def __init__(self, arch, reader: _StreamingReader, layout, padded: int, dtypes: dict, bar) -> None:
        self.arch, self.reader, self.layout, self.padded, self.dtypes, self.bar = arch, reader, layout, padded, dtypes, bar
        self._param: str | None = None
        self._value: torch.Tensor | None = None
        self.pieces_written = 0

    @torch.no_grad()
    def __call__(self, piece: Piece) -> torch.Tensor:
        if piece.param != self._param:
            self._param, self._value = None, None  # drop the previous parameter before reading the next
            mapping = mapping_for(self.arch, piece.param, self.padded)
            self.reader.release_except(mapping.hf_names)
            value = mapping.load(self.reader, Shard(None))
            # A tensor read from safetensors lives in the file's memory map and keeps the whole map
            # (every page touched) resident while referenced: copy it out so the map can close.
            self._value = value.to(self.dtypes[piece.key], copy=True, memory_format=torch.contiguous_format)
            self._param = piece.param
        chunk = piece_data(self.layout, piece, self._value)
        self.pieces_written += 1
        self.bar.update(chunk.nbytes)
        return chunk


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True, disable=not enabled)


def _nbytes(piece: Piece, dtype: torch.dtype) -> int:
    return piece.numel * torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------- HF -> megatron


def _check_hf_dir(hf_dir: Path) -> None:
    """UnsupportedModelError naming HF_DIR (the tool's argument, not train's model.path) when it is no Hugging Face
    model directory."""
    if not hf_dir.exists():
        raise UnsupportedModelError(
            f"HF_DIR {str(hf_dir)!r} does not exist: pass a Hugging Face model directory (config.json, *.safetensors), "
            "e.g. one downloaded with `huggingface-cli download <repo> --local-dir <dir>`"
        )
    if not hf_dir.is_dir():
        raise UnsupportedModelError(f"HF_DIR {str(hf_dir)!r} is a file: pass the directory holding config.json and *.safetensors")
    if not (hf_dir / "config.json").is_file():
        raise UnsupportedModelError(f"HF_DIR {str(hf_dir)!r} has no config.json: it is not a Hugging Face model directory")


def _check_hf_weights(hf_dir: Path) -> None:
    """UnsupportedModelError naming HF_DIR when it holds no safetensors (checked after config.json is understood)."""
    if not (hf_dir / "model.safetensors.index.json").is_file() and next(hf_dir.glob("*.safetensors"), None) is None:
        raise UnsupportedModelError(
            f"HF_DIR {str(hf_dir)!r} holds no *.safetensors weights: only safetensors are converted; write .bin "
            "checkpoints again with transformers' save_pretrained(safe_serialization=True)"
        )


def convert_hf_to_mcore(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype | None = None,
    target_layouts: Sequence[ParallelConfig] = (),
    max_file_size: str | int = "512MiB",
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Convert an HF model directory (one safetensors file, or shards with or without an index) to a megatron dist checkpoint.

    dtype: stored dtype (None / "auto" = each tensor's HF dtype, so the round trip is exact).
    target_layouts: layouts to check the model against before writing (the checkpoint loads into any layout).
    max_file_size: size of the checkpoint's data files; also bounds what torch's writer keeps referenced.
    Returns `out_dir`, which holds the checkpoint, `hf/` and the manifest.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    _check_hf_dir(hf_dir)
    hf_config = load_hf_config(hf_dir)
    refuse_quantized(hf_config, str(hf_dir / "config.json"))
    arch = parse_hf_config(hf_config, source=str(hf_dir / "config.json"))
    for layout in target_layouts:
        check_target_layout(hf_config, layout)
    out_dtype, file_bytes = _dtype(dtype), parse_size(max_file_size)
    _check_output(out_dir, overwrite, hf_dir)
    _check_hf_weights(hf_dir)
    reader = _StreamingReader(hf_dir)
    try:
        check_checkpoint_names(arch, reader.names(), str(hf_dir))
        with single_process_megatron(hf_config) as ctx:
            model = build_meta_model(hf_config, ctx)
            layout = checkpoint_layout(model)
            padded = model.hf_info.padded_vocab_size
            params = {name: tuple(p.shape) for name, p in named_weights(model)}
            dtypes = _planned_dtypes(arch, reader, layout, params, padded, out_dtype)
            total = sum(_nbytes(p, dtypes[key]) for key, pieces in layout.pieces.items() for p in pieces)
            with atomic_output_dir(out_dir, overwrite=overwrite) as tmp, _progress(total, "hf -> megatron", progress) as bar:
                materialise = _Materialiser(arch, reader, layout, padded, dtypes, bar)
                write_dist_checkpoint(tmp, layout, dtypes, materialise, file_bytes=file_bytes)
                expected = sum(len(p) for p in layout.pieces.values())
                if materialise.pieces_written != expected:
                    raise ConversionError(f"wrote {materialise.pieces_written} of {expected} checkpoint pieces (internal error)")
                copied = copy_hf_side_files(hf_dir, tmp / HF_SUBDIR)
                manifest = {
                    "format": "megatron-core dist checkpoint (torch_dist), model weights only",
                    "written_by": "megatron_rl.checkpoint.convert.convert_hf_to_mcore",
                    "family": arch.family,
                    "source": str(hf_dir.resolve()),
                    "hf_files": {"dir": HF_SUBDIR, "files": copied},
                    "dtypes": sorted({str(d).removeprefix("torch.") for d in dtypes.values()}),
                    "num_tensors": len(layout.pieces),
                    "num_pieces": expected,
                    "bytes": total,
                    "vocab_size": arch.vocab_size,
                    "stored_vocab_rows": padded,
                    "checked_layouts": [
                        {k: getattr(t, k) for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel", "expert_tensor_parallel")}
                        for t in target_layouts
                    ],
                }
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    finally:
        reader.close()
    return out_dir


# ----------------------------------------------------------------------------- megatron -> HF


def resolve_mcore_dir(ckpt_dir: str | os.PathLike) -> Path:
    """A dist checkpoint directory; a training checkpoint root (with `latest`) resolves to its newest step."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise ConversionError(f"megatron checkpoint {str(path)!r} does not exist: check the path (a step_XXXXXXXX "
                              "directory of a run's checkpoint.dir, or the checkpoint.dir itself)")
    if not (path / "metadata.json").is_file() and (path / "latest").is_file():
        from megatron_rl.checkpoint.state import resolve_checkpoint

        path = resolve_checkpoint("auto", path)
    if not (path / "metadata.json").is_file() or not (path / ".metadata").is_file():
        missing = "metadata.json" if not (path / "metadata.json").is_file() else ".metadata"
        raise ConversionError(f"{str(path)!r} has no {missing}: it is not a (complete) megatron dist checkpoint; pass a "
                              "step_XXXXXXXX directory of a run's checkpoint.dir (or the directory itself, to take its "
                              "newest), or the output of tools/convert_hf_to_mcore.py")
    from megatron_rl.checkpoint.no_code import CheckpointFileError
    from megatron_rl.checkpoint.plain_load import check_dist_checkpoint

    try:  # torch unpickles .metadata as it is: nothing but metadata classes may be in it
        check_dist_checkpoint(path)
    except CheckpointFileError as error:
        raise ConversionError(f"{error}; use another checkpoint (a step_XXXXXXXX directory this project wrote)") from None
    return path


def find_hf_side_dir(ckpt_dir: Path, hf_dir: str | os.PathLike | None = None) -> Path:
    """Where config.json (and the tokenizer) of a megatron checkpoint are: hf_dir, <ckpt>/hf, or the training run's model.path."""
    if hf_dir is not None:
        candidates = [Path(hf_dir)]
    else:
        candidates = [ckpt_dir / HF_SUBDIR]
        state_file = ckpt_dir / "trainer_state.json"
        if state_file.is_file():
            try:
                model_path = json.loads(state_file.read_bytes().decode("utf-8")).get("config", {}).get("model", {}).get("path")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):  # damaged: not a candidate
                model_path = None
            if isinstance(model_path, str) and model_path:
                candidates.append(Path(model_path))
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    tried = ", ".join(repr(str(c / "config.json")) for c in candidates)
    raise ConversionError(
        f"no config.json for megatron checkpoint {str(ckpt_dir)!r} (tried {tried}): pass --hf-dir <directory with the "
        "model's config.json and tokenizer files>"
    )


def _buckets(names: list[str], sizes: dict[str, int], bucket_bytes: int) -> list[list[str]]:
    buckets: list[list[str]] = []
    size = 0
    for name in names:
        if not buckets or (buckets[-1] and size + sizes[name] > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += sizes[name]
    return buckets


def _set_config_dtype(config_file: Path, dtype: torch.dtype) -> None:
    config = json.loads(config_file.read_text())
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    if all(config.get(k) == name for k in keys):
        return
    for key in keys:
        config[key] = name
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def convert_mcore_to_hf(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    hf_dir: str | os.PathLike | None = None,
    max_shard_size: str | int = "5GB",
    bucket_size: str | int = "1GiB",
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Convert a megatron dist checkpoint (converted, or a training step_XXXXXXXX directory) to an HF model directory.

    hf_dir: where config.json and the tokenizer are (default: <ckpt>/hf, then the training run's model.path).
    max_shard_size: largest safetensors file ("5GB", "500MB", bytes); model.safetensors.index.json when > 1 file.
    bucket_size: parameters read from the checkpoint at a time (the memory bound).
    dtype: output dtype (None / "auto" = as stored, so the round trip is exact).
    """
    ckpt_dir, out_dir = resolve_mcore_dir(ckpt_dir), Path(out_dir)
    side_dir = find_hf_side_dir(ckpt_dir, hf_dir)
    hf_config = load_hf_config(side_dir)
    arch = parse_hf_config(hf_config, source=str(side_dir / "config.json"))
    max_shard, bucket_bytes, out_dtype = parse_size(max_shard_size), parse_size(bucket_size), _dtype(dtype)
    _check_output(out_dir, overwrite, ckpt_dir)
    with single_process_megatron(hf_config) as ctx:
        model = build_meta_model(hf_config, ctx)
        layout = checkpoint_layout(model)
        padded = model.hf_info.padded_vocab_size
        stored = match_stored_tensors(layout, stored_tensors(ckpt_dir), str(ckpt_dir), arch.vocab_size)
        params = dict(named_weights(model))
        order = list(layout.entries)  # model order; the HF files follow it
        specs, sizes = [], {}
        for name in order:
            meta_value = torch.empty(tuple(params[name].shape), dtype=stored[layout.key_of(name)].dtype, device="meta")
            sizes[name] = meta_value.numel() * meta_value.element_size()
            for hf_name, tensor in mapping_for(arch, name, padded).export([meta_value]):
                specs.append(TensorSpec(hf_name, out_dtype or tensor.dtype, tuple(tensor.shape)))
        files = plan_shards(specs, max_shard)
        total = sum(s.nbytes for s in specs)
        with atomic_output_dir(out_dir, overwrite=overwrite) as tmp, _progress(total, "megatron -> hf", progress) as bar:
            reader = PieceReader(ckpt_dir, layout, stored)
            with ShardedSafetensorsWriter(tmp, files) as writer:
                for bucket in _buckets(order, sizes, bucket_bytes):
                    values = reader.read(bucket)
                    for name in bucket:
                        for hf_name, tensor in mapping_for(arch, name, padded).export([values.pop(name)]):
                            tensor = tensor if out_dtype is None else tensor.to(out_dtype)
                            writer.write(hf_name, tensor)
                            bar.update(tensor.numel() * tensor.element_size())
                writer.finish()
            copy_hf_side_files(side_dir, tmp)
            written = {s.dtype for s in specs}
            if len(written) == 1:
                _set_config_dtype(tmp / "config.json", written.pop())
    return out_dir
