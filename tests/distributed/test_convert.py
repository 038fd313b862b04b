"""HF <-> megatron dist checkpoint conversion, end to end, for Qwen3-MoE, Mixtral, Qwen2, Qwen3 and Llama.

Each family's tiny random model (built by transformers, saved as several
safetensors shards with an index) is converted once into a megatron dist
checkpoint, in one process. That one checkpoint is then loaded on layouts 1,
TP2, PP2 and (MoE) EP2, and megatron's logits are compared with transformers'
(the reference runs in this pytest process) within 1e-4 in fp32; and it is
converted back to HF: every tensor bit-identical, same names, a config that
AutoConfig / AutoModelForCausalLM load. Llama is tied with a 300-token
vocabulary: megatron pads it to 384 rows at TP1 but 512 at TP2, so the TP2 load
reads the stored rows into a larger embedding, and PP2's last stage gets the
tied output layer from the embedding key. A bfloat16 copy of Qwen3 (one
model.safetensors, no index) checks dtype preservation and a bf16 checkpoint
loaded into an fp32 model.

Also here: the checkpoint format equals what megatron's own
dist_checkpointing.save writes; checkpoints megatron saved (on layouts 1, EP2
and TP2, as training would) and one with Transformer Engine key names convert
back bit for bit; failures mid-write (a full disk, simulated) leave nothing
under the output name; checkpoints that do not match their config are refused
naming the tensor.

Launches: one world of 1 for the conversions (+ layout 1), one world of 2 for
TP2 / PP2 / EP2 (families looped inside), plus small worlds of 1 for the other
checks.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.test_models_dist import forward_logits, sample_tokens

ROOT = Path(__file__).resolve().parents[2]
SHARD = "100KB"  # several safetensors files per tiny model, with model.safetensors.index.json

FAMILIES = {
    "qwen3_moe": dict(family="qwen3_moe", seed=21),  # with a tokenizer: hf/ carries it there and back
    "mixtral": dict(family="mixtral", seed=22, with_tokenizer=False),
    "qwen2": dict(family="qwen2", seed=23, with_tokenizer=False),
    "qwen3": dict(family="qwen3", seed=24, with_tokenizer=False),
    "llama": dict(family="llama", seed=25, with_tokenizer=False, vocab_size=300, tie_word_embeddings=True),
}
MOE = {"qwen3_moe", "mixtral"}
WORLD2 = [(family, {"tensor_parallel": 2}) for family in FAMILIES] + [(family, {"pipeline_parallel": 2}) for family in FAMILIES]
WORLD2 += [(family, {"expert_parallel": 2}) for family in FAMILIES if family in MOE]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _init_world() -> None:
    """Start the world of this launch once, so conversions and layouts reuse it (no re-rendezvous)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")


def _layout_logits(mcore_dir: str, layout: dict, save_to: str | None = None) -> torch.Tensor | None:
    """Build the model on `layout`, load the converted checkpoint, return full logits (None off the last stage).

    save_to: also save the loaded model there with megatron's dist_checkpointing.save, as training would.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.convert import load_mcore_checkpoint
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models import build_model, load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    hf_config = load_hf_config(f"{mcore_dir}/hf")
    ctx = init_parallel(ParallelConfig(**layout), shape=model_shape(hf_config))
    try:
        chunks = build_model(ModelConfig(path=f"{mcore_dir}/hf"), ctx, load_weights=False)
        load_mcore_checkpoint(chunks, mcore_dir)
        logits = forward_logits(chunks, ctx, sample_tokens(hf_config["vocab_size"]), hf_config["vocab_size"])
        if save_to:
            if ctx.rank == 0:
                Path(save_to).mkdir()
            dist.barrier()
            dist_checkpointing.save(chunks[0].sharded_state_dict(), save_to)
        return logits
    finally:
        destroy_parallel(ctx, keep_world=True)


def _convert_all(rank: int, world_size: int, hf_dirs: dict, root: str) -> dict:
    from megatron_rl.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf

    _init_world()
    cli_to_mcore, cli_to_hf = _tool("convert_hf_to_mcore"), _tool("convert_mcore_to_hf")
    out = {}
    for family, hf_dir in hf_dirs.items():
        mcore, back = f"{root}/{family}-mcore", f"{root}/{family}-hf"
        if family == "qwen3_moe":  # through the command lines
            # Small data files: the checkpoint is spread over several, as large models' are.
            argv = [hf_dir, mcore, "--target-tp", "2", "--target-ep", "2", "--max-file-size", "200KiB", "--no-progress"]
            assert cli_to_mcore.main(argv) == 0
            assert cli_to_hf.main([mcore, back, "--max-shard-size", SHARD, "--bucket-size", "64KiB", "--no-progress"]) == 0
        else:
            convert_hf_to_mcore(hf_dir, mcore)
            convert_mcore_to_hf(mcore, back, max_shard_size=SHARD, bucket_size="64KiB")
        out[family] = {"mcore": mcore, "hf": back, "logits": _layout_logits(mcore, {})}
    return out


def _load_layouts(rank: int, world_size: int, cases: list, mcore_dirs: dict, saves: dict) -> list:
    _init_world()
    return [_layout_logits(mcore_dirs[family], layout, saves.get((family, str(layout)))) for family, layout in cases]


def _convert_back(rank: int, world_size: int, jobs: list) -> None:
    from megatron_rl.checkpoint.convert import convert_mcore_to_hf

    _init_world()
    for ckpt, hf_dir, out in jobs:
        convert_mcore_to_hf(ckpt, out, hf_dir=hf_dir, max_shard_size=SHARD, bucket_size="64KiB")


def _bf16_copy(src: Path, dst: Path) -> str:
    """The model in bfloat16, as one model.safetensors without an index (how small HF models come)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file({name: t.to(torch.bfloat16) for name, t in _tensors(str(src)).items()}, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
    return str(dst)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict:
    """Tiny HF models; `qwen3_bf16` is qwen3 in bfloat16 (round trip and layout 1 only)."""
    from megatron_rl.models.tiny import make_tiny_model_dir

    root = tmp_path_factory.mktemp("convert_hf")
    dirs = {name: str(make_tiny_model_dir(root / name, max_shard_size=SHARD, **kw)) for name, kw in FAMILIES.items()}
    dirs["qwen3_bf16"] = _bf16_copy(root / "qwen3", root / "qwen3_bf16")
    return dirs


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("convert_out")
    return run_distributed(_convert_all, 1, hf_dirs, str(root), timeout=300)[0]


@pytest.fixture(scope="module")
def references(hf_dirs) -> dict:
    from transformers import AutoModelForCausalLM

    refs = {}
    for family, hf_dir in hf_dirs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            refs[family] = model(sample_tokens(model.config.vocab_size)).logits
    return refs


def _tensors(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _assert_close(family: str, layout, logits, ref) -> None:
    assert logits is not None, f"{family} {layout}: no logits"
    err = (logits - ref).abs().max().item()
    assert err < 1e-4, f"{family} {layout}: max |megatron - transformers| = {err:.3g}"


def test_hf_sources_are_sharded(hf_dirs):
    for family in FAMILIES:
        hf_dir = hf_dirs[family]
        assert (Path(hf_dir) / "model.safetensors.index.json").is_file(), family
        assert len(list(Path(hf_dir).glob("*.safetensors"))) > 2, family


def test_logits_single_rank(converted, references):
    for family, result in converted.items():
        _assert_close(family, "layout 1", result["logits"], references[family])


# Layouts whose loaded model is also saved by megatron (as training saves), then converted back to HF:
# experts split over EP ranks, and TP2 with the vocabulary padded to 512 rows (384 at TP1).
SAVED = [("qwen3_moe", {"expert_parallel": 2}), ("llama", {"tensor_parallel": 2})]


@pytest.fixture(scope="module")
def layouts(converted, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("convert_layouts")
    mcore_dirs = {family: r["mcore"] for family, r in converted.items()}
    saves = {(family, str(layout)): str(root / f"{family}-{'-'.join(layout)}") for family, layout in SAVED}
    results = run_distributed(_load_layouts, 2, WORLD2, mcore_dirs, saves, timeout=300)
    return {"logits": results, "saves": saves}


def test_logits_tp2_pp2_ep2(layouts, references):
    for i, (family, layout) in enumerate(WORLD2):
        got = [r[i] for r in layouts["logits"] if r[i] is not None]
        assert got, f"{family} {layout}: no rank returned logits"
        for logits in got:
            _assert_close(family, layout, logits, references[family])


def test_checkpoints_saved_on_other_layouts_convert_back(layouts, hf_dirs):
    jobs = [(ckpt, hf_dirs[family], f"{ckpt}-hf") for (family, _), ckpt in layouts["saves"].items()]
    run_distributed(_convert_back, 1, jobs, timeout=300)
    for (family, layout), ckpt in layouts["saves"].items():
        source, back = _tensors(hf_dirs[family]), _tensors(f"{ckpt}-hf")
        assert set(back) == set(source), f"{family} {layout}: names differ"
        for name, tensor in source.items():
            assert torch.equal(back[name], tensor), f"{family} saved at {layout}: {name} differs"


def test_checkpoint_directory(converted, hf_dirs):
    from megatron_rl.checkpoint.convert import MANIFEST

    mcore = Path(converted["qwen3_moe"]["mcore"])
    for name in ("metadata.json", ".metadata", "common.pt", MANIFEST, "hf/config.json", "hf/generation_config.json"):
        assert (mcore / name).is_file(), name
    assert (mcore / "hf/tokenizer.model").is_file() and (mcore / "hf/tokenizer_config.json").is_file()
    assert not list((mcore / "hf").glob("*.safetensors")) and not (mcore / "hf/model.safetensors.index.json").exists()
    manifest = json.loads((mcore / MANIFEST).read_text())
    assert manifest["family"] == "qwen3_moe" and manifest["checked_layouts"][0]["expert_parallel"] == 2
    assert not [p.name for p in mcore.parent.iterdir() if ".partial-" in p.name]


def test_round_trip_is_bit_identical(converted, hf_dirs, references):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    for family, result in converted.items():
        source, back = _tensors(hf_dirs[family]), _tensors(result["hf"])
        assert set(back) == set(source), f"{family}: names differ: {set(back) ^ set(source)}"
        for name, tensor in source.items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), f"{family}: {name} differs"
        index = json.loads((Path(result["hf"]) / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(source) and len(set(index["weight_map"].values())) > 2
        assert (Path(result["hf"]) / "config.json").read_bytes() == (Path(hf_dirs[family]) / "config.json").read_bytes()
        assert (Path(result["hf"]) / "generation_config.json").is_file()
        config = AutoConfig.from_pretrained(result["hf"])
        assert config.model_type == FAMILIES[family.removesuffix("_bf16")]["family"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(result["hf"], dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(sample_tokens(config.vocab_size)).logits
        assert torch.equal(logits, references[family]), family
    tokenizer = AutoTokenizer.from_pretrained(converted["qwen3_moe"]["hf"])
    assert tokenizer("12 + 30 = 42")["input_ids"]


# ----------------------------------------------------------------------------- the format is megatron's


def _megatron_saves(rank: int, world_size: int, hf_dirs: dict, converted: dict, root: str) -> dict:
    """megatron's own dist_checkpointing.save of each model (HF weights loaded), then our reverse conversion of it."""
    import pickle

    from megatron.core import dist_checkpointing

    from megatron_rl.checkpoint.convert import convert_mcore_to_hf
    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models import build_model, load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    _init_world()

    def describe(path: str) -> dict:
        with open(f"{path}/.metadata", "rb") as fh:
            metadata = pickle.load(fh)
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(md, "chunks", []))
            out[key] = (type(md).__name__, tuple(getattr(md, "size", ())), str(getattr(getattr(md, "properties", None), "dtype", "")), chunks)
        return out

    results = {}
    for family in ("qwen3_moe", "qwen2"):  # per-layer (MoE) and layer-stacked (dense) keys
        ours, theirs = converted[family], f"{root}/{family}-megatron-save"
        hf_config = load_hf_config(hf_dirs[family])
        ctx = init_parallel(ParallelConfig(), shape=model_shape(hf_config))
        try:
            (model,) = build_model(ModelConfig(path=hf_dirs[family]), ctx)
            Path(theirs).mkdir()
            dist_checkpointing.save(model.sharded_state_dict(), theirs)
        finally:
            destroy_parallel(ctx, keep_world=True)
        convert_mcore_to_hf(theirs, f"{theirs}-hf", hf_dir=hf_dirs[family], max_shard_size=SHARD)
        results[family] = {
            "ours": describe(ours),
            "theirs": describe(theirs),
            "common": (torch.load(f"{ours}/common.pt"), torch.load(f"{theirs}/common.pt")),
            "metadata_json": (Path(f"{ours}/metadata.json").read_text(), Path(f"{theirs}/metadata.json").read_text()),
            "hf": f"{theirs}-hf",
        }
    return results


def test_format_matches_megatron_save(converted, hf_dirs, tmp_path):
    mcore_dirs = {family: r["mcore"] for family, r in converted.items()}
    results = run_distributed(_megatron_saves, 1, hf_dirs, mcore_dirs, str(tmp_path), timeout=300)[0]
    for family, r in results.items():
        assert r["ours"] == r["theirs"], f"{family}: .metadata differs: {set(r['ours'].items()) ^ set(r['theirs'].items())}"
        assert r["common"][0] == r["common"][1] and json.loads(r["metadata_json"][0]) == json.loads(r["metadata_json"][1])
        source, back = _tensors(hf_dirs[family]), _tensors(r["hf"])  # a checkpoint megatron wrote, converted back
        assert set(back) == set(source) and all(torch.equal(back[n], t) for n, t in source.items()), family


def _te_named(rank: int, world_size: int, mcore_dir: str, hf_dir: str, root: str) -> dict:
    """A checkpoint with the Transformer Engine spec's MoE key names: read back and loaded (local spec here)."""
    import dataclasses
    import pickle

    from megatron_rl.checkpoint.convert import convert_mcore_to_hf

    _init_world()
    te_dir = Path(root) / "te-named"
    shutil.copytree(mcore_dir, te_dir)
    local, te = "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"

    def rename(key: str) -> str:
        return key[: -len(local)] + te if key.endswith(local) else key

    with open(te_dir / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)
    renamed = [k for k in metadata.state_dict_metadata if k.endswith(local)]
    metadata.state_dict_metadata = {rename(k): v for k, v in metadata.state_dict_metadata.items()}
    metadata.storage_data = {dataclasses.replace(i, fqn=rename(i.fqn)): v for i, v in metadata.storage_data.items()}
    with open(te_dir / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)
    convert_mcore_to_hf(te_dir, f"{root}/te-named-hf", max_shard_size=SHARD)
    return {"renamed": renamed, "hf": f"{root}/te-named-hf", "logits": _layout_logits(str(te_dir), {})}


def test_transformer_engine_key_names_are_read(converted, hf_dirs, references, tmp_path):
    """megatron's TE spec stores an MoE layer's pre-MLP norm as pre_mlp_layernorm.weight, its local spec under the fused name."""
    out = run_distributed(_te_named, 1, converted["qwen3_moe"]["mcore"], hf_dirs["qwen3_moe"], str(tmp_path), timeout=300)[0]
    assert len(out["renamed"]) == 2  # one per layer
    source, back = _tensors(hf_dirs["qwen3_moe"]), _tensors(out["hf"])
    assert set(back) == set(source) and all(torch.equal(back[n], t) for n, t in source.items())
    _assert_close("qwen3_moe", "TE key names", out["logits"], references["qwen3_moe"])


def _cast(rank: int, world_size: int, hf_dir: str, root: str) -> None:
    from megatron_rl.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf

    _init_world()
    convert_hf_to_mcore(hf_dir, f"{root}/bf16-mcore", dtype="bfloat16")
    convert_mcore_to_hf(f"{root}/bf16-mcore", f"{root}/bf16-hf")  # as stored: bfloat16
    convert_mcore_to_hf(f"{root}/bf16-mcore", f"{root}/fp32-hf", dtype="float32")


def test_dtype_option_casts(hf_dirs, tmp_path):
    run_distributed(_cast, 1, hf_dirs["qwen2"], str(tmp_path), timeout=300)
    source = _tensors(hf_dirs["qwen2"])
    manifest = json.loads((tmp_path / "bf16-mcore/megatron_rl_conversion.json").read_text())
    assert manifest["dtypes"] == ["bfloat16"]
    for name, dtype in (("bf16-hf", torch.bfloat16), ("fp32-hf", torch.float32)):
        back = _tensors(str(tmp_path / name))
        assert set(back) == set(source) and (tmp_path / name / "model.safetensors").is_file()  # one 5GB-limit file
        assert all(torch.equal(back[n], t.to(torch.bfloat16).to(dtype)) for n, t in source.items()), name
        assert json.loads((tmp_path / name / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- failures and bad input


def _failures(rank: int, world_size: int, hf_dir: str, mcore_dir: str, root: str) -> dict:
    import errno

    from megatron_rl.checkpoint import convert
    from megatron_rl.checkpoint.safetensors_writer import ShardedSafetensorsWriter

    _init_world()
    out: dict = {}
    disk_full = OSError(errno.ENOSPC, "No space left on device")

    # 1. HF -> megatron: the disk fills after the third checkpoint piece.
    materialise, calls = convert._Materialiser.__call__, [0]

    def failing_materialise(self, piece):
        calls[0] += 1
        if calls[0] > 3:
            raise disk_full
        return materialise(self, piece)

    convert._Materialiser.__call__ = failing_materialise
    try:
        convert.convert_hf_to_mcore(hf_dir, f"{root}/to-mcore")
    except convert.ConversionError as err:
        out["to_mcore"] = str(err)
    finally:
        convert._Materialiser.__call__ = materialise
    out["to_mcore_calls"] = calls[0]

    # 2. megatron -> HF: the disk fills once the first safetensors file is complete,
    #    first into a fresh name, then over an existing output (which must survive).
    close_file, closed = ShardedSafetensorsWriter._close_file, [0]

    def failing_close(self):
        close_file(self)
        closed[0] += 1
        raise disk_full

    existing = Path(f"{root}/existing-hf")
    existing.mkdir()
    (existing / "keep.txt").write_text("old output")
    ShardedSafetensorsWriter._close_file = failing_close
    try:
        for name, target in (("to_hf", f"{root}/to-hf"), ("to_hf_overwrite", str(existing))):
            try:
                convert.convert_mcore_to_hf(mcore_dir, target, max_shard_size=SHARD, overwrite=True)
            except convert.ConversionError as err:
                out[name] = str(err)
    finally:
        ShardedSafetensorsWriter._close_file = close_file
    out["files_closed"] = closed[0]
    out["listing"] = sorted(p.name for p in Path(root).iterdir())
    out["existing"] = sorted(p.name for p in existing.iterdir())
    return out


def test_failure_mid_write_leaves_nothing(converted, hf_dirs, tmp_path):
    out = run_distributed(_failures, 1, hf_dirs["qwen3_moe"], converted["qwen3_moe"]["mcore"], str(tmp_path), timeout=300)[0]
    assert out["to_mcore_calls"] == 4
    for name in ("to_mcore", "to_hf"):
        assert "no space left on device" in out[name] and "nothing was written under that name" in out[name], out[name]
    assert "no space left on device" in out["to_hf_overwrite"] and "existing output there is unchanged" in out["to_hf_overwrite"]
    assert out["files_closed"] == 2  # each run got through exactly one file before failing
    assert out["listing"] == ["existing-hf"], f"leftovers: {out['listing']}"  # no to-mcore, to-hf, nor .partial dirs
    assert out["existing"] == ["keep.txt"]


def _bad_inputs(rank: int, world_size: int, hf_dirs: dict, converted: dict, root: str) -> dict:
    from safetensors.torch import load_file, save_file

    from megatron_rl.checkpoint.convert import ConversionError, convert_hf_to_mcore, convert_mcore_to_hf

    _init_world()
    out = {}

    def mismatched_config(name: str, family: str, **changes) -> str:
        side = Path(root) / name
        shutil.copytree(Path(converted[family]) / "hf", side)
        config = json.loads((side / "config.json").read_text())
        (side / "config.json").write_text(json.dumps({**config, **changes}))
        return str(side)

    cases = {
        "missing": ("qwen3_moe", dict(num_hidden_layers=3)),
        "extra": ("qwen3_moe", dict(num_hidden_layers=1)),
        "shape": ("qwen2", dict(intermediate_size=96)),
    }
    for case, (family, changes) in cases.items():
        try:
            convert_mcore_to_hf(converted[family], f"{root}/{case}-out", hf_dir=mismatched_config(case, family, **changes))
        except ConversionError as err:
            out[case] = str(err)

    # An HF checkpoint whose q_proj has lost a row.
    broken = Path(root) / "broken-hf"
    shutil.copytree(hf_dirs["qwen2"], broken, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for shard in sorted(Path(hf_dirs["qwen2"]).glob("*.safetensors")):
        tensors.update(load_file(shard))
    tensors["model.layers.1.self_attn.q_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"][:-1].clone()
    save_file(tensors, broken / "model.safetensors")
    try:
        convert_hf_to_mcore(broken, f"{root}/broken-out")
    except ConversionError as err:
        out["hf_shape"] = str(err)
    out["listing"] = sorted(p.name for p in Path(root).iterdir() if p.name.endswith("-out") or ".partial-" in p.name)
    out["layer_2_keys"] = _layer_keys(str(Path(root) / "missing"), 2)
    return out


def _layer_keys(hf_dir: str, layer: int) -> list[str]:
    """The tensor keys megatron-core's own sharded_state_dict gives decoder layer `layer` of the model of `hf_dir`
    (local spec, as the converter's checkpoints are): what a checkpoint of that model holds for the layer."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_rl.config import ModelConfig, ParallelConfig
    from megatron_rl.models import build_model, load_hf_config, model_shape
    from megatron_rl.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(), shape=model_shape(load_hf_config(hf_dir)))
    try:
        (model,) = build_model(ModelConfig(path=hf_dir, dtype="float32", transformer_impl="local"), ctx, load_weights=False)
        state = model.sharded_state_dict()
        apply_factories(state)  # GroupedMLP / SequentialMLP / fused-linear factories -> the ShardedTensors saved
        keys = {t.key for t in nested_values(state) if isinstance(t, ShardedTensor)}
    finally:
        destroy_parallel(ctx, keep_world=True)
    return sorted(k for k in keys if k.startswith(f"decoder.layers.{layer}."))


def test_mismatched_checkpoints_are_refused(converted, hf_dirs, tmp_path):
    mcore_dirs = {family: r["mcore"] for family, r in converted.items()}
    out = run_distributed(_bad_inputs, 1, hf_dirs, mcore_dirs, str(tmp_path), timeout=300)[0]
    # a 2-layer checkpoint read with a 3-layer config lacks exactly layer 2's tensors: per Qwen3-MoE layer
    # input norm, fused q/k/v, output projection, q and k norms, pre-MLP norm, router, experts' fc1 and fc2 = 9
    layer_2 = out["layer_2_keys"]
    assert len(layer_2) == 9, layer_2
    missing = re.search(r"(\d+) missing \(e\.g\. (\[[^\]]*\])\)", out["missing"])
    assert missing and int(missing.group(1)) == len(layer_2), out["missing"]
    examples = ast.literal_eval(missing.group(2))
    assert examples == sorted(layer_2)[:4], out["missing"]  # every example a layer-2 key, the first four in order
    assert "unexpected" in out["extra"] and "decoder.layers.1." in out["extra"], out["extra"]
    assert "decoder.layers.mlp.linear_fc1.weight" in out["shape"] and "global shape" in out["shape"], out["shape"]
    assert "model.layers.1.self_attn.q_proj.weight" in out["hf_shape"] and "decoder.layers.1.self_attention.linear_qkv.weight" in out["hf_shape"], out["hf_shape"]
    assert out["listing"] == []
