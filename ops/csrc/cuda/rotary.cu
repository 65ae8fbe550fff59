// Fused rotary position embedding (the half-rotation layout of Llama / Hugging Face),
// forward and backward.
//
// x is [S, B, H, D] with any strides for S, B, H (the model passes q and k as views into the
// fused QKV output, so no copy is made first) and a contiguous head dimension; the output is
// contiguous. A block is a (threads per row) x (rows) tile: a row is one head of one token,
// each thread rotates VEC elements of the first half together with their partners in the
// second half: out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2, in fp32 with one rounding. The
// backward is the transposed rotation, the same map with (s1, s2) = (-s2, -s1).
#include "device.cuh"

namespace hybridlm {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const T* __restrict__ x, int64_t st0, int64_t st1, int64_t st2,
                                                          const float* __restrict__ cos, const float* __restrict__ sin,
                                                          T* __restrict__ y, int64_t rows, int64_t B, int64_t H,
                                                          int64_t D, bool backward) {
  const int64_t half = D / 2, packs = half / VEC;
  for (int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; row < rows; row += int64_t(gridDim.x) * blockDim.y) {
    const int64_t h = row % H, sb = row / H, b = sb % B, s = sb / B;
    const T* xr = x + s * st0 + b * st1 + h * st2;
    const float* c = cos + s * D;
    const float* sn = sin + s * D;
    T* yr = y + row * D;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const int64_t j = i * VEC;
      const Pack<T, VEC> a1 = load<T, VEC>(xr + j), a2 = load<T, VEC>(xr + half + j);
      const Pack<float, VEC> c1 = load<float, VEC>(c + j), c2 = load<float, VEC>(c + half + j);
      const Pack<float, VEC> s1 = load<float, VEC>(sn + j), s2 = load<float, VEC>(sn + half + j);
      Pack<T, VEC> o1, o2;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float x1 = to_f32(a1.v[k]), x2 = to_f32(a2.v[k]);
        const float first = backward ? -s2.v[k] : s1.v[k], second = backward ? -s1.v[k] : s2.v[k];
        o1.v[k] = from_f32<T>(x1 * c1.v[k] - x2 * first);
        o2.v[k] = from_f32<T>(x2 * c2.v[k] + x1 * second);
      }
      store<T, VEC>(yr + j, o1);
      store<T, VEC>(yr + half + j, o2);
    }
  }
}

template <typename T, int VEC>
cudaError_t launch(bool backward, const T* x, int64_t st0, int64_t st1, int64_t st2, const float* cos, const float* sin,
                   T* y, int64_t S, int64_t B, int64_t H, int64_t D, cudaStream_t stream) {
  const int64_t rows = S * B * H, packs = D / 2 / VEC;
  const int tx = static_cast<int>(std::min<int64_t>(packs, 32));
  const int ty = std::max(1, kThreads / tx);
  const dim3 block(tx, ty);
  rotary_kernel<T, VEC><<<grid_for(rows, ty), block, 0, stream>>>(x, st0, st1, st2, cos, sin, y, rows, B, H, D, backward);
  return cudaGetLastError();
}

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

cudaError_t rotary(DType dtype, bool backward, const void* x, int64_t st0, int64_t st1, int64_t st2, const float* cos,
                   const float* sin, void* y, int64_t S, int64_t B, int64_t H, int64_t D, cudaStream_t stream) {
  if (S * B * H == 0 || D == 0) return cudaSuccess;
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    const bool vec = (D / 2) % V == 0 && st0 % V == 0 && st1 % V == 0 && st2 % V == 0 && aligned16(x) && aligned16(y) &&
                     aligned(cos, V * sizeof(float)) && aligned(sin, V * sizeof(float));
    return vec ? launch<T, V>(backward, xp, st0, st1, st2, cos, sin, yp, S, B, H, D, stream)
               : launch<T, 1>(backward, xp, st0, st1, st2, cos, sin, yp, S, B, H, D, stream);
  });
}

}  // namespace cuda
}  // namespace hybridlm
