// CPU builds of the fused kernels: RMSNorm, rotary embedding and SwiGLU, forward and backward.
//
// The arithmetic is the CUDA kernels' (inputs widened to fp32, sums in fp32, one rounding to
// the output dtype; RMSNorm rounds the normalised value to the input dtype before the weight
// multiply, as the model's PyTorch definition does), so CI exercises the whole JIT path
// (build, load, call, compare) and the math without a GPU. Rows run in parallel through
// at::parallel_for (ATen's OpenMP pool, hence -fopenmp).
#include "../common.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>

namespace hybridlm {
namespace {

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }  // round-to-nearest-even for bf16/fp16

// Calls fn.template operator()<T>() with T the C++ type of dtype.
template <typename Fn>
void dispatch(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", dtype);
  }
}

// Rows per task so that a task touches at least ~32K elements.
inline int64_t grain(int64_t row_length) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_length)); }

// Sum of squares with eight partial sums (vectorisable, and closer to a tree than a running sum).
template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) {
      const float v = f32(x[j + k]);
      acc[k] += v * v;
    }
  for (; j < n; ++j) {
    const float v = f32(x[j]);
    acc[0] += v * v;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_rms_norm(x_in, weight_in);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    const T* wp = weight.const_data_ptr<T>();
    T* yp = y.mutable_data_ptr<T>();
    float* rp = rstd.mutable_data_ptr<float>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * n;
        T* yr = yp + r * n;
        const float rs = 1.f / std::sqrt(sum_of_squares(xr, n) / static_cast<float>(n) + static_cast<float>(eps));
        rp[r] = rs;
        for (int64_t j = 0; j < n; ++j) yr[j] = round_to<T>(f32(wp[j]) * f32(round_to<T>(f32(xr[j]) * rs)));
      }
    });
  });
  return {y, rstd};
}

// dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w (rounded to the dtype, as PyTorch's
// product is) and xhat = x * rstd; dweight = sum over rows of dy * round(xhat), accumulated
// in fp32 per thread chunk and summed over chunks at the end (deterministic for a thread count).
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                               const at::Tensor& weight_in, const at::Tensor& rstd_in) {
  check_rms_norm(x_in, weight_in);
  TORCH_CHECK(dy_in.sizes() == x_in.sizes() && dy_in.scalar_type() == x_in.scalar_type(),
              "rms_norm_bwd: dy must match x in shape and dtype");
  const at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), weight = weight_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows, "rms_norm_bwd: rstd must be float32 [rows]");
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows, at::get_num_threads()));
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor partial = at::zeros({chunks, n}, x.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* dyp = dy.const_data_ptr<T>();
    const T* xp = x.const_data_ptr<T>();
    const T* wp = weight.const_data_ptr<T>();
    const float* rp = rstd.const_data_ptr<float>();
    T* dxp = dx.mutable_data_ptr<T>();
    float* pp = partial.mutable_data_ptr<float>();
    at::parallel_for(0, chunks, 1, [&](int64_t cbegin, int64_t cend) {
      for (int64_t c = cbegin; c < cend; ++c) {
        float* acc = pp + c * n;
        for (int64_t r = c * rows / chunks; r < (c + 1) * rows / chunks; ++r) {
          const T* xr = xp + r * n;
          const T* dyr = dyp + r * n;
          T* dxr = dxp + r * n;
          const float rs = rp[r];
          float dot = 0.f;
          for (int64_t j = 0; j < n; ++j) dot += f32(round_to<T>(f32(dyr[j]) * f32(wp[j]))) * (f32(xr[j]) * rs);
          const float mean = dot / static_cast<float>(n);
          for (int64_t j = 0; j < n; ++j) {
            const float xhat = f32(xr[j]) * rs;
            const float g = f32(round_to<T>(f32(dyr[j]) * f32(wp[j])));
            dxr[j] = round_to<T>(rs * (g - xhat * mean));
            acc[j] += f32(dyr[j]) * f32(round_to<T>(xhat));
          }
        }
      }
    });
  });
  return {dx, partial.sum(0).to(weight.scalar_type())};
}

// out1 = a1 c1 - a2 s1, out2 = a2 c2 + a1 s2 over the two halves of each head. The backward is
// the same map with (s1, s2) = (-sin2, -sin1): the transpose of the rotation.
template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& y, bool backward) {
  const int64_t S = x.size(0), B = x.size(1), H = x.size(2), D = x.size(3), half = D / 2;
  const int64_t st0 = x.stride(0), st1 = x.stride(1), st2 = x.stride(2);
  const T* xp = x.const_data_ptr<T>();
  const float* cp = cos.const_data_ptr<float>();
  const float* sp = sin.const_data_ptr<float>();
  T* yp = y.mutable_data_ptr<T>();
  at::parallel_for(0, S * B * H, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t h = row % H, b = (row / H) % B, s = row / (H * B);
      const T* xr = xp + s * st0 + b * st1 + h * st2;
      const float* c = cp + s * D;
      const float* sn = sp + s * D;
      T* yr = yp + row * D;
      for (int64_t j = 0; j < half; ++j) {
        const float a1 = f32(xr[j]), a2 = f32(xr[j + half]);
        const float s1 = backward ? -sn[j + half] : sn[j];
        const float s2 = backward ? -sn[j] : sn[j + half];
        yr[j] = round_to<T>(a1 * c[j] - a2 * s1);
        yr[j + half] = round_to<T>(a2 * c[j + half] + a1 * s2);
      }
    }
  });
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  check_rotary(x, cos, sin);
  at::Tensor y = at::empty(x.sizes(), x.options());  // contiguous
  dispatch(x.scalar_type(), [&](auto tag) { rotate<decltype(tag)>(x, cos, sin, y, backward); });
  return y;
}

at::Tensor rotary_fwd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) { return rotary(x, cos, sin, false); }
at::Tensor rotary_bwd(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) { return rotary(dy, cos, sin, true); }

inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }

at::Tensor swiglu_fwd(const at::Tensor& h_in) {
  check_swiglu(h_in);
  const at::Tensor h = h_in.contiguous();
  const int64_t f = h.size(-1) / 2, rows = f ? h.numel() / (2 * f) : 0;
  at::Tensor y = at::empty(halved_last(h), h.options());
  dispatch(h.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* hp = h.const_data_ptr<T>();
    T* yp = y.mutable_data_ptr<T>();
    at::parallel_for(0, rows, grain(f), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t j = 0; j < f; ++j) {
          const float g = f32(hp[r * 2 * f + j]), u = f32(hp[r * 2 * f + f + j]);
          yp[r * f + j] = round_to<T>(g * sigmoid(g) * u);
        }
    });
  });
  return y;
}

// d gate = dy * up * silu'(gate), silu'(g) = sig(g) (1 + g (1 - sig(g))); d up = dy * silu(gate).
at::Tensor swiglu_bwd(const at::Tensor& dy_in, const at::Tensor& h_in) {
  check_swiglu(h_in);
  const at::Tensor h = h_in.contiguous(), dy = dy_in.contiguous();
  TORCH_CHECK(dy.sizes() == at::IntArrayRef(halved_last(h)) && dy.scalar_type() == h.scalar_type(),
              "swiglu_bwd: dy must be h's shape with the last dimension halved, in h's dtype");
  const int64_t f = h.size(-1) / 2, rows = f ? h.numel() / (2 * f) : 0;
  at::Tensor dh = at::empty(h.sizes(), h.options());
  dispatch(h.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* hp = h.const_data_ptr<T>();
    const T* dyp = dy.const_data_ptr<T>();
    T* dhp = dh.mutable_data_ptr<T>();
    at::parallel_for(0, rows, grain(f), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t j = 0; j < f; ++j) {
          const float g = f32(hp[r * 2 * f + j]), u = f32(hp[r * 2 * f + f + j]), d = f32(dyp[r * f + j]);
          const float sig = sigmoid(g);
          dhp[r * 2 * f + j] = round_to<T>(d * u * sig * (1.f + g * (1.f - sig)));
          dhp[r * 2 * f + f + j] = round_to<T>(d * g * sig);
        }
    });
  });
  return dh;
}

}  // namespace
}  // namespace hybridlm

HL_LIBRARY(TORCH_EXTENSION_NAME, m) {
  using namespace hybridlm;
  define_schemas(m);
  m.impl("rms_norm_fwd", c10::DispatchKey::CPU, &rms_norm_fwd);
  m.impl("rms_norm_bwd", c10::DispatchKey::CPU, &rms_norm_bwd);
  m.impl("rotary_fwd", c10::DispatchKey::CPU, &rotary_fwd);
  m.impl("rotary_bwd", c10::DispatchKey::CPU, &rotary_bwd);
  m.impl("swiglu_fwd", c10::DispatchKey::CPU, &swiglu_fwd);
  m.impl("swiglu_bwd", c10::DispatchKey::CPU, &swiglu_bwd);
}

HL_PYTHON_MODULE()
