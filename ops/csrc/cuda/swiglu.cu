// Fused SwiGLU, forward and backward: h [rows, 2f] = [gate | up] -> silu(gate) * up [rows, f].
//
// A grid-stride loop over VEC-element packs of the output; gate and up are read with one
// 16-byte access each, the math is fp32 with one rounding per output. The backward reads h
// and dy once and writes both halves of dh:
//   d gate = dy * up * sig(g) * (1 + g * (1 - sig(g))),  d up = dy * g * sig(g).
#include "device.cuh"

namespace hybridlm {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float v) { return 1.f / (1.f + expf(-v)); }

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) swiglu_fwd_kernel(const T* __restrict__ h, T* __restrict__ y, int64_t total,
                                                              int64_t f) {
  const int64_t packs = f / VEC;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < total; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = p / packs, j = (p - r * packs) * VEC;
    const Pack<T, VEC> g = load<T, VEC>(h + r * 2 * f + j), u = load<T, VEC>(h + r * 2 * f + f + j);
    Pack<T, VEC> out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float gv = to_f32(g.v[k]);
      out.v[k] = from_f32<T>(gv * sigmoid(gv) * to_f32(u.v[k]));
    }
    store<T, VEC>(y + r * f + j, out);
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) swiglu_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ h,
                                                              T* __restrict__ dh, int64_t total, int64_t f) {
  const int64_t packs = f / VEC;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < total; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = p / packs, j = (p - r * packs) * VEC;
    const Pack<T, VEC> g = load<T, VEC>(h + r * 2 * f + j), u = load<T, VEC>(h + r * 2 * f + f + j);
    const Pack<T, VEC> d = load<T, VEC>(dy + r * f + j);
    Pack<T, VEC> dg, du;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float gv = to_f32(g.v[k]), uv = to_f32(u.v[k]), dv = to_f32(d.v[k]), sig = sigmoid(gv);
      dg.v[k] = from_f32<T>(dv * uv * sig * (1.f + gv * (1.f - sig)));
      du.v[k] = from_f32<T>(dv * gv * sig);
    }
    store<T, VEC>(dh + r * 2 * f + j, dg);
    store<T, VEC>(dh + r * 2 * f + f + j, du);
  }
}

}  // namespace

cudaError_t swiglu_fwd(DType dtype, const void* h, void* y, int64_t rows, int64_t f, cudaStream_t stream) {
  if (rows == 0 || f == 0) return cudaSuccess;
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T* hp = static_cast<const T*>(h);
    T* yp = static_cast<T*>(y);
    if (f % V == 0 && aligned16(h) && aligned16(y)) {
      swiglu_fwd_kernel<T, V><<<grid_for(rows * f / V, kThreads), kThreads, 0, stream>>>(hp, yp, rows * f / V, f);
    } else {
      swiglu_fwd_kernel<T, 1><<<grid_for(rows * f, kThreads), kThreads, 0, stream>>>(hp, yp, rows * f, f);
    }
    return cudaGetLastError();
  });
}

cudaError_t swiglu_bwd(DType dtype, const void* dy, const void* h, void* dh, int64_t rows, int64_t f, cudaStream_t stream) {
  if (rows == 0 || f == 0) return cudaSuccess;
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T* dyp = static_cast<const T*>(dy);
    const T* hp = static_cast<const T*>(h);
    T* dhp = static_cast<T*>(dh);
    if (f % V == 0 && aligned16(dy) && aligned16(h) && aligned16(dh)) {
      swiglu_bwd_kernel<T, V><<<grid_for(rows * f / V, kThreads), kThreads, 0, stream>>>(dyp, hp, dhp, rows * f / V, f);
    } else {
      swiglu_bwd_kernel<T, 1><<<grid_for(rows * f, kThreads), kThreads, 0, stream>>>(dyp, hp, dhp, rows * f, f);
    }
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace hybridlm
