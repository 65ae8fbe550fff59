// What the CPU and the CUDA extension share: the operator schemas, the shape checks, and
// the stub that lets torch.utils.cpp_extension.load() import the library as a module.
//
// The kernels are registered with the PyTorch dispatcher (TORCH_LIBRARY) rather than bound
// with pybind11: the extension then needs only light ATen headers (about a third of the
// compile time of torch/extension.h on a 2-core CI machine), and torch.compile can treat
// the ops as opaque custom operators. Python reaches them as torch.ops.<namespace>.<op>,
// where <namespace> is the module's `op_namespace` (the extension's build name).
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#define HL_STR_(x) #x
#define HL_STR(x) HL_STR_(x)
#define HL_CAT_(a, b) a##b
#define HL_CAT(a, b) HL_CAT_(a, b)

// TORCH_LIBRARY pastes its namespace argument with ##, which would stop the build-name
// macro from expanding; one more level of macro expansion resolves it first.
#define HL_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

// A Python module holding only the namespace name; importing it runs the registrations.
#define HL_PYTHON_MODULE()                                                                  \
  static PyModuleDef hl_module_def = {PyModuleDef_HEAD_INIT, HL_STR(TORCH_EXTENSION_NAME), \
                                      nullptr, -1, nullptr};                                 \
  PyMODINIT_FUNC HL_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {                              \
    PyObject* module = PyModule_Create(&hl_module_def);                                     \
    if (module != nullptr &&                                                                \
        PyModule_AddStringConstant(module, "op_namespace", HL_STR(TORCH_EXTENSION_NAME)) < 0) { \
      Py_DECREF(module);                                                                    \
      return nullptr;                                                                       \
    }                                                                                       \
    return module;                                                                          \
  }

namespace hybridlm {

// The operators every build provides (same names and signatures on every device).
inline void define_schemas(torch::Library& m) {
  // x [..., n], weight [n] -> y (x's shape and dtype), rstd [rows] fp32 (saved for backward)
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  // -> dx (x's shape), dweight (weight's dtype)
  m.def("rms_norm_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  // x [s, b, heads, d] (last dim contiguous, other strides free), cos/sin [s, d] fp32 -> contiguous
  m.def("rotary_fwd(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rotary_bwd(Tensor dy, Tensor cos, Tensor sin) -> Tensor");
  // h [..., 2f] = [gate | up] -> silu(gate) * up [..., f]
  m.def("swiglu_fwd(Tensor h) -> Tensor");
  m.def("swiglu_bwd(Tensor dy, Tensor h) -> Tensor");
}

inline bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

inline void check_rms_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "rms_norm: weight [", weight.sizes(), "] does not match the last dimension of x ", x.sizes());
  TORCH_CHECK(supported_dtype(x.scalar_type()) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x and weight must share one dtype of float32, bfloat16 or float16; got ",
              x.scalar_type(), " and ", weight.scalar_type());
}

// Checks x [s, b, heads, d] against cos/sin [s, d]; returns nothing, throws a readable error.
inline void check_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4, "rotary: x must be [seq, batch, heads, head_dim], got ", x.sizes());
  TORCH_CHECK(x.size(3) % 2 == 0, "rotary: head_dim must be even, got ", x.size(3));
  TORCH_CHECK(x.stride(3) == 1, "rotary: the head dimension of x must be contiguous");
  TORCH_CHECK(supported_dtype(x.scalar_type()), "rotary: unsupported dtype ", x.scalar_type());
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == x.size(0) && t->size(1) == x.size(3),
                "rotary: cos and sin must be contiguous float32 [seq, head_dim] = [", x.size(0), ", ",
                x.size(3), "], got ", t->sizes(), " ", t->scalar_type());
  }
}

inline void check_swiglu(const at::Tensor& h) {
  TORCH_CHECK(h.dim() >= 1 && h.size(-1) % 2 == 0, "swiglu: the last dimension of h must be even ([gate | up]), got ",
              h.sizes());
  TORCH_CHECK(supported_dtype(h.scalar_type()), "swiglu: unsupported dtype ", h.scalar_type());
}

// The output shape of swiglu: h's shape with the last dimension halved.
inline std::vector<int64_t> halved_last(const at::Tensor& h) {
  std::vector<int64_t> shape(h.sizes().begin(), h.sizes().end());
  shape.back() /= 2;
  return shape;
}

}  // namespace hybridlm
