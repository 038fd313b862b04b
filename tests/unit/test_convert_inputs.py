"""Conversion: inputs refused before any work (naming the file, tensor or layout), atomic output directories, the CLIs.

None of these builds a model or imports megatron-core: a bad input fails in
about a second. End-to-end conversions are in tests/distributed/test_convert.py.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.checkpoint.convert import (
    ConversionError,
    atomic_output_dir,
    check_target_layout,
    convert_hf_to_mcore,
    convert_mcore_to_hf,
    copy_hf_side_files,
    find_hf_side_dir,
)
from megatron_rl.config.core import ConfigError
from megatron_rl.config.schema import ParallelConfig
from megatron_rl.models.hf_config import UnsupportedModelError, parse_hf_config
from megatron_rl.models.mapping import expected_hf_names
from megatron_rl.models.tiny import tiny_hf_config

ROOT = Path(__file__).resolve().parents[2]


def fake_hf_dir(path: Path, family: str = "qwen2", drop: str | None = None, add: str | None = None, **overrides) -> Path:
    """config.json + safetensors with the right tensor *names* (1-element tensors: names are checked first)."""
    path.mkdir(parents=True)
    config = tiny_hf_config(family, **overrides)
    (path / "config.json").write_text(json.dumps(config))
    names = [n for n in expected_hf_names(parse_hf_config(config)) if n != drop] + ([add] if add else [])
    half = len(names) // 2
    save_file({n: torch.zeros(1) for n in names[:half]}, path / "model-00001-of-00002.safetensors")
    save_file({n: torch.zeros(1) for n in names[half:]}, path / "model-00002-of-00002.safetensors")
    return path


# ----------------------------------------------------------------------------- HF -> megatron input


def test_missing_config_names_the_file(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(UnsupportedModelError, match="has no config.json"):
        convert_hf_to_mcore(tmp_path / "model", tmp_path / "out")
    with pytest.raises(UnsupportedModelError, match="does not exist"):
        convert_hf_to_mcore(tmp_path / "nowhere", tmp_path / "out")


def test_hf_dir_errors_name_the_tools_argument_not_train_keys(tmp_path):
    """The conversion's input is HF_DIR: no model.path, model.make_tiny or model.load_weights in what it says."""
    nowhere = tmp_path / "nowhere"
    with pytest.raises(UnsupportedModelError) as raised:
        convert_hf_to_mcore(nowhere, tmp_path / "out")
    assert str(raised.value) == (
        f"HF_DIR {str(nowhere)!r} does not exist: pass a Hugging Face model directory (config.json, *.safetensors), "
        "e.g. one downloaded with `huggingface-cli download <repo> --local-dir <dir>`"
    )
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps(tiny_hf_config("qwen2")))
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UnsupportedModelError) as raised:
        convert_hf_to_mcore(no_weights, tmp_path / "out")
    assert str(raised.value) == (
        f"HF_DIR {str(no_weights)!r} holds no *.safetensors weights: only safetensors are converted; write .bin "
        "checkpoints again with transformers' save_pretrained(safe_serialization=True)"
    )
    with pytest.raises(UnsupportedModelError, match=r"HF_DIR '.*config.json' is a file: pass the directory holding config.json"):
        convert_hf_to_mcore(no_weights / "config.json", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedModelError, match=r"HF_DIR '.*empty' has no config.json: it is not a Hugging Face model directory"):
        convert_hf_to_mcore(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_named(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match=r"model_type='gpt2'.*supported families: llama"):
        convert_hf_to_mcore(model, tmp_path / "out")


def test_missing_and_extra_tensors_are_named(tmp_path):
    missing = fake_hf_dir(tmp_path / "missing", drop="model.layers.1.mlp.down_proj.weight")
    with pytest.raises(UnsupportedModelError, match=r"1 missing .*model\.layers\.1\.mlp\.down_proj\.weight"):
        convert_hf_to_mcore(missing, tmp_path / "out")
    extra = fake_hf_dir(tmp_path / "extra", add="model.layers.7.mlp.up_proj.weight")
    with pytest.raises(UnsupportedModelError, match=r"1 unexpected .*model\.layers\.7\.mlp\.up_proj\.weight"):
        convert_hf_to_mcore(extra, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_target_layout_must_fit_the_model(tmp_path):
    moe = tiny_hf_config("qwen3_moe")  # 8 experts, 4 heads, 2 key/value heads, expert width 64
    check_target_layout(moe, ParallelConfig(tensor_parallel=2, expert_parallel=4))
    with pytest.raises(ConfigError, match=r"num_experts=8 is not divisible by parallel.expert_parallel=3"):
        check_target_layout(moe, ParallelConfig(expert_parallel=3))
    with pytest.raises(ConfigError, match=r"heads .* not divisible by parallel.tensor_parallel=4"):
        check_target_layout(moe, ParallelConfig(tensor_parallel=4))
    with pytest.raises(ConfigError, match=r"num_layers=2 is not divisible by parallel.pipeline_parallel=3"):
        check_target_layout(moe, ParallelConfig(pipeline_parallel=3))
    with pytest.raises(ConfigError, match=r"moe_intermediate_size=60 is not divisible by parallel.expert_tensor_parallel=8"):
        check_target_layout(tiny_hf_config("qwen3_moe", moe_intermediate_size=60, num_attention_heads=8, num_key_value_heads=8), ParallelConfig(tensor_parallel=8))
    with pytest.raises(ConfigError, match=r"intermediate_size=100 is not divisible by parallel.tensor_parallel=8"):
        check_target_layout(tiny_hf_config("llama", intermediate_size=100, num_attention_heads=8, num_key_value_heads=8), ParallelConfig(tensor_parallel=8))
    # Checked before anything is written.
    hf = fake_hf_dir(tmp_path / "moe", family="qwen3_moe")
    with pytest.raises(ConfigError, match="expert_parallel=3"):
        convert_hf_to_mcore(hf, tmp_path / "out", target_layouts=[ParallelConfig(expert_parallel=3)])
    assert not (tmp_path / "out").exists()


def test_output_must_not_clobber(tmp_path):
    hf = fake_hf_dir(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    with pytest.raises(ConversionError, match="already exists: pass --overwrite"):
        convert_hf_to_mcore(hf, tmp_path / "out")
    with pytest.raises(ConversionError, match="inside\\) the input"):
        convert_hf_to_mcore(hf, hf / "mcore")
    with pytest.raises(ConfigError, match="dtype 'int8' is not supported"):
        convert_hf_to_mcore(hf, tmp_path / "out2", dtype="int8")


# ----------------------------------------------------------------------------- megatron -> HF input


def test_mcore_input_must_be_a_dist_checkpoint(tmp_path):
    with pytest.raises(ConversionError, match="does not exist"):
        convert_mcore_to_hf(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConversionError, match="has no metadata.json: it is not a .*megatron dist checkpoint"):
        convert_mcore_to_hf(tmp_path / "plain", tmp_path / "out")


def test_mcore_input_needs_a_config(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    (ckpt / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))  # torch's own (empty) metadata
    with pytest.raises(ConversionError, match=r"no config.json .*ckpt/hf/config.json.*pass --hf-dir"):
        convert_mcore_to_hf(ckpt, tmp_path / "out")
    with pytest.raises(ConversionError, match=r"elsewhere/config.json"):
        convert_mcore_to_hf(ckpt, tmp_path / "out", hf_dir=tmp_path / "elsewhere")
    # A training checkpoint finds the run's model through trainer_state.json.
    model = fake_hf_dir(tmp_path / "model")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 3, "config": {"model": {"path": str(model)}}}))
    assert find_hf_side_dir(ckpt) == model


# ----------------------------------------------------------------------------- output directories


def test_atomic_output_dir_renames_only_when_complete(tmp_path):
    final = tmp_path / "out"
    with atomic_output_dir(final) as tmp:
        (tmp / "a.txt").write_text("new")
        assert not final.exists() and tmp.parent == tmp_path and tmp.name.startswith(".out.partial-")
    assert (final / "a.txt").read_text() == "new"

    with pytest.raises(ConversionError, match=r"no space left on device .*the existing output there is unchanged"):
        with atomic_output_dir(final, overwrite=True) as tmp:
            (tmp / "a.txt").write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert (final / "a.txt").read_text() == "new"  # the old output is untouched

    with pytest.raises(KeyError):  # other errors pass through unchanged, after the cleanup
        with atomic_output_dir(tmp_path / "other"):
            raise KeyError("bug")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    with atomic_output_dir(final, overwrite=True) as tmp:
        (tmp / "b.txt").write_text("newer")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_side_files_copied_without_weights(tmp_path):
    src = fake_hf_dir(tmp_path / "src")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "tokenizer.model", ".gitattributes", "pytorch_model.bin"):
        (src / name).write_text("x")
    (src / "model.safetensors.index.json").write_text("{}")
    (src / "original").mkdir()
    copied = copy_hf_side_files(src, tmp_path / "dst")
    assert copied == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == copied
    with pytest.raises(ConversionError, match="has no config.json"):
        copy_hf_side_files(tmp_path / "dst" / "..", tmp_path / "x")


# ----------------------------------------------------------------------------- command lines


@pytest.mark.parametrize("tool", ["convert_hf_to_mcore", "convert_mcore_to_hf"])
def test_cli_help(tool):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / f"{tool}.py"), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage:" in done.stdout and "--overwrite" in done.stdout


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_hf_to_mcore", ROOT / "tools" / "convert_hf_to_mcore.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    hf = fake_hf_dir(tmp_path / "hf", family="qwen3_moe")
    assert tool.main([str(hf), str(tmp_path / "out"), "--target-ep", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: num_experts=8 is not divisible by parallel.expert_parallel=3") and "Traceback" not in err


def _convert_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_hf_to_mcore", ROOT / "tools" / "convert_hf_to_mcore.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_cli_names_hf_dir_for_a_missing_model(tmp_path, capsys):
    assert _convert_tool().main([str(tmp_path / "nowhere"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: HF_DIR {str(tmp_path / 'nowhere')!r} does not exist: pass a Hugging Face model directory")
    assert "model.path" not in err and "model.make_tiny" not in err


@pytest.mark.parametrize("flag", ["--target-tp", "--target-pp", "--target-ep", "--target-etp"])
def test_cli_refuses_a_parallel_size_of_zero(flag, tmp_path, capsys):
    """--target-tp 0 was read as 'no TP given' (TP 1); every --target-* size of 0 is refused before any work."""
    hf = fake_hf_dir(tmp_path / "hf", family="qwen3_moe")
    with pytest.raises(SystemExit) as raised:
        _convert_tool().main([str(hf), str(tmp_path / "out"), flag, "0", "--no-progress"])
    assert raised.value.code == 2
    assert f"error: argument {flag}: '0' is not a parallel size: give a whole number >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
