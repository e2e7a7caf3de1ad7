"""Typed run configuration: YAML (safe-loaded) + dotted `key.sub=value` overrides, validated before any work.

Each section is a flat dataclass that carries its own rules (`sections`): a choice is typed as a `Literal`, a
number's range and every key's help text (`twinplane train --help`) are field metadata (`keys.opt`), and the rules
across keys are the section's `rules`. `Config.validate` checks every key against its type and range, then every
section's rules. `load` reads YAML files and overrides into a validated `Config`.
"""

from twinplane.config.keys import _all_keys
from twinplane.config.load import ALIASES, PATH_KEYS, REMOVED, config_help, load_config, without_removed
from twinplane.config.sections import (
    AgentSection,
    AlgoSection,
    CheckpointSection,
    ClusterSection,
    Config,
    ConfigError,
    CriticSection,
    DataSection,
    EvalSection,
    LogSection,
    LoraSection,
    ModelSection,
    RewardSection,
    RolloutSection,
    TaskSection,
    TrainSection,
    WarmStartSection,
    plain_template_problem,
)

__all__ = ["ALIASES", "PATH_KEYS", "REMOVED", "AgentSection", "AlgoSection", "CheckpointSection", "ClusterSection",
           "Config", "ConfigError", "CriticSection", "DataSection", "EvalSection", "LogSection", "LoraSection",
           "ModelSection", "RewardSection", "RolloutSection", "TaskSection", "TrainSection", "WarmStartSection",
           "_all_keys", "config_help", "load_config", "plain_template_problem", "without_removed"]
