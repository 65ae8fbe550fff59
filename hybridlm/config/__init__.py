"""The run's configuration: typed dataclasses, filled once from the command line.

Config flows one way: flags (over a ``--config`` YAML, over a ``--model`` preset) -> ``RunConfig``
-> constructors. Every flag is a dataclass field; the argparse parser, the YAML loader and the
README's flag table (``python -m hybridlm.config --markdown``) are generated from the fields,
so code, CLI and docs cannot drift.

    fields.py    the field helper and ConfigError
    model.py     ModelConfig
    sections.py  ParallelConfig, TrainConfig, DataConfig, PostTrainConfig
    run.py       RunConfig and its cross-checks (``validate``), before any process group
    cli.py       flags/YAML -> RunConfig, the effective YAML, the flag table
"""
from .cli import (build_parser, config_from_dict, effective_yaml, flags_markdown, load_yaml, parse_args, rank_from_env,
                  world_size_from_env)
from .fields import ConfigError
from .model import FUSED_OPS, ModelConfig
from .run import RunConfig
from .sections import DataConfig, ParallelConfig, PostTrainConfig, TrainConfig, pipeline_stage_layers

__all__ = ["ConfigError", "DataConfig", "FUSED_OPS", "ModelConfig", "ParallelConfig", "PostTrainConfig", "RunConfig", "TrainConfig",
           "pipeline_stage_layers", "build_parser", "config_from_dict", "effective_yaml", "flags_markdown", "load_yaml", "parse_args",
           "rank_from_env", "world_size_from_env"]
