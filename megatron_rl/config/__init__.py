"""Configuration: typed dataclasses, YAML presets, `key=value` overrides, validation."""

from megatron_rl.config.algorithm import AlgorithmConfig
from megatron_rl.config.core import ConfigError, from_dict, load_config, to_dict
from megatron_rl.config.layout import ModelShape, check_layout, data_parallel_size
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RLConfig,
    TrainConfig,
)

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "ModelShape",
    "OptimizerConfig",
    "ParallelConfig",
    "RLConfig",
    "RolloutConfig",
    "TrainConfig",
    "check_layout",
    "data_parallel_size",
    "from_dict",
    "load_config",
    "to_dict",
]
