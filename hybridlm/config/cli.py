"""Flags and YAML -> RunConfig, and the flag table for the README.

Every flag is a dataclass field; its name is the field's name with dashes (Megatron's
spelling) and its help text is the field's ``help`` metadata.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from typing import Any, Optional, get_type_hints

from ..presets import MODELS, SHAPE_FLAGS
from . import megatron
from .fields import ConfigError
from .model import ModelConfig
from .run import SECTIONS, RunConfig
from .sections import DataConfig, ParallelConfig, PostTrainConfig, TrainConfig


def _cli_fields():
    for section, cls in SECTIONS:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli", True):
                yield section, f, hints[f.name]


def _base_type(hint):
    args = getattr(hint, "__args__", None)
    return next(a for a in args if a is not type(None)) if args else hint


class OneLineErrors(argparse.ArgumentParser):
    """argparse, but a mistyped flag or value is answered by its one error line and where the flags are
    listed, not by the usage of every flag; and once: each rank of a launch parses the same command
    line before any process group exists, so only the launch's rank 0 (from the environment) says it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse reads "-1e-3" as an option (its negative numbers have no exponent): --lr -1e-3 would end in
        # "expected one argument" instead of the flag's own check
        self._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.?\d+(?:[eE][-+]?\d+)?$")

    def error(self, message: str):
        if rank_from_env() != 0:
            self.exit(2)
        if message.startswith("unrecognized arguments:"):
            import difflib
            typos = [w.split("=")[0] for w in message.split(":", 1)[1].split() if w.startswith("--")]
            near = [m for w in typos for m in difflib.get_close_matches(w, list(self._option_string_actions), n=1)]
            message += f" (did you mean {' / '.join(near)}?)" if near else ""
        self.exit(2, f"error: {message}\n{self.prog} --help lists every flag.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(description="Train a GPT with tensor/sequence/pipeline/data parallelism on DeepSpeed.",
                           allow_abbrev=False)
    for section, f, hint in _cli_fields():
        flag = "--" + f.name.replace("_", "-")
        typ = _base_type(hint)
        kw: dict[str, Any] = dict(dest=f.name, help=f.metadata["help"].replace("%", "%%"), default=argparse.SUPPRESS)
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif f.metadata["nargs"]:
            kw["nargs"], kw["type"] = f.metadata["nargs"], str
        else:
            kw["type"] = typ
            if f.metadata["choices"]:
                kw["choices"] = megatron.value_choices(f.name, f.metadata["choices"])
        parser.add_argument(flag, *f.metadata["aliases"], **kw)
    megatron.add_to_parser(parser)  # Megatron-LM's other flags: aliases, ignored, refused
    parser.add_argument("--config", default=None, metavar="RUN.yaml",
                        help="YAML file with the same keys as the flags (dashes or underscores); flags win over it.")
    # Megatron-DeepSpeed scripts pass --deepspeed; DeepSpeed is always on here.
    parser.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    # The deepspeed launcher appends --local_rank; the rank is read from the environment instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: Optional[list[str]] = None, base: Optional[dict] = None) -> RunConfig:
    """Flags (over ``--config`` YAML, over ``base`` settings) -> RunConfig. Unknown or malformed flags
    end in argparse's one-line error (exit 2); a bad YAML file in a ConfigError naming it."""
    ns = vars(build_parser().parse_args(argv))
    ns.pop("local_rank", None)
    ns.pop("deepspeed", None)
    path = ns.pop("config", None)
    given = {**(load_yaml(path) if path else {}), **ns}
    values = {**(base or {}), **given}
    typed = frozenset(values)
    preset = given.get("model")  # a base (a checkpoint's settings) holds its preset already applied: not again
    if preset is None and not any(name in values for name in SHAPE_FLAGS):
        preset = values["model"] = "tiny"  # a run that names no model is the built-in one (presets.py)
    if preset is not None:  # the preset under the base under the run file under the flags
        values = {**_preset_values(preset), **values}
    notes = megatron.translate(values)
    cfg = config_from_dict(values)
    cfg.notes.extend(notes)
    cfg.typed = typed
    return cfg


def _preset_values(name: str) -> dict:
    """A preset's flags parsed as the user's would be."""
    if name not in MODELS:
        raise ConfigError(f"--model {name}: unknown preset; the presets are {', '.join(MODELS)}.")
    values = vars(build_parser().parse_args(MODELS[name]))
    for launcher_only in ("config", "local_rank", "deepspeed"):
        values.pop(launcher_only, None)
    return values


def _cli_types() -> dict[str, type]:
    return {f.name: _base_type(hint) for _, f, hint in _cli_fields()}


def load_yaml(path: str) -> dict:
    """A run file: {flag name (dashes or underscores): value}, each value checked against the flag's type."""
    import yaml
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file.")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"--config {path}: invalid YAML{where}: {getattr(e, 'problem', e)}.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of flag names to values.")
    types, values = _cli_types(), {}
    for key, value in raw.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name not in types:
            raise ConfigError(f"--config {path}: unknown setting '{key}'.")
        typ = types[name]
        if typ is list and isinstance(value, str):
            value = value.split()
        if value is not None and not isinstance(value, typ) and not (typ is float and isinstance(value, int)):
            try:
                value = typ(value) if typ is not bool else {"true": True, "false": False}[str(value).lower()]
            except (ValueError, KeyError):
                kind = {int: "an integer", float: "a number", bool: "true or false"}.get(typ, "a string")
                raise ConfigError(f"--config {path}: '{key}' should be {kind}, got {value!r}.") from None
        values[name] = value
    return values


def effective_yaml(cfg: RunConfig) -> str:
    """The run's settings as a --config file that reproduces it: every value it used, except those validate
    resolved from the others (``RunConfig.given_values``: the decay length, the global batch, the iterations of
    --train-samples), which keep what was given, or are left out when nothing was, so that a run reusing the
    file derives them again from its own flags."""
    import yaml
    flat = {}
    for section, f, _ in _cli_fields():
        value = getattr(getattr(cfg, section), f.name)
        if f.name in cfg.given_values:
            value = cfg.given_values[f.name]
            if value == f.default:
                continue
        flat[f.name.replace("_", "-")] = value
    return yaml.safe_dump(flat, sort_keys=False)


def config_from_dict(values: dict) -> RunConfig:
    """Flat {field: value} (as the flags give) -> RunConfig; missing fields keep their defaults."""
    by_section: dict[str, dict] = {s: {} for s, _ in SECTIONS}
    known = {}
    for section, cls in SECTIONS:
        for f in dataclasses.fields(cls):
            known[f.name] = section
    for k, v in values.items():
        if k not in known:
            raise ConfigError(f"unknown setting '{k}'.")
        by_section[known[k]][k] = v
    return RunConfig(model=ModelConfig(**by_section["model"]), parallel=ParallelConfig(**by_section["parallel"]),
                     train=TrainConfig(**by_section["train"]), data=DataConfig(**by_section["data"]),
                     posttrain=PostTrainConfig(**by_section["posttrain"]), explicit=frozenset(values))


def rank_from_env() -> int:
    """This process's rank as the launcher announced it (torchrun/deepspeed: RANK; mpirun: OMPI/PMI; srun), else 0."""
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def world_size_from_env() -> int:
    """The world size the launcher announced (torchrun/deepspeed: WORLD_SIZE; mpirun: OMPI/PMI), else 1."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1



def flags_markdown() -> str:
    """The README's flag table, generated from the dataclasses."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for _, f, hint in _cli_fields():
        flag = "--" + f.name.replace("_", "-")
        if _base_type(hint) is bool:
            flag += " / --no-" + f.name.replace("_", "-")
        choices = f" ({' / '.join(map(str, f.metadata['choices']))})" if f.metadata["choices"] else ""
        aliases = "".join(f" / `{a}`" for a in f.metadata["aliases"])
        rows.append(f"| `{flag}`{aliases} | `{f.default}` | {f.metadata['help']}{choices} |")
    return "\n".join(rows)

