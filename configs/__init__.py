"""Run configuration: dataclasses, presets and command-line overrides (no jax imported here)."""

from configs.base import ConfigError, DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from configs.overrides import apply_overrides
from configs.presets import PRESETS, get_preset

__all__ = [
    "ConfigError", "DataConfig", "ModelConfig", "PRESETS", "ParallelConfig", "RunConfig",
    "TrainConfig", "apply_overrides", "get_preset",
]
