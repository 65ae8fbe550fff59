// CUDA build of the fused kernels: tensor checks, allocation and the current stream here,
// the kernels in the .cu files behind the plain launchers of launchers.h.
#include "../common.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>

#include "launchers.h"

namespace hybridlm {
namespace {

cuda::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return cuda::DType::kFloat32;
    case at::kBFloat16: return cuda::DType::kBFloat16;
    case at::kHalf: return cuda::DType::kFloat16;
    default: TORCH_CHECK(false, "unsupported dtype ", t);
  }
}

void check_cuda(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.is_cuda(), op, ": expected a CUDA tensor, got one on ", t.device());
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

void check_rows(int64_t rows, const char* op) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), op, ": too many rows (", rows, ") for one launch");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  check_rms_norm(x_in, weight_in);
  check_cuda(x_in, "rms_norm_fwd");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  check_rows(rows, "rms_norm_fwd");
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  check_launch(cuda::rms_norm_fwd(to_dtype(x.scalar_type()), x.const_data_ptr(), weight.const_data_ptr(), y.mutable_data_ptr(),
                                  rstd.mutable_data_ptr<float>(), rows, n, static_cast<float>(eps),
                                  c10::cuda::getCurrentCUDAStream()),
               "rms_norm_fwd");
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                               const at::Tensor& weight_in, const at::Tensor& rstd_in) {
  check_rms_norm(x_in, weight_in);
  check_cuda(x_in, "rms_norm_bwd");
  TORCH_CHECK(dy_in.sizes() == x_in.sizes() && dy_in.scalar_type() == x_in.scalar_type(),
              "rms_norm_bwd: dy must match x in shape and dtype");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), weight = weight_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows, "rms_norm_bwd: rstd must be float32 [rows]");
  const cuda::DType dtype = to_dtype(x.scalar_type());
  const int blocks = cuda::rms_norm_bwd_blocks(dtype, rows, n);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor partial = at::empty({blocks, n}, x.options().dtype(at::kFloat));
  if (rows == 0) partial.zero_();
  check_launch(cuda::rms_norm_bwd(dtype, dy.const_data_ptr(), x.const_data_ptr(), weight.const_data_ptr(),
                                  rstd.const_data_ptr<float>(), dx.mutable_data_ptr(), partial.mutable_data_ptr<float>(),
                                  blocks, rows, n, c10::cuda::getCurrentCUDAStream()),
               "rms_norm_bwd");
  return {dx, partial.sum(0).to(weight.scalar_type())};
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool backward) {
  check_rotary(x, cos, sin);
  check_cuda(x, "rotary");
  TORCH_CHECK(cos.device() == x.device() && sin.device() == x.device(), "rotary: cos and sin must be on x's device");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty(x.sizes(), x.options());
  check_launch(cuda::rotary(to_dtype(x.scalar_type()), backward, x.const_data_ptr(), x.stride(0), x.stride(1), x.stride(2),
                            cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), y.mutable_data_ptr(), x.size(0),
                            x.size(1), x.size(2), x.size(3), c10::cuda::getCurrentCUDAStream()),
               "rotary");
  return y;
}

at::Tensor rotary_fwd(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) { return rotary(x, cos, sin, false); }
at::Tensor rotary_bwd(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) { return rotary(dy, cos, sin, true); }

at::Tensor swiglu_fwd(const at::Tensor& h_in) {
  check_swiglu(h_in);
  check_cuda(h_in, "swiglu_fwd");
  const c10::cuda::CUDAGuard guard(h_in.device());
  const at::Tensor h = h_in.contiguous();
  const int64_t f = h.size(-1) / 2, rows = f ? h.numel() / (2 * f) : 0;
  at::Tensor y = at::empty(halved_last(h), h.options());
  check_launch(cuda::swiglu_fwd(to_dtype(h.scalar_type()), h.const_data_ptr(), y.mutable_data_ptr(), rows, f,
                                c10::cuda::getCurrentCUDAStream()),
               "swiglu_fwd");
  return y;
}

at::Tensor swiglu_bwd(const at::Tensor& dy_in, const at::Tensor& h_in) {
  check_swiglu(h_in);
  check_cuda(h_in, "swiglu_bwd");
  const c10::cuda::CUDAGuard guard(h_in.device());
  const at::Tensor h = h_in.contiguous(), dy = dy_in.contiguous();
  TORCH_CHECK(dy.sizes() == at::IntArrayRef(halved_last(h)) && dy.scalar_type() == h.scalar_type(),
              "swiglu_bwd: dy must be h's shape with the last dimension halved, in h's dtype");
  const int64_t f = h.size(-1) / 2, rows = f ? h.numel() / (2 * f) : 0;
  at::Tensor dh = at::empty(h.sizes(), h.options());
  check_launch(cuda::swiglu_bwd(to_dtype(h.scalar_type()), dy.const_data_ptr(), h.const_data_ptr(), dh.mutable_data_ptr(),
                                rows, f, c10::cuda::getCurrentCUDAStream()),
               "swiglu_bwd");
  return dh;
}

}  // namespace
}  // namespace hybridlm

HL_LIBRARY(TORCH_EXTENSION_NAME, m) {
  using namespace hybridlm;
  define_schemas(m);
  m.impl("rms_norm_fwd", c10::DispatchKey::CUDA, &rms_norm_fwd);
  m.impl("rms_norm_bwd", c10::DispatchKey::CUDA, &rms_norm_bwd);
  m.impl("rotary_fwd", c10::DispatchKey::CUDA, &rotary_fwd);
  m.impl("rotary_bwd", c10::DispatchKey::CUDA, &rotary_bwd);
  m.impl("swiglu_fwd", c10::DispatchKey::CUDA, &swiglu_fwd);
  m.impl("swiglu_bwd", c10::DispatchKey::CUDA, &swiglu_bwd);
}

HL_PYTHON_MODULE()
