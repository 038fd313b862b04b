"""Which checkpoint a resume picks, and the errors for missing, half-written or damaged ones."""

import json

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
