// Fused RMSNorm, forward and backward.
//
// Forward: one block per row; each thread reads VEC-element packs (16 bytes), the sum of
// squares is reduced with warp shuffles, and the row is normalised in fp32, rounded to the
// input dtype, then multiplied by the weight (the model's PyTorch definition, so bf16 results
// match it bit for bit up to the order of the sum).
//
// Backward: a grid of about one wave of blocks walks the rows; per row the block reduces
// dot = sum(g * xhat) (g = dy * w) and writes dx = rstd * (g - xhat * dot / n). Each block
// also accumulates its rows' share of dweight in shared memory (fp32, one column per thread
// slot, so no atomics) and writes it as one row of a [blocks, n] partial that the caller sums.
#include "device.cuh"

namespace hybridlm {
namespace cuda {
namespace {

constexpr int kMaxThreads = 512;

inline int threads_for(int64_t packs) {
  const int64_t warps = (std::min<int64_t>(packs, kMaxThreads) + 31) / 32;
  return static_cast<int>(std::max<int64_t>(warps, 1) * 32);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                                                    T* __restrict__ y, float* __restrict__ rstd,
                                                                    int64_t n, float eps) {
  const int64_t row = blockIdx.x, packs = n / VEC;
  const T* xr = x + row * n;
  T* yr = y + row * n;
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, VEC> xv = load<T, VEC>(xr + i * VEC);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float v = to_f32(xv.v[k]);
      ss += v * v;
    }
  }
  const float rs = rsqrtf(block_sum(ss) / static_cast<float>(n) + eps);
  if (threadIdx.x == 0) rstd[row] = rs;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const Pack<T, VEC> xv = load<T, VEC>(xr + i * VEC), wv = load<T, VEC>(w + i * VEC);
    Pack<T, VEC> out;
#pragma unroll
    for (int k = 0; k < VEC; ++k) out.v[k] = from_f32<T>(to_f32(wv.v[k]) * rounded<T>(to_f32(xv.v[k]) * rs));
    store<T, VEC>(yr + i * VEC, out);
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                                    const T* __restrict__ w, const float* __restrict__ rstd,
                                                                    T* __restrict__ dx, float* __restrict__ partial,
                                                                    int64_t rows, int64_t n) {
  extern __shared__ float dw[];  // n floats; column i*VEC+k lives at k*packs+i (conflict-free)
  const int64_t packs = n / VEC;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x)
#pragma unroll
    for (int k = 0; k < VEC; ++k) dw[k * packs + i] = 0.f;  // only this thread touches these slots
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * n;
    const T* dyr = dy + row * n;
    T* dxr = dx + row * n;
    const float rs = rstd[row];
    float dot = 0.f;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const Pack<T, VEC> xv = load<T, VEC>(xr + i * VEC), dv = load<T, VEC>(dyr + i * VEC), wv = load<T, VEC>(w + i * VEC);
#pragma unroll
      for (int k = 0; k < VEC; ++k) dot += rounded<T>(to_f32(dv.v[k]) * to_f32(wv.v[k])) * (to_f32(xv.v[k]) * rs);
    }
    const float mean = block_sum(dot) / static_cast<float>(n);
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const Pack<T, VEC> xv = load<T, VEC>(xr + i * VEC), dv = load<T, VEC>(dyr + i * VEC), wv = load<T, VEC>(w + i * VEC);
      Pack<T, VEC> out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float xhat = to_f32(xv.v[k]) * rs, d = to_f32(dv.v[k]);
        out.v[k] = from_f32<T>(rs * (rounded<T>(d * to_f32(wv.v[k])) - xhat * mean));
        dw[k * packs + i] += d * rounded<T>(xhat);
      }
      store<T, VEC>(dxr + i * VEC, out);
    }
  }
  float* out = partial + blockIdx.x * n;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x)
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[i * VEC + k] = dw[k * packs + i];
}

template <typename T>
bool vectorisable(int64_t n, std::initializer_list<const void*> pointers) {
  if (n % kVec<T> != 0) return false;
  for (const void* p : pointers)
    if (!aligned16(p)) return false;
  return true;
}

template <typename T, int VEC>
cudaError_t set_shared_limit(size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(rms_norm_bwd_kernel<T, VEC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

template <typename T, int VEC>
int bwd_blocks(int64_t rows, int64_t n) {
  const int threads = threads_for(n / VEC);
  const size_t smem = n * sizeof(float);
  int per_sm = 0;
  if (set_shared_limit<T, VEC>(smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, rms_norm_bwd_kernel<T, VEC>, threads, smem) != cudaSuccess)
    per_sm = 1;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t(multiprocessors()) * std::max(per_sm, 1))));
}

}  // namespace

cudaError_t rms_norm_fwd(DType dtype, const void* x, const void* weight, void* y, float* rstd, int64_t rows, int64_t n,
                         float eps, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x);
    const T* wp = static_cast<const T*>(weight);
    T* yp = static_cast<T*>(y);
    if (vectorisable<T>(n, {x, weight, y})) {
      rms_norm_fwd_kernel<T, kVec<T>><<<rows, threads_for(n / kVec<T>), 0, stream>>>(xp, wp, yp, rstd, n, eps);
    } else {
      rms_norm_fwd_kernel<T, 1><<<rows, threads_for(n), 0, stream>>>(xp, wp, yp, rstd, n, eps);
    }
    return cudaGetLastError();
  });
}

int rms_norm_bwd_blocks(DType dtype, int64_t rows, int64_t n) {
  if (rows == 0 || n == 0) return 1;
  int blocks = 1;
  dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    blocks = n % kVec<T> == 0 ? bwd_blocks<T, kVec<T>>(rows, n) : bwd_blocks<T, 1>(rows, n);
    return cudaSuccess;
  });
  return blocks;
}

cudaError_t rms_norm_bwd(DType dtype, const void* dy, const void* x, const void* weight, const float* rstd, void* dx,
                         float* dweight_partial, int blocks, int64_t rows, int64_t n, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  const size_t smem = n * sizeof(float);
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = static_cast<const T*>(dy);
    const T* xp = static_cast<const T*>(x);
    const T* wp = static_cast<const T*>(weight);
    T* dxp = static_cast<T*>(dx);
    if (vectorisable<T>(n, {dy, x, weight, dx})) {
      constexpr int V = kVec<T>;
      if (cudaError_t err = set_shared_limit<T, V>(smem); err != cudaSuccess) return err;
      rms_norm_bwd_kernel<T, V><<<blocks, threads_for(n / V), smem, stream>>>(dyp, xp, wp, rstd, dxp, dweight_partial, rows, n);
    } else {
      if (cudaError_t err = set_shared_limit<T, 1>(smem); err != cudaSuccess) return err;
      rms_norm_bwd_kernel<T, 1><<<blocks, threads_for(n), smem, stream>>>(dyp, xp, wp, rstd, dxp, dweight_partial, rows, n);
    }
    return cudaGetLastError();
  });
}

}  // namespace cuda
}  // namespace hybridlm
