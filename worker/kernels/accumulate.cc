// Scaled accumulation (oneDNN sum, in place).
#include "absl/strings/str_cat.h"
#include "worker/kernels/primitive_kernel.h"

namespace meshrun {

using kernels::CpuEngine;
using kernels::Guard;
using kernels::Bind;
using kernels::PrimitiveKernel;
using kernels::RowMajorDesc;

absl::StatusOr<std::unique_ptr<Kernel>> CreateAccumulate(const Tensor& x, float scale, Tensor& acc) {
  if (x.num_elements() != acc.num_elements()) {
    return absl::InvalidArgumentError(absl::StrCat("accumulate: ", DimsToString(x.dims()), " into ",
                                                   DimsToString(acc.dims()), " (element counts differ)"));
  }
  std::unique_ptr<Kernel> kernel;
  absl::Status s = Guard("accumulate", [&] {
    auto md = RowMajorDesc({x.num_elements()});
    dnnl::sum::primitive_desc pd(md, {1.0f, scale}, {md, md}, CpuEngine());
    kernel = std::make_unique<PrimitiveKernel>(
        "accumulate", dnnl::sum(pd),
        kernels::Args{{DNNL_ARG_MULTIPLE_SRC + 0, Bind(md, acc)},
                                              {DNNL_ARG_MULTIPLE_SRC + 1, Bind(md, x)},
                                              {DNNL_ARG_DST, Bind(md, acc)}});
  });
  if (!s.ok()) return s;
  return kernel;
}

}  // namespace meshrun
