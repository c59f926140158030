// Element-wise kernels: SiLU forward/backward (eltwise_swish) and element-wise multiply (binary_mul).
#include "absl/strings/str_cat.h"
#include "worker/kernels/primitive_kernel.h"

namespace meshrun {

using kernels::CpuEngine;
using kernels::Guard;
using kernels::Bind;
using kernels::PrimitiveKernel;
using kernels::RowMajorDesc;

namespace {

absl::Status SameShape(const char* op, const Tensor& a, const Tensor& b) {
  if (a.dims() != b.dims()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": shapes differ: ", DimsToString(a.dims()), " vs ",
                                                   DimsToString(b.dims())));
  }
  return absl::OkStatus();
}

dnnl::eltwise_forward::primitive_desc SiluForwardDesc(const dnnl::memory::desc& md) {
  return dnnl::eltwise_forward::primitive_desc(
      dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::eltwise_swish, md, 1.0f),
      CpuEngine());
}

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateSilu(const Tensor& x, Tensor& y) {
  if (absl::Status s = SameShape("silu", x, y); !s.ok()) return s;
  std::unique_ptr<Kernel> kernel;
  absl::Status s = Guard("silu", [&] {
    auto md = RowMajorDesc(x.dims());
    kernel = std::make_unique<PrimitiveKernel>(
        "silu", dnnl::eltwise_forward(SiluForwardDesc(md)),
        kernels::Args{{DNNL_ARG_SRC, Bind(md, x)},
                                              {DNNL_ARG_DST, Bind(md, y)}});
  });
  if (!s.ok()) return s;
  return kernel;
}

absl::StatusOr<std::unique_ptr<Kernel>> CreateSiluGrad(const Tensor& x, const Tensor& dy, Tensor& dx) {
  if (absl::Status s = SameShape("silu_grad", x, dy); !s.ok()) return s;
  if (absl::Status s = SameShape("silu_grad", x, dx); !s.ok()) return s;
  std::unique_ptr<Kernel> kernel;
  absl::Status s = Guard("silu_grad", [&] {
    auto md = RowMajorDesc(x.dims());
    dnnl::eltwise_backward::primitive_desc pd(
        dnnl::eltwise_backward::desc(dnnl::algorithm::eltwise_swish, md, md, 1.0f), CpuEngine(),
        SiluForwardDesc(md));
    kernel = std::make_unique<PrimitiveKernel>(
        "silu_grad", dnnl::eltwise_backward(pd),
        kernels::Args{{DNNL_ARG_SRC, Bind(md, x)},
                                              {DNNL_ARG_DIFF_DST, Bind(md, dy)},
                                              {DNNL_ARG_DIFF_SRC, Bind(md, dx)}});
  });
  if (!s.ok()) return s;
  return kernel;
}

absl::StatusOr<std::unique_ptr<Kernel>> CreateMultiply(const Tensor& a, const Tensor& b, Tensor& out) {
  if (absl::Status s = SameShape("multiply", a, b); !s.ok()) return s;
  if (absl::Status s = SameShape("multiply", a, out); !s.ok()) return s;
  std::unique_ptr<Kernel> kernel;
  absl::Status s = Guard("multiply", [&] {
    auto md = RowMajorDesc(a.dims());
    dnnl::binary::primitive_desc pd(dnnl::binary::desc(dnnl::algorithm::binary_mul, md, md, md), CpuEngine());
    kernel = std::make_unique<PrimitiveKernel>(
        "multiply", dnnl::binary(pd),
        kernels::Args{{DNNL_ARG_SRC_0, Bind(md, a)},
                                              {DNNL_ARG_SRC_1, Bind(md, b)},
                                              {DNNL_ARG_DST, Bind(md, out)}});
  });
  if (!s.ok()) return s;
  return kernel;
}

}  // namespace meshrun
