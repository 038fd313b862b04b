"""Which checkpoint a resume picks, and the errors for missing, half-written or damaged ones."""

import json
from pathlib import Path

import pytest

from megatron_rl.checkpoint.state import CheckpointError, list_checkpoints, resolve_checkpoint


def _complete(root, step):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "metadata.json").write_text("{}")
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


def test_a_full_disk_during_a_save_names_the_directory_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    import errno

    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.state import StorageFullError, save_checkpoint
    from megatron_rl.errors import EXIT_RUNTIME_FAILURE, exit_code_for

    kept = tmp_path / "step_00000001"
    kept.mkdir()
    (kept / "trainer_state.json").write_text('{"step": 1}')
    (tmp_path / "latest").write_text("step_00000001\n")

    def full_disk(state, path):  # megatron wraps its writers' OSError in an error of its own
        (Path(path) / "__0_0.distcp").write_bytes(b"half")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as err:
            raise RuntimeError("Worker failure") from err

    monkeypatch.setattr(dist_checkpointing, "save", full_disk)
    with pytest.raises(StorageFullError) as raised:
        save_checkpoint(tmp_path, 2, {}, {"weight_version": 2})
    message = str(raised.value)
    assert f"checkpoint.dir={str(tmp_path)!r}" in message and "no space left" in message and "step 2" in message
    assert "still names step_00000001" in message
    assert exit_code_for(raised.value) == EXIT_RUNTIME_FAILURE
    assert not (tmp_path / ".step_00000002.partial").exists()  # the space it took is given back
    assert (tmp_path / "latest").read_text() == "step_00000001\n" and (kept / "trainer_state.json").is_file()
    monkeypatch.setattr(dist_checkpointing, "save", lambda state, path: (_ for _ in ()).throw(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):  # anything else is not reported as a full disk
        save_checkpoint(tmp_path, 2, {}, {"weight_version": 2})


def test_a_short_write_of_torch_save_is_a_full_disk_naming_the_directory(tmp_path, monkeypatch):
    """torch.save's zip writer reports a full disk without an errno ('unexpected pos N vs M'), wrapped by megatron or
    not: the save still ends in StorageFullError naming checkpoint.dir, with the unfinished save removed."""
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.state import StorageFullError, save_checkpoint

    def short_write(state, path):
        (Path(path) / "common.pt").write_bytes(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    monkeypatch.setattr(dist_checkpointing, "save", short_write)
    with pytest.raises(StorageFullError) as raised:
        save_checkpoint(tmp_path, 3, {}, {"weight_version": 3})
    message = str(raised.value)
    assert f"checkpoint.dir={str(tmp_path)!r}" in message and "step 3" in message and "GiB free" in message
    assert "no earlier checkpoint" in message and not (tmp_path / ".step_00000003.partial").exists()
