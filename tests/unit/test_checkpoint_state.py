"""Which checkpoint a resume picks, and the errors for missing, half-written or damaged ones."""

import json
from pathlib import Path

import pytest

from megatron_rl.checkpoint.state import CheckpointError, list_checkpoints, resolve_checkpoint


MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                     "common_backend_version": 1}
"""The metadata.json megatron-core 0.16.1's dist_checkpointing.save writes."""


def _complete(root, step):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


def test_auto_follows_latest_and_none_starts_fresh(tmp_path):
    assert resolve_checkpoint("auto", tmp_path) is None  # nothing saved yet
    _complete(tmp_path, 2)
    newest = _complete(tmp_path, 4)
    (tmp_path / ".step_00000006.partial").mkdir()  # a save that was interrupted
    (tmp_path / "latest").write_text("step_00000004\n")
    assert resolve_checkpoint("auto", tmp_path) == newest
    assert resolve_checkpoint("none", tmp_path) is None
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]


def test_damaged_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "step_00000009"), tmp_path)
    half = tmp_path / "step_00000003"
    half.mkdir()
    (half / "metadata.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"step_00000003.*incomplete \(no trainer_state.json\)"):
        resolve_checkpoint(str(half), tmp_path)
    (half / "trainer_state.json").write_text('{"step": ')
    with pytest.raises(CheckpointError, match=r"trainer_state.json is not valid JSON"):
        resolve_checkpoint(str(half), tmp_path)
    no_model = _complete(tmp_path, 5)
    (no_model / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="no megatron metadata.json"):
        resolve_checkpoint(str(no_model), tmp_path)
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match=r"latest names '../../etc', not a step_XXXXXXXX directory"):
        resolve_checkpoint("auto", tmp_path)


def test_a_model_directory_is_not_taken_for_a_half_written_checkpoint(tmp_path):
    """checkpoint.resume=<HF model dir> (or any directory that is no step_XXXXXXXX) says what to pass, not 'delete it'."""
    model = tmp_path / "tiny-moe"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError) as raised:
        resolve_checkpoint(str(model), tmp_path / "checkpoints")
    assert str(raised.value) == (
        f"{str(model)!r} is not a training checkpoint (no trainer_state.json, and it holds config.json and *.safetensors: "
        "a Hugging Face model): set checkpoint.resume to a run's checkpoint.dir (its newest checkpoint) or one of its "
        f"step_XXXXXXXX directories, or to auto or none; Hugging Face weights go in model.path (model.path={str(model)!r} "
        "checkpoint.resume=none)"
    )
    assert "delete" not in str(raised.value)
    other = tmp_path / "somewhere"
    other.mkdir()
    with pytest.raises(CheckpointError, match=r"'.*somewhere' is not a training checkpoint \(no trainer_state.json\): set "):
        resolve_checkpoint(str(other), tmp_path)
    weights_in_a_step_dir = tmp_path / "step_00000007"
    weights_in_a_step_dir.mkdir()
    (weights_in_a_step_dir / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"step_00000007' is not a training checkpoint \(no trainer_state.json, "
                                              r"and it holds config.json: a Hugging Face model\)"):
        resolve_checkpoint(str(weights_in_a_step_dir), tmp_path)
    interrupted = tmp_path / ".step_00000008.partial"
    interrupted.mkdir()
    with pytest.raises(CheckpointError, match=r"step_00000008.partial' is incomplete \(no trainer_state.json\)"):
        resolve_checkpoint(str(interrupted), tmp_path)


def test_a_runs_checkpoint_dir_resumes_what_its_latest_names(tmp_path):
    run = tmp_path / "run"
    _complete(run, 2)
    newest = _complete(run, 4)
    (run / "latest").write_text("step_00000004\n")
    assert resolve_checkpoint(str(run), tmp_path / "this-run") == newest


def test_a_full_disk_during_a_save_names_the_directory_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """megatron's real save, its file writer failing as a full disk fails it: torch's _write_item, as megatron's
    torch_dist writer calls it for each item of a data file, raises OSError(ENOSPC) after writing some bytes.
    However megatron and torch wrap that error, the save ends in StorageFullError naming checkpoint.dir, with the
    unfinished save removed and the last checkpoint kept; another OSError (EIO) is not reported as a full disk."""
    import errno
    import os
    import traceback

    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_rl.checkpoint.dist_format import single_process_megatron
    from megatron_rl.checkpoint.state import StorageFullError, save_checkpoint
    from megatron_rl.errors import EXIT_RUNTIME_FAILURE, exit_code_for
    from megatron_rl.models import load_hf_config
    from megatron_rl.models.tiny import make_tiny_model_dir

    hf_config = load_hf_config(make_tiny_model_dir(tmp_path / "model", "qwen3_moe", with_tokenizer=False))
    root = tmp_path / "ckpt"
    kept = root / "step_00000001"
    kept.mkdir(parents=True)
    (kept / "trainer_state.json").write_text('{"step": 1}')
    (root / "latest").write_text("step_00000001\n")

    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # save_checkpoint's in-process queue, for this test
    written, calls = filesystem_async._write_item, tmp_path / "write_calls"  # megatron writes in a forked process

    def failing_write(errno_code):
        def write_item(*args, **kwargs):  # (transforms, stream, data, write_item, storage_key, ...): megatron's call
            with open(calls, "a") as record:
                record.write(f"{errno_code}\n")
            stream = next(a for a in args if hasattr(a, "write"))
            stream.write(b"half an item")  # what got onto the disk before it filled
            raise OSError(errno_code, os.strerror(errno_code))

        return write_item

    def state():
        return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(12, dtype=torch.float32).reshape(3, 4))}

    with single_process_megatron(hf_config):
        monkeypatch.setattr(filesystem_async, "_write_item", failing_write(errno.ENOSPC))
        with pytest.raises(StorageFullError) as raised:
            save_checkpoint(root, 2, state(), {"weight_version": 2})
        assert calls.read_text().split() == [str(errno.ENOSPC)]  # the real save reached the file writer, once
        message = str(raised.value)
        assert f"checkpoint.dir={str(root)!r}" in message and "no space left" in message and "step 2" in message
        assert "still names step_00000001" in message
        assert exit_code_for(raised.value) == EXIT_RUNTIME_FAILURE
        assert not (root / ".step_00000002.partial").exists()  # the space it took is given back
        assert (root / "latest").read_text() == "step_00000001\n" and (kept / "trainer_state.json").is_file()
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]

        monkeypatch.setattr(filesystem_async, "_write_item", failing_write(errno.EIO))
        with pytest.raises(BaseException) as other:  # anything else is not reported as a full disk
            save_checkpoint(root, 2, state(), {"weight_version": 2})
        assert calls.read_text().split() == [str(errno.ENOSPC), str(errno.EIO)]
        assert not isinstance(other.value, StorageFullError), other.value
        assert "Input/output error" in "".join(traceback.format_exception(other.value)), other.value

        monkeypatch.setattr(filesystem_async, "_write_item", written)  # the same save, with a disk that has room
        path = save_checkpoint(root, 2, state(), {"weight_version": 2})
    assert path == root / "step_00000002" and (root / "latest").read_text() == "step_00000002\n"


class RunsCode:
    """A pickle whose loading writes `marker`: what a checkpoint from elsewhere could hold."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def test_a_pickle_that_would_run_code_is_refused_at_resume_and_nothing_runs(tmp_path):
    import pickle

    import torch

    from megatron_rl.checkpoint.state import load_checkpoint

    pickle.loads(pickle.dumps(RunsCode(tmp_path / "proof")))  # the payload is live: plain unpickling runs it
    assert (tmp_path / "proof").read_text() == "ran"

    marker = tmp_path / "ran"
    ckpt = _complete(tmp_path, 3)
    torch.save({"rng": {"torch": torch.get_rng_state()}, "extra": RunsCode(marker)}, ckpt / "rank_00000.pt")
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(ckpt, {})
    message = str(raised.value)
    assert str(ckpt / "rank_00000.pt") in message and "unpickling can run code" in message
    assert f"python tools/convert_rank_state.py {ckpt}" in message
    assert not marker.exists()

    # torch's distributed checkpoint metadata is a plain pickle: checked before megatron unpickles it
    (ckpt / "rank_00000.pt").unlink()
    (ckpt / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata asks to load builtins\.exec when unpickled"):
        load_checkpoint(ckpt, {})
    assert not marker.exists()


def test_older_rank_files_load_and_restore_the_random_streams_and_numpy_values_are_converted_once(tmp_path):
    """Rank files saved with numpy's state as an array load (megatron-core allow-lists numpy arrays) and restore
    the streams that followed the save (drawn here before and after); one holding other numpy values is refused,
    naming the conversion, and loads after it."""
    import random
    import subprocess
    import sys

    import megatron.core  # noqa: F401  (registers its allow-list, as in every process that resumes)
    import numpy as np
    import torch

    from megatron_rl.checkpoint.no_code import load_rank_file
    from megatron_rl.checkpoint.state import capture_rng_state, load_checkpoint, restore_rng_state

    ckpt = _complete(tmp_path, 4)
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "megatron_tracker": {}}
    after_save = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    torch.save({"rng": old}, ckpt / "rank_00000.pt")  # as the older save wrote it
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    restore_rng_state(load_rank_file(ckpt / "rank_00000.pt")["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == after_save

    torch.save({"rng": old, "consumed": np.int64(12)}, ckpt / "rank_00000.pt")  # a numpy scalar: not allow-listed
    with pytest.raises(CheckpointError, match=f"rank_00000.pt holds pickled Python objects.*convert_rank_state.py {ckpt}"):
        load_checkpoint(ckpt, {})
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(repo / "tools" / "convert_rank_state.py"), str(ckpt)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "1 rank file(s) converted" in done.stdout, done.stderr
    state = load_rank_file(ckpt / "rank_00000.pt")  # weights_only=True
    assert state["consumed"] == 12 and type(state["consumed"]) is int
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    restore_rng_state(state["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == after_save

    # what a save writes now holds tensors and plain values only, and round-trips too
    torch.save({"rng": capture_rng_state()}, ckpt / "rank_00000.pt")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(ckpt / "rank_00000.pt") == []
    following = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng_state(load_rank_file(ckpt / "rank_00000.pt")["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == following


def test_a_short_write_of_torch_save_is_a_full_disk_naming_the_directory(tmp_path, monkeypatch):
    """torch.save's zip writer reports a full disk without an errno ('unexpected pos N vs M'), wrapped by megatron or
    not: the save still ends in StorageFullError naming checkpoint.dir, with the unfinished save removed."""
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.state import StorageFullError, save_checkpoint

    def short_write(state, path, **_):
        (Path(path) / "common.pt").write_bytes(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    monkeypatch.setattr(dist_checkpointing, "save", short_write)
    with pytest.raises(StorageFullError) as raised:
        save_checkpoint(tmp_path, 3, {}, {"weight_version": 3})
    message = str(raised.value)
    assert f"checkpoint.dir={str(tmp_path)!r}" in message and "step 3" in message and "GiB free" in message
    assert "no earlier checkpoint" in message and not (tmp_path / ".step_00000003.partial").exists()


def test_torchs_checkpoint_exception_is_read_through_its_failed_ranks(tmp_path):
    """torch's CheckpointException.failures maps each failed rank to (exception, traceback): a full disk on rank 1 is
    a full disk, and a load failure names rank 0's exception, not the pair."""
    import errno
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from megatron_rl.checkpoint.state import _disk_full, _load_failure

    full = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "quota"), traceback.StackSummary())})
    assert _disk_full(full)
    other = CheckpointException("load failed", {0: (KeyError("decoder.layers.0.weight"), traceback.StackSummary())})
    assert not _disk_full(other)
    message = _load_failure(tmp_path, other)
    assert message.startswith("KeyError: 'decoder.layers.0.weight'; a checkpoint saved by another model"), message


def test_a_save_starts_no_process_for_its_write_results_and_loads_back(tmp_path, monkeypatch):
    """megatron's torch_dist writer would hand its results back through a multiprocessing Manager's queue made at the
    first save: a spawned server process importing the trainer's main module again (2-5 s on every rank). The
    trainer's save is synchronous: its results come through a queue of this process, and what it wrote loads back."""
    import multiprocessing

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_rl.checkpoint.dist_format import single_process_megatron
    from megatron_rl.checkpoint.state import save_checkpoint
    from megatron_rl.models import load_hf_config
    from megatron_rl.models.tiny import make_tiny_model_dir

    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # no save yet in this process
    hf_config = load_hf_config(make_tiny_model_dir(tmp_path / "model", "qwen3_moe", seed=0))
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    before = set(multiprocessing.active_children())
    with single_process_megatron(hf_config):
        path = save_checkpoint(tmp_path / "ckpt", 1, {"w": ShardedTensor.from_rank_offsets("w", value.clone())},
                               {"weight_version": 1})
        started = set(multiprocessing.active_children()) - before
        loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, str(path))
    assert not started, started
    assert torch.equal(loaded["w"], value)


def test_the_optimizer_state_loads_as_saved_and_a_dp_reshardable_one_keeps_its_model_parallel_layout(tmp_path):
    from megatron_rl.checkpoint.state import optimizer_format_to_load

    layout = {"tensor_parallel": 2, "pipeline_parallel": 1, "expert_parallel": 4, "expert_tensor_parallel": 1,
              "context_parallel": 1, "data_parallel": 8}
    saved = {"optimizer_format": "dp_reshardable", "layout": layout}
    path = tmp_path / "step_00000004"
    assert optimizer_format_to_load(path, saved, layout) == "dp_reshardable"
    assert optimizer_format_to_load(path, saved, {**layout, "data_parallel": 2}) == "dp_reshardable"  # DP reshards
    with pytest.raises(CheckpointError) as err:
        optimizer_format_to_load(path, saved, {**layout, "tensor_parallel": 4, "data_parallel": 4})
    text = str(err.value)
    assert str(path) in text and "tensor_parallel=2 -> 4" in text and "parallel.tensor_parallel=2" in text
    assert "checkpoint.optimizer_format=fully_reshardable" in text
    # fully_reshardable state loads into any layout; a checkpoint from before the option holds that format
    assert optimizer_format_to_load(path, {**saved, "optimizer_format": "fully_reshardable"}, {**layout, "tensor_parallel": 4}) == "fully_reshardable"
    assert optimizer_format_to_load(path, {"step": 4}, {**layout, "tensor_parallel": 4}) == "fully_reshardable"
    with pytest.raises(CheckpointError, match="optimizer_format='zero'"):
        optimizer_format_to_load(path, {"optimizer_format": "zero"}, layout)
