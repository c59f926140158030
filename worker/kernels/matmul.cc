// Matmul with optional bias: oneDNN's matmul primitive; transposes are expressed as strides.
#include "absl/strings/str_cat.h"
#include "worker/kernels/primitive_kernel.h"

namespace meshrun {

using kernels::CpuEngine;
using kernels::Guard;
using kernels::MemoryFor;
using kernels::PrimitiveKernel;

namespace {

// The logical [rows, cols] view of a stored 2-D array, transposed when `transpose`.
dnnl::memory::desc MatrixDesc(const Tensor& t, bool transpose) {
  const int64_t r = t.dims()[0], c = t.dims()[1];
  if (!transpose) return dnnl::memory::desc({r, c}, dnnl::memory::data_type::f32, {c, 1});
  return dnnl::memory::desc({c, r}, dnnl::memory::data_type::f32, {1, c});
}

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateMatmul(const Tensor& a, bool transpose_a, const Tensor& b,
                                                     bool transpose_b, const Tensor* bias, Tensor& c) {
  if (a.dims().size() != 2 || b.dims().size() != 2 || c.dims().size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("matmul needs 2-D operands; got a ", DimsToString(a.dims()),
                                                   ", b ", DimsToString(b.dims()), ", c ", DimsToString(c.dims())));
  }
  const int64_t m = transpose_a ? a.dims()[1] : a.dims()[0];
  const int64_t k = transpose_a ? a.dims()[0] : a.dims()[1];
  const int64_t kb = transpose_b ? b.dims()[1] : b.dims()[0];
  const int64_t n = transpose_b ? b.dims()[0] : b.dims()[1];
  if (k != kb || c.dims()[0] != m || c.dims()[1] != n) {
    return absl::InvalidArgumentError(absl::StrCat("matmul shapes do not agree: op(a) [", m, ", ", k, "] @ op(b) [",
                                                   kb, ", ", n, "] -> c ", DimsToString(c.dims())));
  }
  if (bias != nullptr && (bias->num_elements() != n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("matmul bias has shape ", DimsToString(bias->dims()), "; expected [", n, "]"));
  }
  std::unique_ptr<Kernel> kernel;
  absl::Status s = Guard("matmul", [&] {
    auto a_md = MatrixDesc(a, transpose_a);
    auto b_md = MatrixDesc(b, transpose_b);
    auto c_md = MatrixDesc(c, false);
    std::unordered_map<int, dnnl::memory> args = {{DNNL_ARG_SRC, MemoryFor(a_md, a.raw())},
                                                  {DNNL_ARG_WEIGHTS, MemoryFor(b_md, b.raw())},
                                                  {DNNL_ARG_DST, MemoryFor(c_md, c.raw())}};
    dnnl::matmul::primitive_desc pd;
    if (bias != nullptr) {
      dnnl::memory::desc bias_md({1, n}, dnnl::memory::data_type::f32, {n, 1});
      args[DNNL_ARG_BIAS] = MemoryFor(bias_md, bias->raw());
      pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, bias_md, c_md), CpuEngine());
    } else {
      pd = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), CpuEngine());
    }
    kernel = std::make_unique<PrimitiveKernel>("matmul", dnnl::matmul(pd), std::move(args));
  });
  if (!s.ok()) return s;
  return kernel;
}

}  // namespace meshrun
