// Reductions: row sums (oneDNN reduction_sum) and scaled accumulation (oneDNN sum, in place).
#include "absl/strings/str_cat.h"
#include "worker/kernels/primitive_kernel.h"

namespace meshrun {

using kernels::CpuEngine;
using kernels::Guard;
using kernels::MemoryFor;
using kernels::PrimitiveKernel;
using kernels::RowMajorDesc;

absl::StatusOr<std::unique_ptr<Kernel>> CreateReduceSumRows(const Tensor& x, Tensor& out) {
  if (x.dims().size() != 2 || out.num_elements() != x.dims()[1]) {
    return absl::InvalidArgumentError(absl::StrCat("reduce_sum_rows: input ", DimsToString(x.dims()),
                                                   " and output ", DimsToString(out.dims()),
                                                   " do not match; expected [n, k] -> [k]"));
  }
  std::unique_ptr<Kernel> kernel;
  absl::Status s = Guard("reduce_sum_rows", [&] {
    auto src_md = RowMajorDesc(x.dims());
    auto dst_md = RowMajorDesc({1, x.dims()[1]});
    dnnl::reduction::primitive_desc pd(
        dnnl::reduction::desc(dnnl::algorithm::reduction_sum, src_md, dst_md, 0.0f, 0.0f), CpuEngine());
    kernel = std::make_unique<PrimitiveKernel>(
        "reduce_sum_rows", dnnl::reduction(pd),
        std::unordered_map<int, dnnl::memory>{{DNNL_ARG_SRC, MemoryFor(src_md, x.raw())},
                                              {DNNL_ARG_DST, MemoryFor(dst_md, out.raw())}});
  });
  if (!s.ok()) return s;
  return kernel;
}

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
        std::unordered_map<int, dnnl::memory>{{DNNL_ARG_MULTIPLE_SRC + 0, MemoryFor(md, acc.raw())},
                                              {DNNL_ARG_MULTIPLE_SRC + 1, MemoryFor(md, x.raw())},
                                              {DNNL_ARG_DST, MemoryFor(md, acc.raw())}});
  });
  if (!s.ok()) return s;
  return kernel;
}

}  // namespace meshrun
