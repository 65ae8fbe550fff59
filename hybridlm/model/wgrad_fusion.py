"""Weight gradients accumulated inside Transformer Engine's GEMMs (``--gradient-accumulation-fusion``).

Why: with gradient accumulation, autograd adds every micro-batch's weight gradient into
``.grad`` with a separate elementwise kernel, one per parameter per micro-batch: on the
reference model in FP8 that was 5% of the step (benchmarks/PROFILES.md). TE's weight-gradient
GEMM can add its product into a ``main_grad`` buffer itself (the GEMM's beta = 1), as
Megatron's flag of the same name does.

How it meets DeepSpeed: ZeRO 0 and 1 read ``param.grad`` when they reduce at the step's last
micro-batch (in their post-accumulate-grad hooks with overlap_comm, else after backward). So
``.grad`` is made to *be* the buffer. When a fused weight's gradient arrives, a tensor hook
first drops ``.grad``: TE hands autograd a placeholder (its shared scratch tensor) that must
not be added into anything; autograd stores the placeholder without a kernel, and a
post-accumulate hook, registered before DeepSpeed's, replaces it with a view of the buffer.
After every backward ``.grad`` holds exactly what separate accumulation would hold, and every
parameter's hooks still fire once per micro-batch (DeepSpeed counts them).

Zeroing: TE overwrites the buffer at a step's first micro-batch when it is told which one that
is (``is_first_microbatch``), but a CUDA-graph replay, captured outside any step, always
accumulates; so the training loop zeroes the buffer before each step (one memset).

Where it does not fit (refused in ``RunConfig.validate`` and
``ds_config.check_gradient_accumulation_fusion``): ZeRO 2 and 3, and DeepSpeed's separate
accumulation dtype (``data_types.grad_accum_dtype``), take ``.grad`` at every micro-batch and
accumulate it themselves, so a running sum would be counted again each time; DeepSpeed's pipeline
engine runs its own micro-batch loop, and offloaded gradients, are not checked with this.
"""
from __future__ import annotations

import torch
from torch import nn

# The GEMM weights of TE's Linear and LayerNormLinear, and of LayerNormMLP. A fused norm's weight
# and any bias keep autograd's accumulation: TE computes their gradients outside the GEMM.
GEMM_WEIGHT_NAMES = ("weight", "fc1_weight", "fc2_weight")


class MainGrads:
    """One flat buffer with the running weight gradients of every GEMM that ``te_modules`` run.

    Built after the model and before ``deepspeed.initialize`` (the hooks must run before
    DeepSpeed's), in the dtype DeepSpeed will give the parameters (its ZeRO 0/1 accumulate
    gradients in the parameters' own dtype, and so does this buffer)."""

    def __init__(self, te_modules: list[nn.Module], dtype: torch.dtype):
        weights = list({id(w): w for m in te_modules for w in _gemm_weights(m)}.values())
        if not weights:
            raise ValueError("--gradient-accumulation-fusion found no Transformer Engine GEMM to fuse into.")
        self.buffer = torch.zeros(sum(w.numel() for w in weights), dtype=dtype, device=weights[0].device)
        offset = 0
        for weight in weights:
            weight.main_grad = self.buffer[offset:offset + weight.numel()].view(weight.shape)
            offset += weight.numel()
            # TE's contract with Megatron: with this attribute TE hands autograd a placeholder
            # gradient rather than None (the path TE's graph capture is built around).
            weight.grad_added_to_main_grad = False
            # TE's make_graphed_callables then returns the placeholder as it is, not a clone of it.
            weight.skip_backward_post_hook = True
            weight.register_hook(_placeholder_replaces_grad(weight))
            weight.register_post_accumulate_grad_hook(_grad_is_main_grad)
        for module in te_modules:
            module.fuse_wgrad_accumulation = True
        self.weights = weights

    def zero_(self) -> None:
        """Before a step's first micro-batch (a captured layer's backward always adds)."""
        self.buffer.zero_()


def _gemm_weights(module: nn.Module) -> list[nn.Parameter]:
    return [w for name in GEMM_WEIGHT_NAMES
            if isinstance(w := getattr(module, name, None), nn.Parameter) and w.requires_grad]


def _placeholder_replaces_grad(weight: nn.Parameter):
    def hook(_placeholder: torch.Tensor) -> None:
        weight.grad = None  # autograd then stores the placeholder instead of adding it to the buffer's view
    return hook


def _grad_is_main_grad(weight: nn.Parameter) -> None:
    # A new tensor object over the buffer: ZeRO swaps the .data of the .grad it reduces, and
    # must not swap the buffer's.
    weight.grad = weight.main_grad.detach()
