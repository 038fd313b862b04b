"""Config loading: presets, includes, overrides, unknown keys, type errors."""

import pytest

from megatron_rl.config import AlgorithmConfig, ConfigError, ParallelConfig, RLConfig, load_config, to_dict
from megatron_rl.config.core import field_docs, from_dict


def test_overrides_set_nested_fields_with_yaml_types():
    cfg = load_config(RLConfig, None, ["parallel.tensor_parallel=2", "algorithm.eps_high=4e-4", "rollout.stop=[a, b]"])
    assert cfg.parallel.tensor_parallel == 2
    assert cfg.algorithm.eps_high == pytest.approx(4e-4)
    assert cfg.rollout.stop == ["a", "b"]


def test_preset_includes_merge_in_order(tmp_path):
    (tmp_path / "base.yaml").write_text("train: {steps: 3, seed: 7}\nalgorithm: {loss: dapo}\n")
    (tmp_path / "algo.yaml").write_text("algorithm: {loss: gspo, eps_low: 0.001}\n")
    (tmp_path / "run.yaml").write_text("defaults: [base.yaml, algo.yaml]\ntrain: {steps: 5}\n")
    cfg = load_config(RLConfig, tmp_path / "run.yaml", ["train.seed=9"])
    # own keys beat defaults, later defaults beat earlier ones, overrides beat everything
    assert (cfg.train.steps, cfg.train.seed, cfg.algorithm.loss, cfg.algorithm.eps_low) == (5, 9, "gspo", 0.001)


def test_unknown_key_names_key_and_closest():
    with pytest.raises(ConfigError, match=r"'algorithm\.eps_hgh'.*'eps_high'"):
        load_config(RLConfig, None, ["algorithm.eps_hgh=1"])
    with pytest.raises(ConfigError, match=r"'paralel'.*'parallel'"):
        load_config(RLConfig, None, ["paralel.tensor_parallel=2"])


def test_wrong_types_and_values_are_named():
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel.*integer.*'two'"):
        load_config(RLConfig, None, ["parallel.tensor_parallel=two"])
    with pytest.raises(ConfigError, match=r"model\.token_dispatcher.*'flex'"):
        load_config(RLConfig, None, ["model.token_dispatcher=flex"])
    with pytest.raises(ConfigError, match=r"train\.prompts_per_step=6.*mini_batches_per_step=4"):
        load_config(RLConfig, None, ["train.prompts_per_step=6", "train.mini_batches_per_step=4"])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(RLConfig, None, ["algorithm.loss"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RLConfig, tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(RLConfig, tmp_path / "bad.yaml")
    (tmp_path / "loop.yaml").write_text("defaults: [loop.yaml]\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(RLConfig, tmp_path / "loop.yaml")


def test_a_directory_is_not_taken_for_a_missing_file(tmp_path):
    """`--config configs` names a directory: say so, not 'does not exist'."""
    root = tmp_path.resolve()  # the message names the resolved path
    (root / "configs").mkdir()
    with pytest.raises(ConfigError) as raised:
        load_config(RLConfig, root / "configs")
    assert str(raised.value) == (f"config file {str(root / 'configs')!r} is a directory, not a YAML file: "
                                 "name a preset file, e.g. configs/tiny-gspo.yaml")
    (root / "top.yaml").write_text("defaults: [configs]\n")
    with pytest.raises(ConfigError) as raised:
        load_config(RLConfig, root / "top.yaml")
    assert str(raised.value) == (f"preset {str(root / 'top.yaml')!r} includes {str(root / 'configs')!r} (defaults:), "
                                 "which is a directory, not a YAML file: name a preset file, e.g. configs/tiny-gspo.yaml")


def test_round_trip_through_dict():
    cfg = load_config(RLConfig, None, ["parallel.expert_parallel=2", "algorithm.loss=dapo"])
    assert from_dict(RLConfig, to_dict(cfg)) == cfg


def test_every_field_has_a_docstring():
    import dataclasses

    from megatron_rl.config import schema
    from megatron_rl.config.rollout import RolloutConfig

    classes = [AlgorithmConfig, RolloutConfig] + [c for c in vars(schema).values() if dataclasses.is_dataclass(c) and c.__module__ == schema.__name__]
    for cls in classes:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in docs]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_parallel_sizes_must_be_positive():
    with pytest.raises(ConfigError, match="tensor_parallel=0"):
        from_dict(ParallelConfig, {"tensor_parallel": 0})


def test_sampling_truncation_with_importance_sampling_is_refused():
    from megatron_rl.config import RLConfig, from_dict

    for rollout, algorithm in (({"top_p": 0.9}, {"loss": "dapo", "tis_mode": "icepop"}), ({"top_k": 20}, {"bypass_mode": True})):
        with pytest.raises(ConfigError, match=r"renormalised over the top-p/top-k set.*top_p=1 and top_k=-1"):
            from_dict(RLConfig, {"rollout": rollout, "algorithm": algorithm})
    # Truncation alone, or IS without truncation, is fine.
    assert from_dict(RLConfig, {"rollout": {"top_p": 0.9}}).rollout.top_p == 0.9
    assert from_dict(RLConfig, {"algorithm": {"tis_mode": "sequence_mask"}}).algorithm.tis_mode == "sequence_mask"


def test_asynchronous_training_options_are_checked():
    from megatron_rl.config import RLConfig, from_dict

    with pytest.raises(ConfigError, match="pick one"):
        from_dict(RLConfig, {"train": {"max_staleness": 1, "off_policy_lag": 1}})
    with pytest.raises(ConfigError, match="partial_rollouts=true needs train.max_staleness >= 1"):
        from_dict(RLConfig, {"train": {"partial_rollouts": True}})
    with pytest.raises(ConfigError, match="max_staleness=-1"):
        from_dict(RLConfig, {"train": {"max_staleness": -1}})
    with pytest.raises(ConfigError, match="a stop string could span the interruption"):
        from_dict(RLConfig, {"train": {"max_staleness": 1, "partial_rollouts": True}, "rollout": {"stop": ["\n"]}})
    with pytest.raises(ConfigError, match="routes would not be those its tokens were sampled with"):
        from_dict(RLConfig, {"train": {"max_staleness": 1, "partial_rollouts": True}, "rollout": {"return_routed_experts": True}})
    # the routes' capture runs in eager forwards only: CUDA graphs would replay decode steps without it
    with pytest.raises(ConfigError, match="return_routed_experts=true with rollout.enforce_eager=false.*set rollout.enforce_eager=true"):
        from_dict(RLConfig, {"rollout": {"return_routed_experts": True, "enforce_eager": False}})
    from_dict(RLConfig, {"rollout": {"return_routed_experts": False, "enforce_eager": False}})  # graphs without capture
    # servers are not interrupted: refused at load, naming both settings
    servers = {"engine": "vllm_server", "server_urls": ["http://127.0.0.1:8000"]}
    with pytest.raises(ConfigError, match="partial_rollouts=true with rollout.engine=vllm_server"):
        from_dict(RLConfig, {"train": {"max_staleness": 1, "partial_rollouts": True}, "rollout": servers,
                             "algorithm": {"tis_mode": "token"}})
    # the chunked form's key is refused with the name of its replacement; 0 (its default) still loads
    with pytest.raises(ConfigError, match=r"partial_rollout_tokens=4: .*set train.partial_rollouts=true"):
        from_dict(RLConfig, {"train": {"max_staleness": 1, "partial_rollout_tokens": 4}})
    token = {"tis_mode": "token"}
    assert from_dict(RLConfig, {"train": {"max_staleness": 1, "partial_rollout_tokens": 0}, "algorithm": token}).train.partial_rollouts is False
    assert from_dict(RLConfig, {"train": {"max_staleness": 2, "partial_rollouts": True}, "algorithm": token}).train.partial_rollouts is True
    # Asynchronous steps train on older weights' samples: a correction is required (bypass mode also counts).
    with pytest.raises(ConfigError, match=r"max_staleness=2 with algorithm.tis_mode=none: .* set algorithm.tis_mode=token"):
        from_dict(RLConfig, {"train": {"max_staleness": 2}})
    for algorithm in ({"tis_mode": "sequence"}, {"bypass_mode": True}):
        assert from_dict(RLConfig, {"train": {"max_staleness": 2}, "algorithm": algorithm}).train.max_staleness == 2
    assert from_dict(RLConfig, {"algorithm": {"loss": "gspo", "tis_mode": "icepop"}}).algorithm.tis_mode == "icepop"


def test_offload_needs_synchronous_generation():
    from megatron_rl.config import RLConfig, load_config

    for overlap in ("train.off_policy_lag=1", "train.max_staleness=1"):
        with pytest.raises(ConfigError, match="train.offload=all .*generation overlaps training"):
            load_config(RLConfig, None, ["train.offload=all", overlap])
    with pytest.raises(ConfigError, match="offload"):
        load_config(RLConfig, None, ["train.offload=weights"])
    assert load_config(RLConfig, None, ["train.offload=optimizer"]).train.offload == "optimizer"


def test_engine_sleep_needs_synchronous_generation():
    with pytest.raises(ConfigError, match="rollout.sleep_level=1 .*train.off_policy_lag=1"):
        load_config(RLConfig, None, ["rollout.sleep_level=1", "train.off_policy_lag=1"])
    with pytest.raises(ConfigError, match="sleep_level"):
        load_config(RLConfig, None, ["rollout.sleep_level=3"])


def test_old_logprobs_come_from_the_training_forward_only_where_it_is_the_old_policy():
    from megatron_rl.config.schema import old_logprobs_source

    def source(train=None, algorithm=None):
        cfg = from_dict(RLConfig, {"train": train or {}, "algorithm": algorithm or {}})
        return old_logprobs_source(cfg.train, cfg.algorithm)[0]

    # the first optimizer step of an RL step runs at the old policy's weights (also asynchronously, with the
    # truncated token correction asynchronous training needs, under R2 / R3, and with more mini-batches)
    assert source() == "training_forward"
    assert source({"prompts_per_step": 8, "mini_batches_per_step": 2}) == "training_forward"
    assert source({"max_staleness": 1}, {"tis_mode": "token"}) == "training_forward"
    assert source({}, {"tis_mode": "sequence", "routing_replay": "R2"}) == "training_forward"
    assert source({"old_logprobs": "training_forward"}, {"routing_replay": "R3"}) == "training_forward"
    # a forward of its own: asked for, or a correction that drops tokens by the old logprobs
    assert source({"old_logprobs": "forward"}) == "forward"
    for mode in ("icepop", "token_mask", "sequence_mask", "sequence_mask_tis"):
        assert source({}, {"loss": "dapo", "tis_mode": mode}) == "forward", mode
    # bypass mode: the engine's logprobs, whatever train.old_logprobs says (but training_forward is refused)
    assert source({"old_logprobs": "forward"}, {"bypass_mode": True}) == "rollout"
    assert source({}, {"bypass_mode": True}) == "rollout"
    with pytest.raises(ConfigError, match=r"algorithm.tis_mode=icepop drops tokens .* set train.old_logprobs=auto"):
        source({"old_logprobs": "training_forward"}, {"loss": "dapo", "tis_mode": "icepop"})
    with pytest.raises(ConfigError, match="bypass_mode takes the engine's logprobs"):
        source({"old_logprobs": "training_forward"}, {"bypass_mode": True})
    with pytest.raises(ConfigError, match="old_logprobs"):
        from_dict(RLConfig, {"train": {"old_logprobs": "recompute"}})
