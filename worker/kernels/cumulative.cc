// Cumulative reductions along one dim (jax.lax.cumsum, cumprod, cummax, cummin): a loop, as
// oneDNN has no scan primitive.
#include <algorithm>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "worker/kernels/kernel.h"

namespace meshrun {
namespace {

class CumulativeKernel : public Kernel {
 public:
  CumulativeKernel(int fn, int64_t dim, bool reverse, const Tensor& x, Tensor& y)
      : fn_(fn), reverse_(reverse), x_(x), y_(y) {
    const Dims& d = x.dims();
    outer_ = 1;
    for (int64_t i = 0; i < dim; ++i) outer_ *= d[i];
    n_ = d[dim];
    inner_ = 1;
    for (size_t i = dim + 1; i < d.size(); ++i) inner_ *= d[i];
  }

  absl::Status Run() override {
    const float* x = x_.data<float>();
    float* y = y_.data<float>();
    for (int64_t o = 0; o < outer_; ++o) {
      const int64_t base = o * n_ * inner_;
      for (int64_t k = 0; k < n_; ++k) {
        const int64_t i = reverse_ ? n_ - 1 - k : k;
        const float* xi = x + base + i * inner_;
        float* yi = y + base + i * inner_;
        if (k == 0) {
          std::copy(xi, xi + inner_, yi);
          continue;
        }
        const float* prev = y + base + (reverse_ ? i + 1 : i - 1) * inner_;
        for (int64_t j = 0; j < inner_; ++j) yi[j] = Combine(prev[j], xi[j]);
      }
    }
    return absl::OkStatus();
  }

 private:
  float Combine(float acc, float v) const {
    switch (fn_) {
      case 0:
        return acc + v;
      case 1:
        return acc * v;
      case 2:
        return std::max(acc, v);
      default:
        return std::min(acc, v);
    }
  }

  int fn_;
  bool reverse_;
  const Tensor& x_;
  Tensor& y_;
  int64_t outer_ = 1, n_ = 1, inner_ = 1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Kernel>> CreateCumulative(const std::string& fn, int64_t dim,
                                                         bool reverse, const Tensor& x, Tensor& y) {
  const int code = fn == "sum" ? 0 : fn == "prod" ? 1 : fn == "max" ? 2 : fn == "min" ? 3 : -1;
  if (code < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown cumulative fn '", fn, "'; allowed: sum prod max min"));
  }
  if (x.dtype() != v1::DTYPE_F32 || y.dtype() != v1::DTYPE_F32 || x.dims() != y.dims() || dim < 0 ||
      dim >= static_cast<int64_t>(x.dims().size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("cumulative ", fn, " along dim ", dim, ": x ", DTypeName(x.dtype()),
                     DimsToString(x.dims()), ", y ", DTypeName(y.dtype()), DimsToString(y.dims()),
                     "; expected f32 of one shape and a dim of it"));
  }
  return std::unique_ptr<Kernel>(std::make_unique<CumulativeKernel>(code, dim, reverse, x, y));
}

}  // namespace meshrun
