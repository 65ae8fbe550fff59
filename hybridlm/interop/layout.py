"""What a checkpoint folder is: how it was laid out, which model it holds, and how to read its files.

Each ``global_step<N>`` folder that ``hybridlm.training.checkpoint.save`` writes carries, beside
DeepSpeed's files, ``config.yaml`` (the run's settings, usable as ``--config``) and
``hybridlm_checkpoint.json`` (the layout it was saved at, whether it holds optimizer state, and
whether expert weights have files of their own). Folders saved before those files existed are
read from the run directory's ``config.yaml`` and DeepSpeed's own metadata instead.

Parameter names are the same at every TP/PP/EP, so a model built on the ``meta`` device at any
layout (``parameter_table``) says, without any data or process group, each parameter's full
shape and how TP and EP split it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch

from ..config import ConfigError, ModelConfig, RunConfig, effective_yaml, load_yaml

INFO_FILE = "hybridlm_checkpoint.json"
# Model settings that choose kernels, not parameters.
PORTABLE_KERNELS = {"attention_backend": "sdpa", "transformer_impl": "local", "fp8_format": None, "fused_ops": "none",
                    "require_fused_ops": False, "torch_compile": False, "torch_compile_backend": "inductor"}
CONFIG_FILE = "config.yaml"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Layout:
    """How the ranks that saved (or will load) a checkpoint were arranged."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    zero_stage: int = 0
    bf16: bool = False
    fp16: bool = False

    @classmethod
    def of_run(cls, cfg: RunConfig) -> "Layout":
        p, t = cfg.parallel, cfg.train
        return cls(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, dp=p.data_parallel_size,
                   ep=p.expert_model_parallel_size, cp=p.context_parallel_size, zero_stage=p.zero_stage, bf16=t.bf16, fp16=t.fp16)

    @property
    def data_ranks(self) -> int:
        """DeepSpeed's data-parallel size, which numbers its ZeRO files: DP x CP (CP ranks are
        data-parallel replicas to it, hybridlm.parallel.state)."""
        return self.dp * self.cp

    def mp_rank(self, pp_rank: int, tp_rank: int) -> int:
        """DeepSpeed's model-parallel rank (the ``mp_rank_XX`` in file names): stage-major, TP inside."""
        return pp_rank * self.tp + tp_rank

    def expert_file(self, tag_dir: str, pp_rank: int, tp_rank: int, ep_rank: int) -> str:
        """Our file of one (stage, TP rank, EP rank)'s expert weights (DeepSpeed keeps only EP rank 0's)."""
        return os.path.join(tag_dir, f"experts_ep_rank_{ep_rank:02d}_mp_rank_{self.mp_rank(pp_rank, tp_rank):02d}.pt")

    def describe(self) -> str:
        precision = "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"
        cp = f" CP={self.cp}" if self.cp > 1 else ""
        return f"TP={self.tp} PP={self.pp} DP={self.dp}{cp} EP={self.ep} ZeRO-{self.zero_stage} {precision}"


@dataclass
class CheckpointInfo:
    tag_dir: str
    layout: Layout
    settings: dict  # the saving run's flags, as in its config.yaml
    iteration: int
    optimizer_state: bool  # False: weights only (an import, or a folder written without an optimizer)
    expert_files: bool  # expert weights in experts_*.pt, one file per (stage, TP rank, EP rank)
    tokenizer_known: bool = True  # False: imported without tokenizer files, so the settings' tokenizer is a placeholder
    quantized_base: Optional[dict] = None  # QLoRA: {"checkpoint": the base's folder, "fingerprint": its files'} (not stored here)

    def model_config(self, tp: Optional[int] = None) -> ModelConfig:
        """The saved model, its vocabulary padded for ``tp`` (default: the saved TP), with the
        training run's kernel choices (attention backend, Transformer Engine, FP8, fused ops,
        compile) reset to the portable PyTorch ones: they change no parameter, and a checkpoint
        trained with flash-attn must still convert on a machine without it."""
        names = {f.name for f in fields(ModelConfig)}
        settings = {k: v for k, v in self.settings.items() if k in names and k != "padded_vocab_size"}
        settings.update({k: v for k, v in PORTABLE_KERNELS.items() if k in names})
        if "group_query_attention" not in settings:  # written before --num-query-groups needed --group-query-attention
            settings["group_query_attention"] = settings.get("num_query_groups") not in (None, settings.get("num_attention_heads"))
        cfg = ModelConfig(**settings)
        if cfg.vocab_size is None:
            raise ConfigError(f"{os.path.join(self.tag_dir, CONFIG_FILE)} has no vocab-size; it was not written by a training run.")
        cfg.padded_vocab_size = cfg.pad_vocab(tp or self.layout.tp)
        cfg.params_dtype = "bf16" if self.layout.bf16 else "fp16" if self.layout.fp16 else "fp32"
        return cfg


def write_info(tag_dir: str, cfg: RunConfig, iteration: int, *, optimizer_state: bool = True,
               expert_files: bool = False) -> None:
    """Write config.yaml and hybridlm_checkpoint.json into ``tag_dir`` (each by rename: never half-written).
    A QLoRA run's checkpoint names the checkpoint its 4-bit base was quantized from (``--load``'s)."""
    info = {"format_version": FORMAT_VERSION, "iteration": iteration, "layout": asdict(Layout.of_run(cfg)),
            "optimizer_state": optimizer_state, "expert_files": expert_files}
    if cfg.train.base_checkpoint:
        info["quantized_base"] = {"checkpoint": cfg.train.base_checkpoint, "fingerprint": fingerprint(cfg.train.base_checkpoint)}
    atomic_write_text(os.path.join(tag_dir, CONFIG_FILE), effective_yaml(cfg))
    atomic_write_text(os.path.join(tag_dir, INFO_FILE), json.dumps(info, indent=2) + "\n")


def fingerprint(tag_dir: str, sample: int = 1 << 20) -> str:
    """A cheap identity of a checkpoint folder's contents: each file's name, size, first and last MiB.
    A QLoRA checkpoint records its base's, so that a resume or an export refuses a base that changed
    (another model imported into the same path) instead of quantizing the wrong weights."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(tag_dir)):
        path = os.path.join(tag_dir, name)
        if not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        digest.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            digest.update(f.read(sample))
            if size > sample:
                f.seek(max(sample, size - sample))
                digest.update(f.read(sample))
    return digest.hexdigest()[:32]


@contextlib.contextmanager
def staged_folder(output: str):
    """A folder that becomes ``output`` only when the block completes: its files are written into a hidden
    sibling that is moved into place at once, so a failed or interrupted export never leaves a half-written
    ``output`` (which the caller has checked is absent or empty)."""
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(os.path.abspath(output))}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        yield staging
        if os.path.isdir(output):
            os.rmdir(output)  # empty, checked by the caller
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj, path: str) -> None:
    """``torch.save`` to a temporary name, then a rename: a reader never sees a half-written file."""
    tmp = f"{path}.tmp"
    try:
        torch.save(obj, tmp)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def resolve_tag_dir(path: str, flag: str = "--checkpoint") -> str:
    """A ``global_step<N>`` folder as given, or a run directory's ``latest`` one."""
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: no such directory.")
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        tag_dir = os.path.join(path, tag)
        if not os.path.isdir(tag_dir):
            raise ConfigError(f"{flag} {path}: 'latest' names {tag}, which does not exist.")
        return tag_dir
    return path


def read_info(tag_dir: str, flag: str = "--checkpoint") -> CheckpointInfo:
    """The layout and settings of a checkpoint folder; ConfigError (one sentence) if it is not one."""
    info_path = os.path.join(tag_dir, INFO_FILE)
    if os.path.isfile(info_path):
        try:
            with open(info_path) as f:
                raw = json.load(f)
            layout = Layout(**raw["layout"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{flag} {tag_dir}: {INFO_FILE} is malformed ({e}).") from None
        settings = _settings(os.path.join(tag_dir, CONFIG_FILE), flag)
        return CheckpointInfo(tag_dir, layout, settings, int(raw["iteration"]), bool(raw["optimizer_state"]),
                              bool(raw.get("expert_files", False)), bool(raw.get("tokenizer", True)), raw.get("quantized_base"))
    return _read_legacy_info(tag_dir, flag)


def _settings(path: str, flag: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"{flag}: {path} is missing; it holds the model's settings.")
    return load_yaml(path)


def _read_legacy_info(tag_dir: str, flag: str) -> CheckpointInfo:
    """A folder saved before hybridlm_checkpoint.json existed: DeepSpeed's metadata + the run's config.yaml."""
    first = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    if not os.path.isfile(first):
        zero3 = os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt")
        if not os.path.isfile(zero3):
            raise ConfigError(f"{flag} {tag_dir}: not a hybridlm checkpoint folder (no {INFO_FILE}, no DeepSpeed model states).")
        first = zero3
    states = load_file(first)
    settings = _settings(os.path.join(os.path.dirname(os.path.abspath(tag_dir)), CONFIG_FILE), flag)
    dims = states.get("checkpoint_parallel_dimensions") or {}
    ds = states.get("ds_config") or {}
    layout = Layout(tp=int(dims.get("tp_degree", settings.get("tensor_model_parallel_size", 1))),
                    pp=int(dims.get("pp_degree", settings.get("pipeline_model_parallel_size", 1))),
                    dp=int(states["dp_world_size"]), ep=int(settings.get("expert_model_parallel_size", 1)),
                    zero_stage=int((ds.get("zero_optimization") or {}).get("stage", 0)),
                    bf16=bool((ds.get("bf16") or {}).get("enabled")), fp16=bool((ds.get("fp16") or {}).get("enabled")))
    if layout.ep > 1:
        raise ConfigError(f"{flag} {tag_dir}: saved with expert parallelism before expert weights were saved per EP rank; "
                          "its experts are incomplete and cannot be read.")
    return CheckpointInfo(tag_dir, layout, settings, int(states.get("iteration", states.get("global_steps", 0))),
                          optimizer_state=True, expert_files=False)


# ---------------------------------------------------------------- files

def _deepspeed_safe_globals() -> list:
    """The only non-tensor classes DeepSpeed's checkpoint files hold (loss scaler, ZeRO stage, slice addresses)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


def load_file(path: str, *, mmap: bool = True):
    """``torch.load(weights_only=True)`` of a checkpoint file, memory-mapped so that reading one
    tensor does not read the whole file; DeepSpeed's three bookkeeping classes are allowed by name."""
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing from the checkpoint.") from None
    except Exception as e:  # noqa: BLE001 - a pickle with foreign objects, a truncated or non-torch file
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: not a readable checkpoint file ({first}).") from None


# ---------------------------------------------------------------- the model without data

@dataclass(frozen=True)
class ParamInfo:
    name: str
    local_shape: tuple
    full_shape: tuple
    tp_sharding: object  # hybridlm.parallel.tensor_parallel.Sharding or None
    ep_sharding: object

    @property
    def is_expert(self) -> bool:
        return self.ep_sharding is not None


def parameter_table(cfg: ModelConfig, tp: int, ep: int = 1) -> dict[str, ParamInfo]:
    """Every parameter of the model at TP=tp, EP=ep: built on the meta device (no memory, no
    process group), in the order a single-stage model registers them."""
    from ..model.specs import build_model
    from ..parallel.plan import LayerFactory, ModelGroups
    from ..parallel.state import GroupHandle

    # a 4-bit base (QLoRA) holds the same weights, under the same names, as the dense model it was quantized from
    portable = dataclasses.replace(cfg, **{k: v for k, v in PORTABLE_KERNELS.items() if hasattr(cfg, k)}, quant_bits=None)
    model = build_model(portable, LayerFactory(ModelGroups(tp=GroupHandle(None, 0, tp), ep=GroupHandle(None, 0, ep)), device="meta"))
    table = {}
    for name, param in model.named_parameters():
        tp_sharding, ep_sharding = getattr(param, "tp_sharding", None), getattr(param, "ep_sharding", None)
        full = tuple(param.shape)
        for sharding, size in ((tp_sharding, tp), (ep_sharding, ep)):
            if sharding is not None:
                full = sharding.full_shape(full, size)
        table[name] = ParamInfo(name, tuple(param.shape), full, tp_sharding, ep_sharding)
    return table


def vocab_parameters(cfg: ModelConfig) -> set[str]:
    """Names of the tensors whose rows are the (TP-padded) vocabulary."""
    tied = not cfg.untie_embeddings_and_output_weights
    names = {"tied_modules.embed.word_embeddings.weight" if tied else "0.word_embeddings.weight"}
    if not tied:
        names.add(f"{cfg.num_layers + 2}.linear.weight")
    return names
