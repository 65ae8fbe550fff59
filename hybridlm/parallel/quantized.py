"""QLoRA's frozen base: the block linears' weights held in 4 bits (NF4 or FP4) under the LoRA adapters.

With ``--quant-bits 4`` every transformer layer's QKV, output projection, fc1 and fc2 (the linears
LoRA wraps, ``hybridlm.parallel.lora``; not the embedding, norms or output layer, which
transformers' BitsAndBytesConfig leaves unquantized too) keeps a ``QuantizedWeight`` where its
dense weight was. It is quantized once, when the weight gets its value (the seed's initialisation
or ``--load``), is never trained and is no parameter: DeepSpeed, the optimizer and checkpoints see
only the adapters and the other frozen parameters. A matmul dequantizes it to the run's precision
(bf16) in forward and again in backward (``_Frozen4bitLinear``), so no dense copy of the base stays
in memory and none is saved for backward.

The quantizer is bitsandbytes' (``quantize_4bit``/``dequantize_4bit``), chosen over torchao's
NF4Tensor because it is what PEFT, TRL and ms-swift run (so "the same quantized base" as a PEFT
QLoRA model is the same bits, not a look-alike), it has both NF4 and FP4 and double quantization
as an option (torchao's NF4 has one type, always double-quantized), and it runs on CPU too (0.50.2 tested),
where the correctness tests run. Its block is 64 weights (``QUANT_BLOCK``) and, with double
quantization, the blocks' scales are quantized again to 8 bits in blocks of 256 around their mean.

**The same bits at every layout.** Each weight is quantized as Hugging Face holds it: the fused
QKV as q, k and v, SwiGLU's fc1 as gate and up, each whole (``part_rows``), so a PEFT model on
the same checkpoint holds exactly these bits. Under TP every rank quantizes the full part and keeps
its slice: rows of a column-parallel weight, columns of a row-parallel one, cut on block
boundaries (the config refuses a TP whose slices would cut a block). The slice's scales are kept
dequantized (fp32) at TP > 1, since double quantization's second level spans slices; that costs
the 0.37 bits a weight double quantization saves, but every layout (and a resume at another TP)
computes with the same dequantized base as one process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from ..config.model import QUANT_BLOCK
from .lora import TARGET_MODULES
from .state import GroupHandle
from .tensor_parallel import rows_linear

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # the flags' dtype names (also export's, the optimizer's)


@dataclass(frozen=True)
class QuantSpec:
    """How the base is quantized: ``quant_type`` nf4 or fp4, ``double_quant``, and ``dtype``, the run's
    precision, which the weights are quantized from and dequantized to (transformers quantizes a model
    loaded in its torch_dtype; bnb_4bit_compute_dtype)."""
    quant_type: str
    double_quant: bool
    dtype: torch.dtype

    @classmethod
    def of(cls, cfg) -> "QuantSpec":
        return cls(cfg.quant_type, cfg.double_quant, DTYPES[cfg.params_dtype])

    def describe(self) -> str:
        return f"4-bit {self.quant_type}{' with double quantization' if self.double_quant else ''}, computing in " \
               f"{next(k for k, v in DTYPES.items() if v == self.dtype)}"


def _bnb():
    import bitsandbytes.functional as bnb_functional
    return bnb_functional


def quantize(part: torch.Tensor, spec: QuantSpec):
    """bitsandbytes' 4-bit quantization of one whole weight (in the run's precision): (packed, QuantState)."""
    return _bnb().quantize_4bit(part.to(spec.dtype).contiguous(), blocksize=QUANT_BLOCK,
                                compress_statistics=spec.double_quant, quant_type=spec.quant_type)


def dequantize(packed: torch.Tensor, state, out: torch.Tensor | None = None) -> torch.Tensor:
    return _bnb().dequantize_4bit(packed, state, out=out)


def roundtrip(full: torch.Tensor, part_rows: Sequence[int], spec: QuantSpec) -> torch.Tensor:
    """What a quantized base computes with, for a full dense weight: each part quantized and
    dequantized (the export's merge and the tests' oracle)."""
    return torch.cat([dequantize(*quantize(part, spec)) for part in torch.split(full, list(part_rows), dim=0)])


def part_rows(sharding, shape) -> tuple[int, ...]:
    """The rows of each weight a linear's full weight stacks, as Hugging Face holds them (q, k, v; gate,
    up): a column-parallel weight's blocks; a row-parallel weight is one."""
    return tuple(sharding.blocks) if sharding.dim == 0 else (shape[0],)


def _plain_absmax(state) -> torch.Tensor:
    """A QuantState's per-block scales as fp32, the second level of double quantization undone as
    ``dequantize_4bit`` undoes it."""
    if not state.nested:
        return state.absmax.float()
    absmax = _bnb().dequantize_blockwise(state.absmax, state.state2)
    absmax += state.offset
    return absmax.float()


class QuantizedWeight:
    """This rank's slice of one linear's frozen 4-bit weight. It stands where the dense weight was and
    answers what initialisation, loading and the adapters ask of a weight (``shape``, ``dtype``,
    ``device``, ``tp_sharding``, the initialisation rule); ``assign(full)`` quantizes a full value,
    ``dequantize()`` gives this rank's dense slice back."""

    requires_grad = False

    def __init__(self, dense: nn.Parameter, tp: GroupHandle, spec: QuantSpec):
        # dtype: what the dense weight was made in (the adapters beside it are made alike); its values are spec.dtype's
        self.shape, self.device, self.dtype = dense.shape, dense.device, dense.dtype
        self.tp_sharding = dense.tp_sharding
        for key in ("init_std", "init_bound", "init_value"):
            setattr(self, key, getattr(dense, key, None))
        self.tp, self.spec = tp, spec
        self.column = self.tp_sharding.dim == 0
        self.part_rows = part_rows(self.tp_sharding, self.shape)
        self.parts: list = []  # (packed 4-bit values, bitsandbytes QuantState) per part, this rank's slice

    @torch.no_grad()
    def assign(self, full: torch.Tensor) -> None:
        """Quantize the full (single-process) weight part by part and keep this rank's slice."""
        full = full.to(self.device)
        parts = [quantize(part, self.spec) for part in torch.split(full, list(self.part_rows), dim=0)]
        self.parts = parts if self.tp.size == 1 else [self._slice(packed, state) for packed, state in parts]

    def _slice(self, packed: torch.Tensor, state):
        """This rank's rows (column-parallel) or columns (row-parallel) of a quantized part: the packed
        values (two a byte, row-major) and the block scales (one per QUANT_BLOCK values) cut alike."""
        from bitsandbytes.functional import QuantState
        rows, cols = state.shape
        absmax, rank, size = _plain_absmax(state), self.tp.rank, self.tp.size
        if self.column:
            per_rank = rows // size
            start, stop = rank * per_rank, (rank + 1) * per_rank
            values = packed.view(-1)[start * cols // 2: stop * cols // 2]
            scales = absmax[start * cols // QUANT_BLOCK: stop * cols // QUANT_BLOCK]
            shape = (per_rank, cols)
        else:
            per_rank = cols // size
            start, stop = rank * per_rank, (rank + 1) * per_rank
            values = packed.view(rows, cols // 2)[:, start // 2: stop // 2]
            scales = absmax.view(rows, cols // QUANT_BLOCK)[:, start // QUANT_BLOCK: stop // QUANT_BLOCK]
            shape = (rows, per_rank)
        sliced = QuantState(absmax=scales.contiguous().view(-1), shape=torch.Size(shape), dtype=state.dtype,
                            blocksize=state.blocksize, code=state.code, quant_type=state.quant_type)
        return values.contiguous().view(-1, 1), sliced

    def dequantize(self) -> torch.Tensor:
        """This rank's dense slice, in the run's precision."""
        if not self.parts:
            raise RuntimeError("a 4-bit base weight was used before it was given a value (initialisation or --load)")
        if len(self.parts) == 1:
            return dequantize(*self.parts[0])
        if self.device.type != "cuda":  # bitsandbytes' CPU kernel has no out= variant
            return torch.cat([dequantize(packed, state) for packed, state in self.parts])
        out = torch.empty(self.shape, device=self.device, dtype=self.spec.dtype)
        row = 0
        for packed, state in self.parts:  # each part straight into its rows: no concatenation copy
            dequantize(packed, state, out=out[row: row + state.shape[0]])
            row += state.shape[0]
        return out

    def numel(self) -> int:
        return self.shape.numel()

    def nbytes(self) -> int:
        """Bytes held: the packed values and the scales (with double quantization, their second level)."""
        total = 0
        for packed, state in self.parts:
            total += packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
            if state.nested:
                total += state.state2.absmax.numel() * state.state2.absmax.element_size()
        return total


class _Frozen4bitLinear(torch.autograd.Function):
    """x W^T (+ b) with W dequantized on the fly, in forward and again in backward: nothing is saved
    for backward (W gets no gradient, so x is not needed), and the dense W lives for one GEMM.

    Both products run on the rows laid flat (``tensor_parallel.rows_linear``, which says why): a
    batched matmul there took half of a compiled, recomputed 7B QLoRA step (benchmarks/PROFILES.md)."""

    @staticmethod
    def forward(ctx, x, weight: QuantizedWeight, bias):
        ctx.weight = weight
        return rows_linear(x, weight.dequantize().to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        return rows_linear(grad, ctx.weight.dequantize().to(grad.dtype).t()), None, None


class Frozen4bitMatmul:
    """A linear's rank-local GEMM on its 4-bit weight (``local_matmul`` of the TP linears): the TP
    crossings around it and the LoRA term beside it stay the linear's."""

    def __init__(self, weight: QuantizedWeight, bias: nn.Parameter | None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _Frozen4bitLinear.apply(x, self.weight, self.bias)


def quantize_linear(linear: nn.Module, spec: QuantSpec, tp: GroupHandle) -> QuantizedWeight:
    """Replace ``linear``'s dense weight parameter by a (not yet assigned) QuantizedWeight and its GEMM
    by the 4-bit one. A bias (Qwen2's QKV bias) stays a frozen parameter: added inside the GEMM of a
    column-parallel linear, after the TP sum of a row-parallel one (which adds it itself)."""
    weight = QuantizedWeight(linear.weight, tp, spec)
    del linear.weight  # unregisters the parameter and frees its memory
    linear.weight = weight
    linear.local_matmul = Frozen4bitMatmul(weight, linear.bias if weight.column else None)
    return weight


def quantize_block_linears(layer: nn.Module, spec: QuantSpec, tp: GroupHandle) -> None:
    """Give a freshly built transformer layer its 4-bit linears (before the next layer is built, so that at
    most one layer's dense weights ever exist)."""
    for path in TARGET_MODULES.values():
        quantize_linear(layer.get_submodule(".".join(path)), spec, tp)


def quantized_weights(model: nn.Module) -> Iterator[tuple[str, QuantizedWeight]]:
    """(name, weight) of every 4-bit weight in ``model``, named as the dense parameter was (``3.attention.qkv.weight``)."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "weight", None), QuantizedWeight):
            yield f"{name}.weight", module.weight


def is_quantized_name(name: str) -> bool:
    """Whether a (layout-independent) parameter name is one a 4-bit base holds quantized."""
    return name.endswith(tuple(f".{'.'.join(path)}.weight" for path in TARGET_MODULES.values()))


@torch.no_grad()
def load_quantized(model: nn.Module, weight_of) -> int:
    """Quantize each 4-bit weight of ``model`` from ``weight_of(name)``, its full dense value (a
    checkpoint reader's); returns how many."""
    count = 0
    for name, weight in quantized_weights(model):
        weight.assign(weight_of(name))
        count += 1
    return count


def describe_base(model: nn.Module) -> str:
    """The log's words for this rank's 4-bit base."""
    weights = [w for _, w in quantized_weights(model)]
    if not weights:
        return ""
    numel, held = sum(w.numel() for w in weights), sum(w.nbytes() for w in weights)
    return (f"; its block linears' {numel:,} weights are held {weights[0].spec.describe()}: {held / 2**30:.2f} GiB "
            f"({8 * held / max(numel, 1):.2f} bits a weight)")
