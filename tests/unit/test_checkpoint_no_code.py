"""Nothing of a checkpoint directory is unpickled beyond plain data, and a file that cannot be read is one line.

The checkpoint is a real one: the tiny Qwen3-MoE actor after one Adam step, saved by save_checkpoint in a process of
its own (its `.distcp` files hold each layer's `_extra_state` and the distributed optimizer's param groups as bytes
items, its common.pt the optimizer's sharding type). Each test tampers with a copy, as someone with write access to
a checkpoint directory would (a download, a shared file system), with payloads that write a marker file when
unpickled: the marker never appears, the error is one line naming the file, the item and the global, and no file of
the checkpoint changes. Every payload is tried with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 too (torch's switch that makes
its default torch.load unpickle in full).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_rl.checkpoint.state import CheckpointError

EXTRA_STATE = "decoder.layers.0.self_attention.linear_proj._extra_state/shard_0_1"
"""A bytes item megatron writes into a .distcp file for every run (a layer's `_extra_state`)."""
ENVIRONMENTS = [pytest.param({}, id="torch-default"),
                pytest.param({"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, id="force-no-weights-only")]


class RunsCode:
    """Unpickling it writes `marker` (and gives None)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


class RunsCodeAndReturns:
    """Unpickling it writes `marker` and gives `value`: the resume it sits in would go on as if nothing happened."""

    def __init__(self, marker: Path, value):
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        return eval, (f"(open({self.marker!r}, 'w').write('ran'), {self.value!r})[1]",)


def _save(rank: int, world_size: int, model_dir: str, out: str) -> None:
    from megatron_rl.checkpoint.state import save_checkpoint
    from megatron_rl.config import ParallelConfig
    from megatron_rl.models import load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel
    from tests.distributed.test_checkpoint_optimizer import _actor, _step

    ctx = init_parallel(ParallelConfig(timeout_s=120), shape=model_shape(load_hf_config(model_dir)))
    try:
        actor = _actor(ctx, model_dir)
        _step(actor, rank)
        trainer_state = {"weight_version": 1, "data": None, **actor.schedule_state(), "optimizer_format": "dp_reshardable"}
        save_checkpoint(Path(out), 1, actor.state_dict(optimizer_format="dp_reshardable"), trainer_state)
        actor.close()
    finally:
        destroy_parallel(ctx)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from megatron_rl.models.tiny import make_tiny_model_dir

    return str(make_tiny_model_dir(tmp_path_factory.mktemp("model") / "moe", "qwen3_moe", seed=11,
                                   with_tokenizer=False, vocab_size=200))


@pytest.fixture(scope="module")
def saved(model_dir, tmp_path_factory) -> Path:
    from tests.distributed.harness import run_distributed

    out = tmp_path_factory.mktemp("saved")
    run_distributed(_save, 1, model_dir, str(out), timeout=300)
    return out / "step_00000001"


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    copy = tmp_path / "run" / saved.name
    shutil.copytree(saved, copy)
    (copy.parent / "latest").write_text(f"{saved.name}\n")
    return copy


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _metadata(ckpt: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ckpt)).read_metadata()  # torch's own reader: the test's files are the test's own


def _storage(ckpt: Path, key: str):
    metadata = _metadata(ckpt)
    (index,) = [i for i in metadata.storage_data if i.fqn == key]
    return metadata, index, metadata.storage_data[index]


def _repoint(ckpt: Path, key: str, payload: bytes) -> Path:
    """Append `payload` to the data file of `key` and point .metadata at it (which stays torch's metadata classes)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata, index, info = _storage(ckpt, key)
    data_file = ckpt / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(payload)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(payload))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    return data_file


def _in_place(ckpt: Path, key: str, payload: bytes) -> Path:
    """Write `payload` over the bytes of `key` where they are (a plain pickle: it ends at its STOP, the rest of the
    item's bytes are ignored)."""
    _, _, info = _storage(ckpt, key)
    assert len(payload) <= info.length, (len(payload), info.length)
    data_file = ckpt / info.relative_path
    with open(data_file, "r+b") as f:
        f.seek(info.offset)
        f.write(payload)
    return data_file


def _torch_save(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _request(ckpt: Path) -> dict:
    """What a resume asks for: every tensor and object the checkpoint stores (megatron's own description of it, read
    by megatron and torch from the test's own .metadata)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return load_sharded_metadata(str(ckpt))


def _load(ckpt: Path, model_dir: str, monkeypatch, env: dict, request: dict | None = None):
    from megatron_rl.checkpoint.dist_format import single_process_megatron
    from megatron_rl.checkpoint.state import load_checkpoint
    from megatron_rl.models import load_hf_config

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with single_process_megatron(load_hf_config(model_dir)):
        return load_checkpoint(ckpt, request or _request(ckpt), restore_rng=False)


def _refused(ckpt: Path, model_dir: str, monkeypatch, env: dict, request: dict | None = None) -> str:
    """The one-line refusal of a resume from `ckpt` (request: what it asks for, read before the files were changed)."""
    before = _snapshot(ckpt)
    with pytest.raises(CheckpointError) as raised:
        _load(ckpt, model_dir, monkeypatch, env, request)
    message = str(raised.value)
    assert "\n" not in message, message
    assert _snapshot(ckpt) == before  # nothing saved is changed
    assert "checkpoint.resume=none" in message, message
    return message


@pytest.mark.parametrize("env", ENVIRONMENTS)
def test_a_checkpoint_this_project_wrote_loads_what_torchs_own_readers_read(ckpt, model_dir, monkeypatch, env):
    """Every tensor equals what torch DCP's own reader reads from the files, every bytes item what torch.load reads
    from its bytes, common.pt what torch.load reads from it."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    loaded, trainer_state, rank_state = _load(ckpt, model_dir, monkeypatch, env)
    metadata = _metadata(ckpt)
    tensors = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in metadata.state_dict_metadata.items()
               if isinstance(md, TensorStorageMetadata)}
    dcp_load(tensors, checkpoint_id=str(ckpt), no_dist=True)
    assert len(tensors) > 20 and any(key.startswith("optimizer.") for key in tensors)
    for key, value in tensors.items():
        assert torch.equal(loaded[key], value), key
    items = [key for key, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)]
    assert EXTRA_STATE in items and any(key.startswith("optimizer.") for key in items)
    for key in items:
        _, _, info = _storage(ckpt, key)
        raw = (ckpt / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
        assert loaded[key] == torch.load(io.BytesIO(raw), weights_only=True)[0], key
    common = torch.load(ckpt / "common.pt", weights_only=True)
    assert loaded["optimizer"]["param_state_sharding_type"] == common["optimizer"]["param_state_sharding_type"] == "dp_reshardable"
    assert trainer_state["step"] == 1 and "rng" in rank_state


@pytest.mark.parametrize("env", ENVIRONMENTS)
@pytest.mark.parametrize("how", ["in_place", "appended", "well_formed"])
def test_code_in_a_bytes_item_of_a_data_file_never_runs(ckpt, model_dir, monkeypatch, tmp_path, how, env):
    marker = tmp_path / "ran"
    if how == "in_place":  # a plain pickle over the item's own bytes
        data_file, asked = _in_place(ckpt, EXTRA_STATE, pickle.dumps(RunsCode(marker), protocol=2)), "builtins.exec"
    elif how == "appended":
        data_file, asked = _repoint(ckpt, EXTRA_STATE, _torch_save([RunsCode(marker)])), "builtins.exec"
    else:  # a well-formed torch.save that gives back the item's own value ([None]): a resume would go on
        original = torch.load(io.BytesIO(_torch_save([None])), weights_only=True)
        data_file, asked = _repoint(ckpt, EXTRA_STATE, _torch_save(RunsCodeAndReturns(marker, original))), "builtins.eval"
    pickle.loads(pickle.dumps(RunsCode(tmp_path / "live")))  # the payloads are live: plain unpickling runs them
    assert (tmp_path / "live").exists()

    message = _refused(ckpt, model_dir, monkeypatch, env)
    assert f"{data_file}, item {EXTRA_STATE!r}, asks to load {asked}" in message, message
    assert not marker.exists()


def _te_extra_state(value) -> torch.Tensor:
    """A layer's `_extra_state` as Transformer Engine writes it: the pickle of its FP8 metadata in a uint8 tensor,
    which TE's set_extra_state unpickles with pickle.loads."""
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)


@pytest.mark.parametrize("inside", ["te_tensor", "bytesio"])
def test_a_pickle_inside_an_extra_state_item_is_refused_and_what_te_writes_without_fp8_loads(
        ckpt, model_dir, monkeypatch, tmp_path, inside):
    """A plain-data item can still carry a pickle of its own that the model's layer unpickles when it loads: TE's
    uint8 tensor (pickle.loads) or a BytesIO (torch.load). Refused, naming the global; what a TE layer writes
    without FP8 metadata (the pickle of None, an empty tensor) loads as it is."""
    marker = tmp_path / "ran"
    buffer = io.BytesIO(_torch_save(RunsCode(marker)))
    payload = [_te_extra_state(RunsCode(marker))] if inside == "te_tensor" else [buffer]
    request = _request(ckpt)
    data_file = _repoint(ckpt, EXTRA_STATE, _torch_save(payload))
    message = _refused(ckpt, model_dir, monkeypatch, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, request)
    assert f"{data_file}, item {EXTRA_STATE!r}," in message and "builtins.exec" in message, message
    assert not marker.exists()

    for harmless in ([_te_extra_state(None)], [torch.empty(0, dtype=torch.uint8)]):
        _repoint(ckpt, EXTRA_STATE, _torch_save(harmless))
        loaded, _, _ = _load(ckpt, model_dir, monkeypatch, {}, request)
        assert torch.equal(loaded[EXTRA_STATE], harmless[0])


@pytest.mark.parametrize("env", ENVIRONMENTS)
@pytest.mark.parametrize("how", ["well_formed", "plain_pickle"])
def test_code_in_common_pt_never_runs(ckpt, model_dir, monkeypatch, tmp_path, how, env):
    marker = tmp_path / "ran"
    common = ckpt / "common.pt"
    state = torch.load(common, weights_only=True)
    if how == "well_formed":  # torch.save of what megatron wrote, one value more
        torch.save({**state, "extra": RunsCodeAndReturns(marker, 1)}, common)
        asked = "builtins.eval"
    else:
        common.write_bytes(pickle.dumps(RunsCode(marker), protocol=2))
        asked = "builtins.exec"
    message = _refused(ckpt, model_dir, monkeypatch, env)
    assert f"{common} asks to load {asked} when unpickled" in message, message
    assert "weights_only=False" not in message  # torch's advice to unpickle it in full is not repeated
    assert not marker.exists()


def test_metadata_that_points_outside_the_directory_is_refused(ckpt, model_dir, monkeypatch, tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(_torch_save([None]))
    metadata, index, _ = _storage(ckpt, EXTRA_STATE)
    metadata.storage_data[index] = _StorageInfo(f"../../{outside.name}", 0, outside.stat().st_size)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    message = _refused(ckpt, model_dir, monkeypatch, {})
    assert f"{ckpt / '.metadata'} names the data file '../../elsewhere.bin'" in message, message


@pytest.mark.parametrize("name", ["trainer_state.json", "latest"])
def test_a_state_file_that_is_not_utf8_is_one_line_naming_it(ckpt, name):
    from megatron_rl.checkpoint.state import read_trainer_state, resolve_checkpoint

    path = ckpt / name if name != "latest" else ckpt.parent / name
    path.write_bytes(b'{"step": 1, "note": "\xff\xfe"}\n' if name != "latest" else b"step_0000\xe9001\n")
    before = _snapshot(ckpt.parent)
    with pytest.raises(CheckpointError) as raised:
        resolve_checkpoint("auto", ckpt.parent)
    if name != "latest":
        with pytest.raises(CheckpointError):
            read_trainer_state(ckpt)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{path} is not UTF-8 text"), message
    assert "checkpoint.resume=none" in message
    assert _snapshot(ckpt.parent) == before


def test_state_files_of_another_shape_are_one_line_naming_them(ckpt, model_dir, monkeypatch):
    import json

    from megatron_rl.checkpoint.state import read_trainer_state, resolve_checkpoint

    request = _request(ckpt)
    state_file = ckpt / "trainer_state.json"
    saved = json.loads(state_file.read_text())
    for written, says in [([1, 2], "holds a JSON list"), ({**saved, "step": "1"}, "has step='1'"),
                          ({"step": 1}, "has no 'weight_version'"), ({**saved, "scheduler": 3}, "has scheduler=3")]:
        state_file.write_text(json.dumps(written))
        with pytest.raises(CheckpointError) as raised:
            resolve_checkpoint(str(ckpt), ckpt.parent)
            read_trainer_state(ckpt, resume=True)
        assert str(raised.value).startswith(f"{state_file} {says}") and "\n" not in str(raised.value), str(raised.value)
    state_file.write_text(json.dumps(saved))

    (ckpt / "metadata.json").write_bytes(b"\x00\x01")
    assert f"{ckpt / 'metadata.json'} is not JSON text" in _refused(ckpt, model_dir, monkeypatch, {}, request)
    (ckpt / "metadata.json").write_text('{"sharded_backend": "zarr", "common_backend": "torch"}')
    assert "sharded_backend='zarr'" in _refused(ckpt, model_dir, monkeypatch, {}, request)


@pytest.mark.parametrize("name", ["common.pt", "rank_00000.pt", ".metadata"])
def test_a_truncated_file_is_one_line_naming_it(ckpt, model_dir, monkeypatch, name):
    request, path = _request(ckpt), ckpt / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    message = _refused(ckpt, model_dir, monkeypatch, {}, request)
    assert str(path) in message, message


def test_load_mcore_checkpoint_reads_bytes_items_as_plain_data(ckpt, model_dir, monkeypatch, tmp_path):
    """The library load of a dist checkpoint into model chunks (converters, tools/README.md) refuses the payload too."""
    from megatron_rl.checkpoint.dist_format import ConversionError, load_mcore_checkpoint, single_process_megatron
    from megatron_rl.config import ModelConfig
    from megatron_rl.models import load_hf_config
    from megatron_rl.models.build import build_model

    marker = tmp_path / "ran"
    data_file = _repoint(ckpt, EXTRA_STATE, _torch_save(RunsCodeAndReturns(marker, [None])))
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with single_process_megatron(load_hf_config(model_dir)) as ctx:
        chunks = build_model(ModelConfig(path=model_dir, dtype="float32"), ctx, load_weights=False)
        with pytest.raises(ConversionError) as raised:
            load_mcore_checkpoint(chunks, ckpt)
    message = str(raised.value)
    assert f"{data_file}, item {EXTRA_STATE!r}, asks to load builtins.eval" in message and "\n" not in message, message
    assert not marker.exists() and os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
