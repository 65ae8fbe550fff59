// Host-side entry points of the CUDA kernels: raw pointers, sizes and a stream, no torch types,
// so the .cu files compile with nvcc and the CUDA headers alone (fast, and checkable without
// PyTorch's CUDA headers). fused_ops.cpp does the tensor checks and allocation around them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace hybridlm {
namespace cuda {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// y = weight * round(x * rstd), rstd = 1 / sqrt(mean(x^2) + eps) per row of n.
cudaError_t rms_norm_fwd(DType dtype, const void* x, const void* weight, void* y, float* rstd, int64_t rows,
                         int64_t n, float eps, cudaStream_t stream);

// Blocks the backward launches: dweight_partial must hold that many rows of n floats.
int rms_norm_bwd_blocks(DType dtype, int64_t rows, int64_t n);

// dx per row; each block's share of dweight (fp32) into dweight_partial[block, n].
cudaError_t rms_norm_bwd(DType dtype, const void* dy, const void* x, const void* weight, const float* rstd, void* dx,
                         float* dweight_partial, int blocks, int64_t rows, int64_t n, cudaStream_t stream);

// y [S, B, H, D] (contiguous) = rotation of x (strides st0, st1, st2 for S, B, H; the last
// dimension contiguous) by cos/sin [S, D]; backward applies the transposed rotation.
cudaError_t rotary(DType dtype, bool backward, const void* x, int64_t st0, int64_t st1, int64_t st2, const float* cos,
                   const float* sin, void* y, int64_t S, int64_t B, int64_t H, int64_t D, cudaStream_t stream);

// y [rows, f] = silu(h[:, :f]) * h[:, f:], h [rows, 2f] contiguous.
cudaError_t swiglu_fwd(DType dtype, const void* h, void* y, int64_t rows, int64_t f, cudaStream_t stream);
cudaError_t swiglu_bwd(DType dtype, const void* dy, const void* h, void* dh, int64_t rows, int64_t f,
                       cudaStream_t stream);

}  // namespace cuda
}  // namespace hybridlm
