// jax.lax.sort along one dim: several operands of one shape permuted together by the
// lexicographic order of the first num_keys (a stable sort, as lax.sort with is_stable), floats
// in the order of lax.sort's comparator (-inf < ... < inf < NaN, with -0 equal to +0 and every
// NaN equal to every other, so a stable sort keeps them in place; jax/_src/lax/lax.py,
// _sort_lt_comparator).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

// Element i of t (a 4-byte dtype) as an integer ordered as lax.sort orders its values.
int64_t SortKey(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case v1::DTYPE_F32: {
      const float x = t.data<float>()[i];
      if (x == 0.0f) return 0;                     // -0 as +0
      if (std::isnan(x)) return int64_t{1} << 40;  // any NaN, above +inf
      int32_t b;
      std::memcpy(&b, &x, 4);
      return b < 0 ? -static_cast<int64_t>(b & 0x7FFFFFFF) : b;  // negatives below zero
    }
    case v1::DTYPE_I32:
      return t.data<int32_t>()[i];
    default:
      return t.data<uint32_t>()[i];
  }
}

class SortKernel : public Kernel {
 public:
  SortKernel(std::vector<const Tensor*> operands, int64_t dim, int num_keys, int result, Tensor& y)
      : operands_(std::move(operands)), num_keys_(num_keys), result_(result), y_(y) {
    const Dims& d = y.dims();
    for (int64_t i = 0; i < dim; ++i) outer_ *= d[i];
    n_ = d[dim];
    for (size_t i = dim + 1; i < d.size(); ++i) inner_ *= d[i];
  }

  absl::Status Run() override {
    std::vector<int64_t> order(n_);
    const char* src = static_cast<const char*>(operands_[result_]->raw());
    char* dst = static_cast<char*>(y_.raw());
    for (int64_t o = 0; o < outer_; ++o) {
      for (int64_t j = 0; j < inner_; ++j) {
        const int64_t base = o * n_ * inner_ + j;
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
          for (int k = 0; k < num_keys_; ++k) {
            const int64_t ka = SortKey(*operands_[k], base + a * inner_);
            const int64_t kb = SortKey(*operands_[k], base + b * inner_);
            if (ka != kb) return ka < kb;
          }
          return false;
        });
        for (int64_t i = 0; i < n_; ++i)
          std::memcpy(dst + (base + i * inner_) * 4, src + (base + order[i] * inner_) * 4, 4);
      }
    }
    return absl::OkStatus();
  }

 private:
  std::vector<const Tensor*> operands_;
  int num_keys_;
  int result_;
  Tensor& y_;
  int64_t outer_ = 1, n_ = 1, inner_ = 1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateSort(const std::vector<const Tensor*>& operands,
                                                   int64_t dim, int num_keys, int result,
                                                   Tensor& y) {
  if (operands.empty() || num_keys < 1 || num_keys > static_cast<int>(operands.size()) ||
      result < 0 || result >= static_cast<int>(operands.size())) {
    return absl::InvalidArgumentError(absl::StrCat("sort of ", operands.size(), " operands with ",
                                                   num_keys, " keys, result ", result,
                                                   ": expected 1 <= keys <= operands"));
  }
  for (const Tensor* t : operands) {
    const DType dt = t->dtype();
    if (t->dims() != y.dims() || DTypeSize(dt) != 4 ||
        (dt != v1::DTYPE_F32 && dt != v1::DTYPE_I32 && dt != v1::DTYPE_U32) || dim < 0 ||
        dim >= static_cast<int64_t>(y.dims().size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sort along dim ", dim, ": operand ", DTypeName(dt), DimsToString(t->dims()), ", output ",
          DimsToString(y.dims()), "; expected f32, i32 or u32 operands of the output's shape"));
    }
  }
  if (y.dtype() != operands[result]->dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("sort: output ", DTypeName(y.dtype()),
                                                   " differs from its operand's ",
                                                   DTypeName(operands[result]->dtype())));
  }
  return std::unique_ptr<Kernel>(std::make_unique<SortKernel>(operands, dim, num_keys, result, y));
}

}  // namespace meshrun
