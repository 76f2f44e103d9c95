"""The one config schema of rlray.

Every default lives here and nowhere else. A config is loaded from YAML, then dotted
``key=value`` overrides are applied (``learner.lr=1e-5``), then the whole tree is validated.
Errors name the dotted key, the value that was given and the fix (for an unknown key, the
nearest valid key).

Sections: run, model, data, rollout, reward, env, algo, teacher, learner, eval, tracking, checkpoint, guard,
monitor, resources.

Modules: base, run, reward, judge, algo, teacher, env, operations, resources, schema (``Config``), loading (YAML
and overrides) and describe (``rlray config --describe``). The package re-exports the public names in
``__all__``; a private helper (leading underscore) is imported from the module that defines it.
"""

from rlray.config.algo import (  # noqa: F401
    AlgoConfig,
    CriticConfig,
    LearnerConfig,
    OfflineConfig,
)
from rlray.config.base import ConfigError, CoreList, flatten  # noqa: F401
from rlray.config.judge import JudgeConfig, JudgeParseConfig  # noqa: F401
from rlray.config.loading import (  # noqa: F401
    apply_overrides,
    config_from_dict,
    load_config,
    normalized_tree,
    resume_tree,
    validate_tree,
    validation_error_lines,
)
from rlray.config.operations import (  # noqa: F401
    BandConfig,
    CheckpointConfig,
    GuardConfig,
    MonitorConfig,
    S3Config,
    monitor_defaults,
)
from rlray.config.resources import (  # noqa: F401
    JudgeResources,
    LearnerResources,
    ReferenceResources,
    ResourcesConfig,
    RewardResources,
    RolloutResources,
    TeacherResources,
)
from rlray.config.reward import RewardConfig, RewardFunctionConfig, RewardServerConfig  # noqa: F401
from rlray.config.run import DataConfig, EvalConfig, LoraConfig, ModelConfig, RolloutConfig, RunConfig, TrackingConfig  # noqa: F401
from rlray.config.schema import Config  # noqa: F401
from rlray.config.teacher import TeacherConfig  # noqa: F401

__all__ = [
    "ConfigError",
    "CoreList",
    "RunConfig",
    "LoraConfig",
    "ModelConfig",
    "DataConfig",
    "RolloutConfig",
    "EvalConfig",
    "TrackingConfig",
    "RewardFunctionConfig",
    "RewardServerConfig",
    "RewardConfig",
    "JudgeConfig",
    "JudgeParseConfig",
    "AlgoConfig",
    "CriticConfig",
    "OfflineConfig",
    "LearnerConfig",
    "S3Config",
    "CheckpointConfig",
    "GuardConfig",
    "BandConfig",
    "MonitorConfig",
    "RolloutResources",
    "LearnerResources",
    "RewardResources",
    "JudgeResources",
    "ReferenceResources",
    "TeacherResources",
    "TeacherConfig",
    "ResourcesConfig",
    "Config",
    "flatten",
    "apply_overrides",
    "config_from_dict",
    "validate_tree",
    "validation_error_lines",
    "load_config",
    "normalized_tree",
    "resume_tree",
    "monitor_defaults",
]
