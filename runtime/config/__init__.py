"""The one typed configuration of moesys: dataclass schemas, each checking its own fields, and the cross-section rules.

The CLI composes these with Hydra; torchrun workers rebuild them from the run directory's config.yaml with
`config_from_dict`, so workers never import Hydra or OmegaConf. A key with a fixed set of values is typed
`Annotated[str, Literal[...]]`: OmegaConf 2.3 rejects a bare Literal, and reads the Annotated one as str.
"""

from runtime.config.checks import BOUND_TESTS, ConfigError, ConfigSection, Problems, choices
from runtime.config.plain import config_from_dict, config_to_dict
from runtime.config.rules import BYTE_VOCAB, CROSS_SECTION_RULES, packages_installed, resolve_auto, validate
from runtime.config.schema import (
                                   DistillConfig,
                                   ExportConfig,
                                   InferConfig,
                                   LauncherConfig,
                                   ModelConfig,
                                   MoesysConfig,
                                   ParallelConfig,
                                   ServeConfig,
                                   StorageConfig,
                                   StudentConfig,
                                   TaskConfig,
                                   TopologyConfig,
                                   TrainConfig,
                                   resume_step,
)

__all__ = [
    "BOUND_TESTS", "BYTE_VOCAB", "CROSS_SECTION_RULES", "ConfigError", "ConfigSection", "DistillConfig", "ExportConfig",
    "InferConfig", "LauncherConfig", "ModelConfig", "MoesysConfig", "ParallelConfig", "Problems", "ServeConfig",
    "StorageConfig", "StudentConfig", "TaskConfig", "TopologyConfig", "TrainConfig", "choices", "config_from_dict",
    "config_to_dict", "packages_installed", "resolve_auto", "resume_step", "validate",
]
