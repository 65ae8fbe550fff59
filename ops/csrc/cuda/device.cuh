// Device helpers shared by the kernels: dtype conversions, 16-byte vector access, reductions,
// and the host-side choice of vector width and grid size.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "launchers.h"

namespace hybridlm {
namespace cuda {

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// Round to T and back: the value PyTorch holds after an elementwise op in T.
template <typename T> __device__ __forceinline__ float rounded(float v) { return to_f32(from_f32<T>(v)); }

// N elements of T loaded or stored as one access (N * sizeof(T) is 16 bytes, or 1 element).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load(const T* p) { return *reinterpret_cast<const Pack<T, N>*>(p); }

template <typename T, int N>
__device__ __forceinline__ void store(T* p, const Pack<T, N>& v) { *reinterpret_cast<Pack<T, N>*>(p) = v; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = lane < warps ? warp_sums[lane] : 0.f;
  v = warp_sum(v);
  __syncthreads();  // warp_sums may be reused by the next call
  return v;
}

template <typename T> constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte access

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline int multiprocessors() {
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return std::max(count, 1);
}

// Blocks for a grid-stride loop over `work` items of `threads` each: enough to fill the GPU.
inline unsigned grid_for(int64_t work, int threads) {
  const int64_t needed = (work + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(multiprocessors()) * 16)));
}

// Calls fn(T{}) with T the CUDA type of dtype.
template <typename Fn>
cudaError_t dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kBFloat16: return fn(__nv_bfloat16{});
    case DType::kFloat16: return fn(__half{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace hybridlm
