"""Training checkpoints: a megatron dist checkpoint plus trainer state, written atomically.

Layout under `checkpoint.dir`:

    step_00000010/            one complete checkpoint
        metadata.json, ...    megatron dist checkpoint (model + optimizer, any layout)
        rank_00000.pt ...     per-rank state: RNG states (torch, python, numpy, megatron's tracker), tensors and
                              plain values only: loaded with weights_only=True (checkpoint.no_code)
        trainer_state.json    step, weight version, data position, scheduler, config
    latest                    text file naming the newest complete checkpoint

Nothing of it is unpickled freely (checkpoint.no_code, checkpoint.plain_load); a
file that is missing, unreadable, truncated, not UTF-8 or of another shape than a
save writes is a CheckpointError naming it and what to do (RESUME_ADVICE).

How a save stays safe:
1. every rank writes into `.step_00000010.partial/` (a crash leaves only this);
2. after a barrier, rank 0 writes trainer_state.json, renames the directory to
   `step_00000010` and then replaces `latest` (write to a temporary file, fsync,
   os.replace), so `latest` always names a complete checkpoint;
3. only then are checkpoints beyond `keep_last` deleted.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.checkpoint.no_code import (
    CheckpointFileError, load_rank_file, numpy_state_from_tensors, numpy_state_to_tensors,
)

STEP_DIR = re.compile(r"^step_(\d{8})$")
PARTIAL_DIR = re.compile(r"^\.step_(\d{8})\.partial$")
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"


RESUME_ADVICE = ("resume from another step (checkpoint.resume=<checkpoint.dir>/step_XXXXXXXX) or start afresh "
                 "(checkpoint.resume=none)")
"""What to do about a checkpoint that cannot be read: nothing saved is changed by the refusal."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, half-written or unreadable; the message names the file."""


def _read_text(path: Path) -> str:
    """A checkpoint's text file (`latest`, trainer_state.json) as UTF-8; CheckpointError naming it otherwise."""
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as err:
        raise CheckpointError(f"cannot read {path} ({err.strerror or err}): {RESUME_ADVICE}") from None
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}): it "
                              f"is damaged; {RESUME_ADVICE}") from None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _barrier(group=None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def capture_rng_state() -> dict[str, Any]:
    """Every random generator a training step draws from, on this rank."""
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": numpy_state_to_tensors(np.random.get_state()),
        "torch": torch.get_rng_state(),
        "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(numpy_state_from_tensors(state["numpy"]))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    sharded_state_dict: dict,
    trainer_state: dict[str, Any],
    *,
    rank_state: dict[str, Any] | None = None,
    keep_last: int = 2,
    validate: bool = True,
) -> Path:
    """Write step `step` on every rank (collective); returns the final directory. A full disk raises
    StorageFullError naming checkpoint.dir (the partial directory removed, `latest` untouched).

    validate: megatron's check that the ranks' shards cover every tensor exactly once, which gathers every rank's
    shard list on every rank (W x the list per rank): a run whose state's structure does not change checks its
    first save only.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: `except Exception` misses it

    try:
        return _save(Path(root), step, sharded_state_dict, trainer_state, rank_state=rank_state, keep_last=keep_last,
                     validate=validate)
    except (Exception, CheckpointException) as err:
        if not _disk_full(err):
            raise
        partial = Path(root) / f".{step_dir_name(step)}.partial"
        shutil.rmtree(partial, ignore_errors=True)  # give the space back; the complete checkpoints stay
        latest = Path(root) / LATEST
        kept = f"{latest} still names {latest.read_text().strip()}, complete" if latest.is_file() else "no earlier checkpoint"
        raise StorageFullError(
            f"no space left on the device of checkpoint.dir={str(root)!r} while saving step {step} "
            f"({_free(Path(root))} free after removing the unfinished save) "
            f"({kept}): free space there, or set checkpoint.dir to a larger disk (and checkpoint.keep_last lower), "
            "then resume with checkpoint.resume=auto"
        ) from err


def _free(path: Path) -> str:
    """Free space on the disk of `path`, as '1.2 GiB' ('unknown' when it cannot be read)."""
    try:
        return f"{shutil.disk_usage(path).free / 2**30:.1f} GiB"
    except OSError:
        return "unknown"


class StorageFullError(OSError):
    """The disk filled up while a checkpoint was written; the message names the directory and what is kept."""


def _failure_exception(failure) -> BaseException | None:
    """The exception of one entry of torch's CheckpointException.failures (an (exception, traceback) pair)."""
    return failure[0] if isinstance(failure, tuple) else failure


def _disk_full(err: BaseException | None) -> bool:
    """Whether `err` or an exception it chains is ENOSPC / EDQUOT (megatron wraps the OSError of its writers)."""
    import errno

    failures = getattr(err, "failures", None)  # torch's CheckpointException: each failed rank's (exception, traceback)
    if failures and any(_disk_full(_failure_exception(failure)) for failure in failures.values()):
        return True
    seen = 0
    while err is not None and seen < 20:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(err):
            return True
        if "unexpected pos" in str(err) or "failed writing file" in str(err):  # torch.save's writer wrote short: ENOSPC
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _save(root: Path, step: int, sharded_state_dict: dict, trainer_state: dict[str, Any], *, rank_state, keep_last: int,
          validate: bool) -> Path:
    from megatron.core import dist_checkpointing

    final = root / step_dir_name(step)
    partial = root / f".{final.name}.partial"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
        partial.mkdir()
    _barrier()
    _write_results_in_process()
    dist_checkpointing.save(sharded_state_dict, str(partial), validate_access_integrity=validate)
    rank_file = partial / f"rank_{_rank():05d}.pt"
    torch.save({"rng": capture_rng_state(), **(rank_state or {})}, rank_file)
    _barrier()
    if _rank() == 0:
        _atomic_write_text(partial / TRAINER_STATE, json.dumps({"step": step, **trainer_state}, indent=1, default=str))
        if final.exists():  # an identical step saved again (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(root)
        _atomic_write_text(root / LATEST, final.name + "\n")
        for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _write_results_in_process() -> None:
    """Give megatron's torch_dist writer a queue of this process for its results.

    The writer (dist_checkpointing.strategies.filesystem_async) hands the write results of a save back through a
    module-wide queue it makes at the first save, a multiprocessing Manager's, whose server is a spawned process:
    a new interpreter that imports the trainer's main module again (torch, megatron-core, vLLM), 2-5 s of CPU on
    every rank at its first save. The queue only crosses processes for megatron's asynchronous saves; this save is
    synchronous (`dist_checkpointing.save` runs the writer in this process and reads the queue back here), so a
    plain queue carries the same results. A megatron-core without that module-wide queue is left as it is."""
    import queue

    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", False) is None:  # not made yet (False: no such queue)
        filesystem_async._results_queue = queue.Queue()


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def resolve_checkpoint(spec: str, root: str | os.PathLike) -> Path | None:
    """checkpoint.resume -> the directory to load, checked complete (check_complete), or None to start fresh."""
    path = checkpoint_path(spec, root)
    if path is not None:
        check_complete(path)
    return path


def checkpoint_path(spec: str, root: str | os.PathLike) -> Path | None:
    """checkpoint.resume -> the directory it names, not yet checked complete, or None to start fresh.

    'none': None. 'auto': what `root/latest` names, or None when there is no
    `latest` yet. Anything else: a step_XXXXXXXX directory, or a run's
    checkpoint.dir (a directory with `latest`), meaning what its `latest` names.
    """
    if spec == "none":
        return None
    root = Path(root)
    if spec == "auto":
        latest = root / LATEST
        if not latest.exists():
            return None
        name = _read_text(latest).strip()
        path = root / name
        if not STEP_DIR.match(name):
            raise CheckpointError(f"{latest} names {name[:80]!r}, not a step_XXXXXXXX directory: write the name of a "
                                  f"complete one into it, or {RESUME_ADVICE}")
        if not path.is_dir():
            raise CheckpointError(f"{latest} names {name}, which does not exist in {root}: {RESUME_ADVICE}")
    else:
        path = Path(spec)
        if not STEP_DIR.match(path.name) and (path / LATEST).is_file():  # a run's checkpoint.dir: its newest
            return checkpoint_path("auto", path)
    return path


def check_complete(path: Path) -> None:
    """Raise naming the file when `path` is not a complete, readable checkpoint."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} does not exist: set checkpoint.resume to an existing step_XXXXXXXX directory or 'none'")
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        hf_files = [pattern for pattern in ("config.json", "*.safetensors") if next(path.glob(pattern), None)]
        if hf_files or not (STEP_DIR.match(path.name) or PARTIAL_DIR.match(path.name)):
            holds = f", and it holds {' and '.join(hf_files)}: a Hugging Face model" if hf_files else ""
            raise CheckpointError(
                f"{str(path)!r} is not a training checkpoint (no {TRAINER_STATE}{holds}): set checkpoint.resume to a "
                f"run's checkpoint.dir (its newest checkpoint) or one of its step_XXXXXXXX directories, or to auto or "
                f"none; Hugging Face weights go in model.path (model.path={str(path)!r} checkpoint.resume=none)"
            )
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete (no {TRAINER_STATE}): it was interrupted while saving; "
            f"resume from an older one (checkpoint.resume=<dir>) or delete it"
        )
    _parse_trainer_state(state_file)
    if not (path / "metadata.json").is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} has no megatron metadata.json: the model state is missing; {RESUME_ADVICE}")


def _parse_trainer_state(state_file: Path) -> dict[str, Any]:
    """trainer_state.json as a save writes it: a JSON object whose step is a count; CheckpointError otherwise."""
    try:
        state = json.loads(_read_text(state_file))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{state_file} is not valid JSON ({err.msg}): the checkpoint is damaged; {RESUME_ADVICE}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_file} holds a JSON {type(state).__name__}, not the object a save writes: it is "
                              f"damaged; {RESUME_ADVICE}")
    step = state.get("step")
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{state_file} has step={step!r}, not a step count: it is damaged; {RESUME_ADVICE}")
    return state


OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable")
MODEL_PARALLEL = ("tensor_parallel", "pipeline_parallel", "expert_parallel", "expert_tensor_parallel", "context_parallel")
"""The sizes a dp_reshardable optimizer state was cut by: a resume must keep them (data_parallel may change)."""


RESUME_FIELDS = {"weight_version": (int,), "optimizer_steps": (int,), "scheduler": (dict,), "data": (dict, type(None))}
"""What a training resume reads of trainer_state.json besides the step, and the JSON types a save writes."""


def read_trainer_state(path: Path, *, resume: bool = False) -> dict[str, Any]:
    """The trainer state a complete checkpoint was saved with (check_complete first). resume: it must also hold
    RESUME_FIELDS (a trainer's save), each of the type a save writes; CheckpointError naming the field otherwise."""
    check_complete(path)
    state = _parse_trainer_state(path / TRAINER_STATE)
    return check_resume_fields(path, state) if resume else state


def check_resume_fields(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """`state`, the trainer state of checkpoint `path`, when it holds RESUME_FIELDS (a trainer's save), each of the
    type a save writes; CheckpointError naming the field otherwise."""
    for key, types in RESUME_FIELDS.items():
        if key not in state or type(state[key]) not in types:
            what = f"has {key}={state[key]!r}" if key in state else f"has no {key!r}"
            raise CheckpointError(f"{path / TRAINER_STATE} {what}: not the trainer state a training run saves (it is "
                                  f"damaged, or was written by a converter); {RESUME_ADVICE}")
    return state


def optimizer_format_to_load(path: Path, saved: dict[str, Any], layout: dict[str, int]) -> str:
    """The optimizer sharding type to load checkpoint `path` with, after checking this run's layout can read it.

    `saved` is its trainer state: `optimizer_format` and `layout` as `save` wrote them; a checkpoint without them
    (written before checkpoint.optimizer_format existed) holds fully_reshardable state, which any layout reads.
    """
    fmt = saved.get("optimizer_format", "fully_reshardable")
    if fmt not in OPTIMIZER_FORMATS:
        raise CheckpointError(f"checkpoint {str(path)!r} names optimizer_format={fmt!r}, not one of {OPTIMIZER_FORMATS}: "
                              "it is damaged or from a newer version; resume from another one")
    was = saved.get("layout")
    if fmt == "dp_reshardable" and was is not None:
        changed = [f"{k}={was.get(k)} -> {layout.get(k)}" for k in MODEL_PARALLEL if was.get(k) != layout.get(k)]
        if changed:
            saved_layout = " ".join(f"parallel.{k}={was.get(k)}" for k in MODEL_PARALLEL)
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds the optimizer state cut for its own model-parallel layout "
                f"(checkpoint.optimizer_format=dp_reshardable), and this run changes it ({', '.join(changed)}): resume "
                f"on the saved layout ({saved_layout}; any data-parallel size); to change it, resume there once with "
                "checkpoint.optimizer_format=fully_reshardable and save, then resume that checkpoint on the new layout"
            )
    return fmt


def _truncated_shards(path: Path) -> list[str]:
    """The .distcp files of a dist checkpoint shorter than its metadata says, as 'file: N of M bytes'."""
    from megatron_rl.checkpoint.no_code import read_dcp_metadata

    try:
        storage = read_dcp_metadata(path).storage_data or {}
    except CheckpointFileError:  # no metadata to compare with: say nothing more
        return []
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    short = []
    for name, size in sorted(needed.items()):
        have = (path / name).stat().st_size if (path / name).is_file() else -1
        if have < size:
            short.append(f"{path / name}: {'missing' if have < 0 else f'{have} of {size} bytes'}")
    return short


def _file_error(err: BaseException | None, depth: int = 0) -> CheckpointFileError | None:
    """The CheckpointFileError (a refused or unreadable file, named) inside what megatron or torch DCP raised."""
    if err is None or depth > 8:
        return None
    if isinstance(err, CheckpointFileError):
        return err
    for failure in (getattr(err, "failures", None) or {}).values():  # CheckpointException: each failed rank's
        found = _file_error(_failure_exception(failure), depth + 1)
        if found is not None:
            return found
    return _file_error(err.__cause__ or err.__context__, depth + 1)


def _load_failure(path: Path, err: BaseException) -> str:
    """One line on why a dist checkpoint did not load: its truncated files, a file refused or unreadable (named),
    else the first rank's error, shortened."""
    short = _truncated_shards(path)
    if short:
        return (f"{'; '.join(short)} (truncated or damaged: the disk filled up or a copy was cut short): resume from an "
                "older checkpoint (checkpoint.resume=<its step_XXXXXXXX directory>), copy this one again, or start afresh "
                "(checkpoint.resume=none)")
    refused = _file_error(err)
    if refused is not None:
        return f"{refused}; {RESUME_ADVICE}"
    failures = getattr(err, "failures", None)  # CheckpointException: each failed rank's (exception, traceback)
    cause = _failure_exception(next(iter(failures.values()))) if failures else err
    text = " ".join(f"{type(cause).__name__}: {cause}".split())
    if len(text) > 300:
        text = text[:300] + " ..."
    return (f"{text}; a checkpoint saved by another model, or damaged: resume from another one, or start afresh "
            "(checkpoint.resume=none)")


def load_checkpoint(
    path: Path,
    sharded_state_dict: dict,
    *,
    restore_rng: bool = True,
    trainer_state: dict[str, Any] | None = None,
) -> tuple[dict, dict[str, Any], dict[str, Any]]:
    """Load on every rank: (megatron state dict, trainer_state, this rank's extra state).

    The model part may be loaded into another parallel layout than it was saved
    from (dist checkpointing reshards); the optimizer part as its format allows
    (optimizer_format_to_load). RNG states are restored only when this rank's
    file exists (same world size). trainer_state: what read_trainer_state(path)
    gave the caller already (not read again).
    """
    from megatron_rl.checkpoint.plain_load import check_dist_checkpoint, load_dist_checkpoint

    if trainer_state is None:
        trainer_state = read_trainer_state(path)
    rank_file = path / f"rank_{_rank():05d}.pt"
    try:  # nothing that could run code is unpickled (checkpoint.no_code)
        rank_state: dict[str, Any] = load_rank_file(rank_file) if rank_file.is_file() else {}
        check_dist_checkpoint(path)
    except CheckpointFileError as err:
        raise CheckpointError(f"{err}; {RESUME_ADVICE}") from None
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: `except Exception` misses it

    try:
        state = load_dist_checkpoint(sharded_state_dict, path)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - name the checkpoint whatever megatron raised
        raise CheckpointError(f"cannot load the model/optimizer state from {str(path)!r}: {_load_failure(path, err)}") from None
    if rank_state and restore_rng:
        try:
            restore_rng_state(rank_state.pop("rng"))
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"{rank_file} does not hold the random states a save writes ({type(err).__name__}: "
                                  f"{' '.join(str(err).split())[:200]}): it is damaged; {RESUME_ADVICE}") from None
    return state, trainer_state, rank_state


