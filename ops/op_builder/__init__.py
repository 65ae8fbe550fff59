"""The fused kernels' DeepSpeed op builders (imported as ``hybridlm.ops.op_builder``)."""
from .builder import FusedOpsCPUBuilder, FusedOpsCUDABuilder, builder_for

__all__ = ["FusedOpsCPUBuilder", "FusedOpsCUDABuilder", "builder_for"]
