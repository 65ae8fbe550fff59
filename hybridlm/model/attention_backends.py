"""Causal attention kernels behind one signature, chosen once per run.

A core takes q [s, b, heads, d] and k, v [s, b, groups, d] (grouped-query attention: heads
is a multiple of groups; the layout the QKV projection produces, so no backend forces a
copy on the others) and returns [s, b, heads, d]. With ``position_ids`` [b, s] (packed
samples: positions restart at 0 where a sample begins) no query sees another sample's keys.

  sdpa   torch's scaled_dot_product_attention, whichever kernel torch picks (CPU: math);
         packed rows on a GPU in half precision: torch's variable-length flash kernel
  cudnn  the same call pinned to cuDNN's fused attention (Hopper: ~1.8x torch's default
         flash kernel on fwd+bwd at B4 H16 S4096 D128)
  flash  flash-attn: the 2.x ``flash_attn_func`` or flash-attn-4's CuTe kernels (SDPA in fp32,
         as cudnn)
  te     Transformer Engine's DotProductAttention (takes the [s, b, h, d] layout as is)

``auto`` picks flash-attn when importable, else cuDNN on a Hopper-or-newer GPU, else sdpa; an fp32
run takes sdpa (cuDNN's and flash-attn's kernels are half precision only). Every choice is checked
before the process group exists (``resolve_backend``) so a missing package, or a half-precision
kernel asked of an fp32 run, is one sentence, not a stack trace from inside the first forward.

No kernel is substituted at run time: a core or block kernel resolved for bf16 on a GPU raises
if it is handed anything else, instead of quietly running the fp32 definition. The fp32 PyTorch
definition (``math``) is chosen by name, at start-up, where it is what runs (CPUs, fp32 runs), and
the run's log says so.
"""
from __future__ import annotations

import importlib.util
from typing import Callable, Optional

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa", "cudnn", "flash", "te")


def _to_bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.permute(1, 2, 0, 3)


HALF = (torch.float16, torch.bfloat16)


def require_half_precision_cuda(kernel: str, t: torch.Tensor) -> None:
    """A half-precision GPU kernel was handed something else: the run resolved the wrong kernel (a bug),
    and running the fp32 definition instead would hide it (and change the arithmetic the run reports)."""
    if t.device.type != "cuda" or t.dtype not in HALF:
        raise RuntimeError(f"{kernel} runs on CUDA tensors in bf16 or fp16 and was given {t.dtype} on {t.device}; "
                           "the attention kernels are resolved once at start-up (resolve_backend, block_kernel_name), "
                           "so this input should not have reached it.")


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] True where query i may attend key j: j <= i within the same sample, a sample
    beginning wherever its position id is 0 (packed rows restart positions per sample)."""
    sample = (position_ids == 0).cumsum(-1)
    same = sample.unsqueeze(-1) == sample.unsqueeze(-2)
    s = position_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    return (same & causal).unsqueeze(1)


SAMPLE_STARTS = "_cu_seqlens"  # the attribute of a position-ids tensor that holds its sample starts


def sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 cumulative sample lengths of the rows laid end to end (flash-attn's ``cu_seqlens``).

    Kept on the position ids tensor (attribute ``SAMPLE_STARTS``), which every layer of a pipeline
    stage receives unchanged: the packer computes them on the host, and ``samples.to_device`` carries
    them to the device with the ids, so the model never has to find them; where they are missing
    (a pipeline stage's received ids, a CP rank's slice), finding them on the device reads it back
    (a host sync), once per stage and micro-batch rather than once per layer."""
    cached = getattr(position_ids, SAMPLE_STARTS, None)
    if cached is None:
        cached = _find_sample_starts(position_ids)
    return cached


@torch._disable_dynamo  # nonzero's length is data: a graph break, where no packer gave the starts
def _find_sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten().to(torch.int32)
    return attach_sample_starts(position_ids, torch.cat([starts, starts.new_full((1,), flat.numel())]))


def attach_sample_starts(position_ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Keep ``starts`` on ``position_ids`` (where ``sample_starts`` looks), their length marked
    dynamic: a new number of samples per row is not a new compiled graph. Returns ``starts``."""
    torch._dynamo.maybe_mark_dynamic(starts, 0)
    setattr(position_ids, SAMPLE_STARTS, starts)
    return starts


def _torch_varlen() -> tuple[Optional[Callable], dict]:
    """torch's varlen_attn (None before torch 2.10), and what it needs told about grouped KV heads:
    2.13's asks for ``enable_gqa``, 2.10/2.11's take grouped k, v without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, {}
    import inspect
    return varlen_attn, ({"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {})


# What this torch provides, read once; a CUDA kernel only, so not looked for without CUDA (its module imports
# torch._dynamo, ~1.5 s of a CPU process's start-up).
_VARLEN_ATTN, _VARLEN_GQA_OPTIONS = _torch_varlen() if torch.cuda.is_available() else (None, {})


def torch_varlen_available() -> bool:
    """torch's own variable-length flash kernel is here: torch 2.10 or newer and an Ampere-or-newer GPU."""
    return _VARLEN_ATTN is not None and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def varlen_causal_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, scale: Optional[float] = None):
    """Causal attention within each of the sequences laid end to end in q [t, heads, d] and k, v
    [t, groups, d], ``cu_seqlens`` (int32, on the device) marking where each begins: torch's
    variable-length flash kernel (flash-attention 2's, built into torch: no package to install).
    Its cost follows the samples' own lengths, sum of L_i^2, not the row's: a block-diagonal mask
    over a packed row of 4096 costs a whole causal row. Grouped-query k, v are passed as they are
    (the kernel shares each KV head among its query heads)."""
    options = _VARLEN_GQA_OPTIONS if q.shape[1] != k.shape[1] else {}
    return _VARLEN_ATTN(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0), **options)


def _sdpa_varlen(q, k, v, position_ids):
    """Traced into a compiled layer when the ids carry their sample starts (torch's varlen_attn is
    a custom op with a shape function), so a layer stays one graph."""
    s, b = q.shape[:2]
    q, k, v = (t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (q, k, v))
    out = varlen_causal_attention(q, k, v, sample_starts(position_ids), s)
    return out.view(b, s, *out.shape[1:]).transpose(0, 1)


def make_sdpa_attention() -> Callable:
    """``sdpa_attention``, except that packed rows take torch's variable-length flash kernel where
    it applies: a CUDA tensor in half precision, head dim up to 256, no attention dropout (the
    kernel's dropout is fixed at 0). Whether the kernel exists is decided here, once, so that a
    compiled layer guards only on the tensors' device, dtype and shape."""
    varlen = torch_varlen_available()

    def attention(q, k, v, dropout_p: float = 0.0, position_ids=None):
        if (varlen and position_ids is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
                and not dropout_p and q.shape[-1] <= 256):
            return _sdpa_varlen(q, k, v, position_ids)
        return sdpa_attention(q, k, v, dropout_p, position_ids)
    return attention


def sdpa_attention(q, k, v, dropout_p: float = 0.0, position_ids=None):
    if position_ids is None:
        out = F.scaled_dot_product_attention(_to_bhsd(q), _to_bhsd(k), _to_bhsd(v), dropout_p=dropout_p, is_causal=True,
                                             enable_gqa=q.shape[2] != k.shape[2])
    else:
        out = F.scaled_dot_product_attention(_to_bhsd(q), _to_bhsd(k), _to_bhsd(v), attn_mask=packed_causal_mask(position_ids),
                                             dropout_p=dropout_p, enable_gqa=q.shape[2] != k.shape[2])
    return out.permute(2, 0, 1, 3)


def cudnn_attention(q, k, v, dropout_p: float = 0.0, position_ids=None):
    if position_ids is not None:
        raise ValueError("cuDNN attention cannot isolate packed samples")  # refused at start-up (PACKING_BACKENDS)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    require_half_precision_cuda("cuDNN attention", q)
    if q.shape[2] != k.shape[2]:  # cuDNN's SDPA entry takes equal head counts
        repeat = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(_to_bhsd(q), _to_bhsd(k), _to_bhsd(v), dropout_p=dropout_p, is_causal=True)
    return out.permute(2, 0, 1, 3)


def _flash_function(varlen: bool = False) -> tuple[Optional[Callable], str]:
    """(function, version) of the installed flash-attn: 2.x first, then flash-attn-4 (CuTe);
    ``varlen``: the variable-length entry (concatenated samples, ``cu_seqlens``) instead."""
    name = "flash_attn_varlen_func" if varlen else "flash_attn_func"
    for module, version in (("flash_attn", "2"), ("flash_attn.cute", "4")):
        try:
            return getattr(importlib.import_module(module), name), version
        except (ImportError, AttributeError):
            continue
    return None, ""


def _flash_varlen(fn, q, k, v, dropout_p: float, position_ids, version: str):
    """Packed rows as flash-attn's variable-length batch: the rows laid end to end, one "sequence"
    per sample, so no query sees another sample's keys."""
    s, b = q.shape[:2]
    cu = sample_starts(position_ids)
    q, k, v = (t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (q, k, v))
    lengths = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
    if version == "2":
        out = fn(q, k, v, dropout_p=dropout_p, causal=True, **lengths)
    else:
        out = fn(q, k, v, causal=True, **lengths)
        out = out[0] if isinstance(out, tuple) else out
    return out.view(b, s, *out.shape[1:]).transpose(0, 1)


def make_flash_attention() -> Callable:
    fn, version = _flash_function()
    varlen, _ = _flash_function(varlen=True)

    # Outside compiled graphs: flash-attn-4's CuTe kernels are not traceable by dynamo (the
    # layer's graph breaks around this call). Both versions take [b, s, h, d] views with any
    # aligned strides and copy only when they must, so no transpose is materialised here.
    @torch._disable_dynamo
    def flash_attention(q, k, v, dropout_p: float = 0.0, position_ids=None):
        require_half_precision_cuda("flash-attn", q)
        if position_ids is not None:
            return _flash_varlen(varlen, q, k, v, dropout_p, position_ids, version)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        if version == "2":
            out = fn(q, k, v, dropout_p=dropout_p, causal=True)
        else:
            if dropout_p:
                raise ValueError("flash-attn-4 has no attention dropout; use --attention-backend cudnn or --attention-dropout 0.")
            out = fn(q, k, v, causal=True)
            out = out[0] if isinstance(out, tuple) else out
        return out.transpose(0, 1)
    return flash_attention


class TEAttention:
    """Transformer Engine's fused attention in the [s, b, h, d] ("sbhd") layout.

    Not an nn.Module on purpose: TE's module carries an ``_extra_state`` entry that would
    make this backend's checkpoints differ in keys from every other backend's. Dropout is
    on exactly when the caller passes a non-zero ``dropout_p`` (the model passes 0 in eval).
    """

    def __init__(self, heads: int, groups: int, head_dim: int, dropout: float):
        import transformer_engine.pytorch as te
        self.module = te.DotProductAttention(heads, head_dim, num_gqa_groups=groups, attention_dropout=dropout,
                                             qkv_format="sbhd", attn_mask_type="causal")

    def __call__(self, q, k, v, dropout_p: float = 0.0, position_ids=None):
        if position_ids is not None:
            raise ValueError("TE attention is not wired for packed samples")  # refused at start-up (PACKING_BACKENDS)
        if self.module.training != bool(dropout_p):
            self.module.train(bool(dropout_p))
        s, b, h, d = q.shape
        return self.module(q, k, v).view(s, b, h, d)


def _available(name: str) -> tuple[bool, str]:
    cuda = torch.cuda.is_available()
    if name == "sdpa":
        return True, ""
    if not cuda:
        return False, "it needs a CUDA GPU"
    if name == "cudnn":
        if not torch.backends.cudnn.is_available():
            return False, "torch was built without cuDNN"
        if torch.cuda.get_device_capability() < (8, 0):
            return False, "cuDNN fused attention needs an Ampere or newer GPU"
        return True, ""
    if name == "flash":
        return (True, "") if _flash_function()[0] is not None else (False, "flash-attn is not installed (pip install flash-attn, or flash-attn-4 on Hopper)")
    if name == "te":
        ok = importlib.util.find_spec("transformer_engine") is not None
        return (True, "") if ok else (False, "transformer-engine is not installed")
    raise ValueError(name)


# cuDNN's fused attention inside CUDA graphs (--cuda-graphs): its captured backward read invalid
# memory at head dim 16, sequence 32 (H200, torch 2.11, 2026-11-23) and ran right at head dim 128,
# sequence 256 and 2048; shapes below this (head dim, sequence) take torch's SDPA instead.
CUDNN_IN_GRAPHS_FROM = (128, 256)


# Backends that keep packed samples apart (--packing): sdpa (torch's variable-length flash kernel
# where it applies, else a block-diagonal causal mask), flash-attn's variable-length kernels.
# cuDNN's SDPA entry and TE's sbhd layout are not wired for it.
PACKING_BACKENDS = ("sdpa", "flash")


HALF_PRECISION_ONLY = ("cudnn", "flash")  # kernels with no fp32 path


def resolve_backend(name: str, attention_dropout: float = 0.0, graphed_shape: tuple[int, int] | None = None,
                    packing: bool = False, half_precision: bool = True) -> tuple[str, str]:
    """(backend, why) for ``--attention-backend name``; raises ValueError (one sentence) if unusable.
    ``graphed_shape``: (head dim, sequence length) when the layers are captured as CUDA graphs;
    ``packing``: rows hold several samples that must not see each other; ``half_precision``: the
    model computes in bf16 or fp16 (an fp32 run cannot use cuDNN's or flash-attn's kernels)."""
    if packing and name in ("cudnn", "te"):
        raise ValueError(f"--attention-backend {name} cannot keep packed samples apart (--packing); use flash (variable-length "
                         "kernels), sdpa (a block-diagonal mask) or auto.")
    if name != "auto" and not (packing and name == "flash"):  # packing names what flash lacks itself
        ok, why_not = _available(name)
        if not ok:
            raise ValueError(f"--attention-backend {name} is not usable here: {why_not}.")
    if not half_precision:
        if name in HALF_PRECISION_ONLY:
            raise ValueError(f"--attention-backend {name} runs in bf16 or fp16 only and this run is fp32; add --bf16, "
                             "or use --attention-backend sdpa (or auto).")
        if name in ("auto", "sdpa"):
            return "sdpa", ("requested" if name == "sdpa" else "auto: an fp32 run") + (
                " (torch SDPA's fp32 kernels" + (", a block-diagonal mask for packed samples)" if packing else ")"))
    if packing:
        return _resolve_packing(name, attention_dropout)
    cudnn_fits_graphs = graphed_shape is None or all(a >= b for a, b in zip(graphed_shape, CUDNN_IN_GRAPHS_FROM))
    if name != "auto":
        if name == "flash" and attention_dropout and _flash_function()[1] == "4":
            raise ValueError("--attention-backend flash (flash-attn-4) has no attention dropout; use cudnn or --attention-dropout 0.")
        if name == "cudnn" and not cudnn_fits_graphs:
            raise ValueError(f"--attention-backend cudnn cannot be combined with --cuda-graphs at head dim {graphed_shape[0]} and "
                             f"sequence {graphed_shape[1]}: captured, cuDNN's attention backward read invalid memory at small shapes "
                             f"(checked from {CUDNN_IN_GRAPHS_FROM[0]} and {CUDNN_IN_GRAPHS_FROM[1]} up); use sdpa or flash.")
        return name, "requested"
    flash, version = _flash_function() if torch.cuda.is_available() else (None, "")
    if flash is not None and not (attention_dropout and version == "4"):
        return "flash", f"auto: flash-attn {version} is installed"
    if _available("cudnn")[0] and torch.cuda.get_device_capability() >= (9, 0):
        if cudnn_fits_graphs:
            return "cudnn", "auto: no flash-attn; cuDNN fused attention on a Hopper-class GPU"
        return "sdpa", "auto: no flash-attn; cuDNN attention is not captured in CUDA graphs at this small a shape"
    return "sdpa", "auto: no flash-attn and no Hopper GPU"


def _resolve_packing(name: str, attention_dropout: float) -> tuple[str, str]:
    if name in ("cudnn", "te"):
        raise ValueError(f"--attention-backend {name} cannot keep packed samples apart (--packing); use flash (variable-length "
                         "kernels), sdpa (a block-diagonal mask) or auto.")
    varlen, version = _flash_function(varlen=True) if torch.cuda.is_available() else (None, "")
    if name == "flash" and varlen is None:
        raise ValueError("--attention-backend flash with --packing needs flash-attn's flash_attn_varlen_func, which is not installed.")
    if name == "flash" and attention_dropout and version == "4":
        raise ValueError("--attention-backend flash (flash-attn-4) has no attention dropout; use sdpa or --attention-dropout 0.")
    if name != "auto":
        return name, "requested (packed samples apart)"
    if varlen is not None and not (attention_dropout and version == "4"):
        return "flash", f"auto with --packing: flash-attn {version}'s variable-length kernels"
    if torch_varlen_available() and not attention_dropout:
        return "sdpa", ("auto with --packing: torch's variable-length flash kernel in half precision (no flash-attn), "
                        "SDPA with a block-diagonal causal mask otherwise")
    return "sdpa", "auto with --packing: SDPA with a block-diagonal causal mask (no flash-attn)"


# ---------------------------------------------------------------- the log-sum-exp variants
#
# Context parallelism (hybridlm.parallel.context) computes attention block by block and merges
# the blocks by their log-sum-exp. A block kernel: ``forward(q, k, v, causal) -> (out, lse)`` with
# q [sq, b, h, d], k, v [sk, b, g, d], out like q and lse [b, h, sq] in fp32; ``backward(dout, q, k,
# v, out, lse, causal) -> (dq, dk, dv)`` where ``out`` and ``lse`` are the *merged* ones (flash
# attention's backward needs nothing else from the other blocks). ``causal`` only on square blocks.

class MathBlockAttention:
    """The definition in plain PyTorch (fp32 arithmetic or wider, any device): the CPU path and
    what the GPU kernels are tested against. Materialises the [b, h, sq, sk] scores."""

    @staticmethod
    def _widen(t):
        return t.to(torch.promote_types(t.dtype, torch.float32))

    def _scores(self, q, k, causal):
        repeat = q.shape[2] // k.shape[2]
        scores = torch.einsum("qbhd,kbhd->bhqk", self._widen(q), self._widen(k).repeat_interleave(repeat, dim=2)) / q.shape[-1] ** 0.5
        if causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return scores

    def forward(self, q, k, v, causal: bool):
        scores = self._scores(q, k, causal)
        lse = scores.logsumexp(-1)
        repeat = q.shape[2] // k.shape[2]
        out = torch.einsum("bhqk,kbhd->qbhd", torch.exp(scores - lse.unsqueeze(-1)), self._widen(v).repeat_interleave(repeat, dim=2))
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal: bool):
        repeat = q.shape[2] // k.shape[2]
        probs = torch.exp(self._scores(q, k, causal) - lse.unsqueeze(-1))
        dout = self._widen(dout)
        dv = torch.einsum("bhqk,qbhd->kbhd", probs, dout)
        dprobs = torch.einsum("qbhd,kbhd->bhqk", dout, self._widen(v).repeat_interleave(repeat, dim=2))
        row_dot = (dout * self._widen(out)).sum(-1).permute(1, 2, 0)  # [b, h, sq]
        dscores = probs * (dprobs - row_dot.unsqueeze(-1)) / q.shape[-1] ** 0.5
        dq = torch.einsum("bhqk,kbhd->qbhd", dscores, self._widen(k).repeat_interleave(repeat, dim=2))
        dk = torch.einsum("bhqk,qbhd->kbhd", dscores, self._widen(q))
        return dq, _fold_heads(dk, k.shape[2]), _fold_heads(dv, k.shape[2])


def _sbhd(t):
    return t.permute(2, 0, 1, 3)


def _same_heads(q, k, v):
    repeat = q.shape[2] // k.shape[2]
    return (k, v) if repeat == 1 else (k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2))


def _unused_rng(t):
    """The philox seed/offset a kernel without dropout never reads (0-dim int64, as torch makes them)."""
    return torch.zeros((), dtype=torch.int64, device=t.device)


def _fold_heads(grad, groups: int):
    s, b, heads, d = grad.shape
    return grad if heads == groups else grad.view(s, b, groups, heads // groups, d).sum(3)


class TorchFlashBlockAttention:
    """torch's own flash-attention kernel (the one behind SDPA on GPUs) called through its
    log-sum-exp-returning ATen entry points; CUDA tensors in half precision only."""
    name = "torch's flash kernel"

    def forward(self, q, k, v, causal: bool):
        require_half_precision_cuda(self.name, q)
        k, v = _same_heads(q, k, v)
        result = torch.ops.aten._scaled_dot_product_flash_attention(_to_bhsd(q), _to_bhsd(k), _to_bhsd(v), 0.0, causal)
        return _sbhd(result[0]), result[1]

    def backward(self, dout, q, k, v, out, lse, causal: bool):
        require_half_precision_cuda(self.name, q)
        groups = k.shape[2]
        k, v = _same_heads(q, k, v)
        # no cumulative sequence lengths (None: not the variable-length kernel), as torch's own
        # ring attention (torch.distributed.tensor.experimental) calls it
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _to_bhsd(dout), _to_bhsd(q), _to_bhsd(k), _to_bhsd(v), _to_bhsd(out), lse.contiguous(), None, None, q.shape[0], k.shape[0],
            0.0, causal, _unused_rng(q), _unused_rng(q))
        return _sbhd(dq), _fold_heads(_sbhd(dk), groups), _fold_heads(_sbhd(dv), groups)


class CuDNNBlockAttention:
    """cuDNN's fused attention through torch's log-sum-exp-returning ATen entry points (CUDA, half precision)."""
    name = "cuDNN attention"

    def forward(self, q, k, v, causal: bool):
        require_half_precision_cuda(self.name, q)
        k, v = _same_heads(q, k, v)
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(_to_bhsd(q), _to_bhsd(k), _to_bhsd(v), None, True, 0.0, causal)
        return _sbhd(result[0]), result[1].reshape(q.shape[1], q.shape[2], q.shape[0]).float()

    def backward(self, dout, q, k, v, out, lse, causal: bool):
        require_half_precision_cuda(self.name, q)
        groups = k.shape[2]
        k, v = _same_heads(q, k, v)
        # cuDNN wants the output and its gradient in one layout: both [b, s, h, d] in memory
        out_bshd, dout_bshd = out.transpose(0, 1).contiguous(), dout.transpose(0, 1).contiguous()
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout_bshd.transpose(1, 2), _to_bhsd(q), _to_bhsd(k), _to_bhsd(v), out_bshd.transpose(1, 2), lse.unsqueeze(-1).contiguous(),
            _unused_rng(q), _unused_rng(q), None, None, None, q.shape[0], k.shape[0], 0.0, causal)
        return _sbhd(dq), _fold_heads(_sbhd(dk), groups), _fold_heads(_sbhd(dv), groups)


class FlashAttnBlockAttention:
    """flash-attn's kernels with their log-sum-exp (2.x: ``_flash_attn_forward``/``_backward``;
    flash-attn-4: ``_flash_attn_fwd``/``_bwd``), [b, s, h, d] views of our [s, b, h, d]; grouped-query
    attention natively. CUDA tensors in half precision only."""

    def __init__(self):
        try:
            from flash_attn import flash_attn_interface as interface
            self.version, self.interface = "2", interface
        except ImportError:
            from flash_attn.cute import interface
            self.version, self.interface = "4", interface
        self.name = f"flash-attn {self.version}"

    def forward(self, q, k, v, causal: bool):
        require_half_precision_cuda(self.name, q)
        q_, k_, v_ = (t.transpose(0, 1).contiguous() for t in (q, k, v))
        scale = q.shape[-1] ** -0.5
        if self.version == "2":
            result = self.interface._flash_attn_forward(q_, k_, v_, 0.0, scale, causal=causal, window_size_left=-1,
                                                        window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False)
        else:
            result = self.interface._flash_attn_fwd(q_, k_, v_, softmax_scale=scale, causal=causal, return_lse=True)
        return result[0].transpose(0, 1), result[1]

    def backward(self, dout, q, k, v, out, lse, causal: bool):
        require_half_precision_cuda(self.name, q)
        q_, k_, v_, out_, dout_ = (t.transpose(0, 1).contiguous() for t in (q, k, v, out, dout))
        scale, lse = q.shape[-1] ** -0.5, lse.contiguous()
        if self.version == "2":
            dq, dk, dv = torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)
            self.interface._flash_attn_backward(dout_, q_, k_, v_, out_, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None, False)
        else:
            dq, dk, dv = self.interface._flash_attn_bwd(q_, k_, v_, out_, dout_, lse, scale, causal)[:3]
        return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


BLOCK_KERNELS = {"flash": FlashAttnBlockAttention, "cudnn": CuDNNBlockAttention, "sdpa": TorchFlashBlockAttention,
                 "math": MathBlockAttention}


def block_kernel_name(backend: str, half_precision: bool, on_gpu: bool) -> str:
    """Which log-sum-exp kernel context parallelism's ring and all-gather run for a resolved ``backend``:
    the backend's own on a GPU in half precision, else ``math`` (the fp32 PyTorch definition), the one
    kernel that runs on CPUs and in fp32. Transformer Engine is refused with CP before this is asked."""
    return backend if half_precision and on_gpu and backend in BLOCK_KERNELS else "math"


def describe_block_kernel(name: str) -> str:
    return {"flash": "flash-attn's", "cudnn": "cuDNN's", "sdpa": "torch's flash kernel's",
            "math": "the fp32 PyTorch definition's (CPU or fp32)"}[name]


def make_block_attention(name: str):
    """The block kernel ``block_kernel_name`` chose."""
    return BLOCK_KERNELS[name]()


def make_attention_core(backend: str, *, heads: int, groups: int, head_dim: int, dropout: float) -> Callable:
    """The core for a resolved backend name; ``heads``/``groups`` are this TP rank's."""
    if backend == "sdpa":
        return make_sdpa_attention()
    if backend == "cudnn":
        return cudnn_attention
    if backend == "flash":
        return make_flash_attention()
    if backend == "te":
        return TEAttention(heads, groups, head_dim, dropout)
    raise ValueError(f"unknown attention backend {backend!r}")
