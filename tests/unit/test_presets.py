"""configs/: every preset loads; fragments hold the papers' values and the published model configs."""

import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, RLConfig, load_config
from megatron_rl.config.core import load_yaml_preset

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PRESETS = sorted(CONFIGS.glob("*.yaml"))
FRAGMENTS = sorted(CONFIGS.glob("*/*.yaml"))


def test_the_promised_presets_exist():
    names = {p.name for p in PRESETS}
    for name in (
        "qwen3-30b-a3b-gspo-4x8h100.yaml",
        "qwen3-30b-a3b-gspo-32k-cp2-4x8h100.yaml",
        "qwen3-30b-a3b-gspo-32k-cp4-4x8h100.yaml",
        "qwen3-235b-a22b-gspo-32x8h100.yaml",
        "mixtral-8x7b-dapo-4x8h100.yaml",
        "deepseek-v3-gspo-64x8h100.yaml",
        "moonlight-16b-a3b-gspo-1x8h100.yaml",
        "glm-4.5-air-gspo-32x8h100.yaml",
        "tiny-gspo.yaml",
        "tiny-dapo.yaml",
        "tiny-dr_grpo.yaml",
        "tiny-grpo.yaml",
    ):
        assert name in names
    fragments = {f"{p.parent.name}/{p.name}" for p in FRAGMENTS}
    for name in ("gspo", "dapo", "dr_grpo", "grpo"):
        assert f"algorithms/{name}.yaml" in fragments
    for name in ("1x8-h100", "4x8-h100", "32x8-h100", "cpu-1", "cpu-2"):
        assert f"clusters/{name}.yaml" in fragments
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "tiny-moe", "deepseek-v3", "moonlight-16b-a3b", "glm-4.5-air"):
        assert f"models/{name}.yaml" in fragments


@pytest.mark.parametrize("path", PRESETS + FRAGMENTS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_yaml_loads_into_the_schema(path):
    load_config(RLConfig, path)  # unknown keys and bad types raise ConfigError


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_each_preset_combines_a_model_an_algorithm_and_a_cluster(path):
    raw = load_yaml_preset(path)
    assert {"model", "algorithm", "cluster"} <= raw.keys()
    named = [token for token in path.stem.split("-") if token in ("gspo", "dapo", "dr_grpo", "grpo")]
    assert named == [raw["algorithm"]["loss"]]  # the file name says which algorithm it runs


def _algorithm(name):
    return load_config(RLConfig, CONFIGS / "algorithms" / f"{name}.yaml").algorithm


def test_gspo_fragment_has_the_papers_sequence_level_clip():
    a = _algorithm("gspo")
    assert (a.loss, a.advantage, a.eps_low, a.eps_high, a.beta) == ("gspo", "grpo", 3e-4, 4e-4, 0.0)


def test_dapo_fragment_has_clip_higher_dynamic_sampling_overlong_shaping_and_no_kl():
    a = _algorithm("dapo")
    assert (a.loss, a.eps_low, a.eps_high, a.beta) == ("dapo", 0.2, 0.28, 0.0)
    assert a.dynamic_sampling and a.overlong_filter
    assert (a.overlong_buffer, a.overlong_penalty) == (4096, 1.0)


def test_dr_grpo_fragment_drops_the_std_and_the_length_normalisation():
    a = _algorithm("dr_grpo")
    assert (a.loss, a.advantage, a.beta, a.max_response_tokens) == ("dr_grpo", "dr_grpo", 0.0, 0)


def test_grpo_fragment_has_a_k3_kl_to_the_reference():
    a = _algorithm("grpo")
    assert (a.loss, a.advantage, a.eps_low, a.eps_high, a.kl_estimator) == ("grpo", "grpo", 0.2, 0.2, "k3")
    assert a.beta == 0.04


@pytest.mark.parametrize(
    "name, nodes, world",
    [("1x8-h100", 1, 8), ("4x8-h100", 4, 32), ("32x8-h100", 32, 256), ("cpu-1", 1, 1), ("cpu-2", 1, 2)],
)
def test_cluster_fragments(name, nodes, world):
    cluster = load_config(RLConfig, CONFIGS / "clusters" / f"{name}.yaml").cluster
    assert (cluster.nodes, cluster.trainer_world_size) == (nodes, world)


# Published architecture numbers (the model cards on huggingface.co), checked against the stored config.json.
MODEL_CARDS = {
    "qwen3-30b-a3b": dict(
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8
    ),
    "qwen3-235b-a22b": dict(
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8
    ),
    "mixtral-8x7b": dict(
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2
    ),
    "deepseek-v3": dict(
        num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512, q_lora_rank=1536, n_routed_experts=256, num_experts_per_tok=8,
        first_k_dense_replace=3, n_group=8, topk_group=4,
    ),
    "moonlight-16b-a3b": dict(
        num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None, n_routed_experts=64, num_experts_per_tok=6,
        first_k_dense_replace=1, n_shared_experts=2,
    ),
    "glm-4.5-air": dict(
        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, n_routed_experts=128, num_experts_per_tok=8,
        first_k_dense_replace=1, partial_rotary_factor=0.5,
    ),
}


@pytest.mark.parametrize("name", sorted(MODEL_CARDS))
def test_model_fragment_points_at_the_published_config_from_any_working_directory(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the path is relative to the YAML file, not to where the command runs
    cfg = load_config(RLConfig, CONFIGS / "models" / f"{name}.yaml")
    model_dir = Path(cfg.model.path)
    assert model_dir.is_absolute() and model_dir == CONFIGS / "models" / name
    config = json.loads((model_dir / "config.json").read_text())
    for key, value in MODEL_CARDS[name].items():
        assert config[key] == value, key


def test_tiny_model_path_stays_relative_to_the_working_directory():
    cfg = load_config(RLConfig, CONFIGS / "models" / "tiny-moe.yaml")
    assert cfg.model.path == "outputs/tiny-moe"


def test_preset_paths_resolve_against_their_own_file_but_overrides_do_not(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "frag.yaml").write_text("model: {path: ../weights}\ndata: {path: ./prompts.jsonl, reward: ./x}\n")
    (tmp_path / "run.yaml").write_text("defaults: [sub/frag.yaml]\ncheckpoint: {dir: ./ckpt}\nlogging: {dir: runs/a}\n")
    cfg = load_config(RLConfig, tmp_path / "run.yaml")
    assert cfg.model.path == str(tmp_path / "weights")
    assert cfg.data.path == str(tmp_path / "sub" / "prompts.jsonl")
    assert cfg.checkpoint.dir == str(tmp_path / "ckpt")
    assert cfg.logging.dir == "runs/a"  # not ./-prefixed: relative to the working directory
    assert cfg.data.reward == "./x"  # not a path key
    cfg = load_config(RLConfig, tmp_path / "run.yaml", ["model.path=./mine"])
    assert cfg.model.path == "./mine"


def test_rollout_engine_sizes_are_validated():
    with pytest.raises(ConfigError, match="rollout.tensor_parallel=0"):
        load_config(RLConfig, None, ["rollout.tensor_parallel=0"])
    with pytest.raises(ConfigError, match="gpu_memory_utilization=1.5"):
        load_config(RLConfig, None, ["rollout.gpu_memory_utilization=1.5"])


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_s_model_ships_with_the_repository_or_is_built_on_first_use(preset):
    model = load_config(RLConfig, preset).model
    shipped = Path(model.path).is_absolute() and (Path(model.path) / "config.json").is_file()
    assert shipped or model.make_tiny_if_missing, f"{preset.name}: model.path={model.path} exists only after another command has run"


def test_a_missing_tiny_model_is_built_once_when_ranks_start_together(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from megatron_rl.models import load_hf_config, parse_hf_config
    from megatron_rl.models.tiny import ensure_tiny_model_dir, tiny_hf_config

    model_dir = tmp_path / "outputs" / "tiny-moe"
    with ThreadPoolExecutor(3) as pool:  # a lock file is per open(), so threads contend as processes do
        built = list(pool.map(lambda _: ensure_tiny_model_dir(model_dir, "qwen3_moe", seed=0), range(3)))
    assert sorted(built) == [False, False, True]
    # The planner plans a missing tiny model from tiny_hf_config: the one built has that shape.
    assert parse_hf_config(load_hf_config(model_dir)) == parse_hf_config(tiny_hf_config("qwen3_moe"))
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [".tiny-moe.lock", "tiny-moe"]


def test_gpu_presets_run_the_experts_as_grouped_gemms():
    """Every H100 preset builds grouped experts; the large-model ones (which assume Transformer Engine) fuse the permute too."""
    gpu = [p for p in PRESETS if "h100" in p.name]
    assert gpu
    for path in gpu:
        model = load_config(RLConfig, path).model
        assert model.moe_grouped_gemm, path.name
        assert model.moe_permute_fusion == (not path.name.startswith("tiny")), path.name
    assert not load_config(RLConfig, CONFIGS / "tiny-gspo.yaml").model.moe_grouped_gemm  # CPU: off


def test_the_tiny_model_is_built_only_at_the_preset_s_own_path_or_when_asked(tmp_path):
    from megatron_rl.models.tiny import preset_model_path, tiny_family_to_build

    preset = CONFIGS / "tiny-gspo.yaml"
    assert preset_model_path(preset) == "outputs/tiny-moe"  # configs/models/tiny-moe.yaml, with the family
    own = load_config(RLConfig, preset, ["model.path=outputs/tiny-moe-never-built"]).model
    assert tiny_family_to_build(own, "outputs/tiny-moe-never-built") == "qwen3_moe"
    typed = load_config(RLConfig, preset, [f"model.path={tmp_path / 'typo'}"]).model
    assert tiny_family_to_build(typed, preset_model_path(preset)) == ""  # a typed path: an error, not a stand-in
    assert tiny_family_to_build(typed, None) == ""
    asked = load_config(RLConfig, preset, [f"model.path={tmp_path / 'new'}", "model.make_tiny=true"]).model
    assert tiny_family_to_build(asked, None) == "qwen3_moe"
    (tmp_path / "typo").mkdir()
    assert tiny_family_to_build(typed, str(tmp_path / "typo")) == ""  # an existing directory is never rebuilt


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_s_prompt_and_response_fit_its_model_s_positions(preset):
    from megatron_rl.models.tiny import tiny_hf_config
    from megatron_rl.preflight import check_lengths

    cfg = load_config(RLConfig, preset)
    config_file = Path(cfg.model.path) / "config.json"
    hf_config = json.loads(config_file.read_text()) if config_file.is_file() else tiny_hf_config(cfg.model.make_tiny_if_missing)
    assert cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens <= hf_config["max_position_embeddings"]
    check_lengths(cfg, hf_config)  # the start-up check agrees
    too_long = load_config(RLConfig, preset, [f"rollout.max_new_tokens={hf_config['max_position_embeddings']}"])
    with pytest.raises(ConfigError, match=r"rollout.max_prompt_tokens \+ rollout.max_new_tokens = .* positions"):
        check_lengths(too_long, hf_config)
